"""What lets a client answer repeated reads of unchanged keys from shared memory without asking the worker.

A client may keep a lease on an immutable, TTL-free object and serve later reads of that key straight
from the segment, as long as that key did not change since it took the lease. The worker says so
through a shared table every client maps read-only:

- one 64-bit **generation**, bumped before and after every change the worker makes (put, seal,
  delete, expire, decref): "something changed somewhere";
- **slots**: 131,072 64-bit counters (1 MiB), the slot of a key chosen by the worker (``slot_of``, sent
  to the client with each cacheable lease). Inside a change, after the engine made it, the slot of each
  key it touched is bumped. Keys share slots: a change to one makes the others of its slot look
  changed too, which costs a round trip, never a wrong answer. (With 8,192 slots, a round of 64 keys
  written and deleted elsewhere made one of 64 kept keys need a lease again in ~40% of rounds of
  ``kvstrata bench store``'s device rows, 2026-12-01, ``tools/probe_store_ops.py``; with 131,072, ~3%.)

A client keeps, per entry, its slot's count and the generation at which it last found that count
unchanged. An entry is good while the generation is still that one (one load); once the generation
moved, the entry is good if its slot still shows the count (then it records the generation read
*before* that slot load: any later change bumps the generation again). When the lease is taken, the
slot is read first and the generation checked afterwards against the one read before the request, so a
change during the request is never missed. Writes to other keys leave the entry alone: the reason
for the slots (a node that stores new KV blocks all the time keeps its readers' entries).

The leased bytes themselves never move or change (a lease pins that version). Only the worker's own
changes bump the counters, so only objects whose visibility nothing else can end are cacheable:
sealed (not published), with no TTL (the engine expires those on its own), written since this worker
started (a TTL read back from SSD after a restart is not known here). The no-TTL set is kept exact
under concurrent writers of one key by per-key lock stripes around the engine call and the set update.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterable

import numpy as np

log = logging.getLogger(__name__)

_STRIPES = 64
#: byte offset, in the page, of the worker's advice to clients: microseconds to busy-poll for a reply
SPIN_HINT_OFFSET = 8
#: byte offset, in the page, of the worker's *reclaim* count: bumped when a write finds no room but leased objects,
#: so that clients give back the leases their local-read caches keep (:mod:`kvstrata.client.local_reads`)
RECLAIM_OFFSET = 16
MAX_TRACKED_KEYS = 1_000_000  # beyond this many, new keys are just not cacheable (bounded memory)
PAGE_BYTES = 4096  # the generation, the spin hint and the reclaim count
SLOTS = 1 << 17  # per-key counters after the first page (a power of two: a slot is a hash's low bits)
SLOTS_OFFSET = PAGE_BYTES
TABLE_BYTES = PAGE_BYTES + 8 * SLOTS
_LOOP_MAX = 8  # a change of more keys bumps their slots with numpy


class _Change:
    """``with validity.change(keys):`` bumps the generation on the way in and, after bumping the slots
    of ``keys``, on the way out (see the module docstring for why in this order)."""

    __slots__ = ("_counts", "_gen", "_keys", "_lock", "_slots")

    def __init__(
        self, gen: ctypes.c_uint64, lock: threading.Lock, slots: ctypes.Array, counts: np.ndarray, keys: Iterable[str]
    ) -> None:
        self._gen, self._lock, self._slots, self._counts, self._keys = gen, lock, slots, counts, keys

    def __enter__(self) -> None:
        with self._lock:
            self._gen.value += 1

    def __exit__(self, *exc: object) -> None:
        slots = self._slots
        with self._lock:
            keys = self._keys
            if isinstance(keys, str):
                slots[hash(keys) & (SLOTS - 1)] += 1
            elif type(keys) is list and len(keys) > _LOOP_MAX:
                # One vector add instead of a ctypes store per key (~0.3 us each). Keys sharing a slot bump it
                # once: a reader only asks whether the count moved, never by how much.
                idx = np.fromiter(map(hash, keys), np.int64, len(keys)) & (SLOTS - 1)
                counts = self._counts
                counts[idx] += np.uint64(1)
            else:
                for key in keys:
                    slots[hash(key) & (SLOTS - 1)] += 1
            self._gen.value += 1


class Validity:
    """The generation page and the set of keys whose current version has no TTL."""

    def __init__(self) -> None:
        from kvstrata.memory.shm import SharedSegment

        self.segment = SharedSegment.create(TABLE_BYTES, name="kvstrata-generation", hugepages="off", numa_node=None)
        # One aligned 8-byte store/load: readers never see a torn value.
        self._gen = ctypes.c_uint64.from_address(self.segment.address)
        self._spin_hint = ctypes.c_uint64.from_address(self.segment.address + SPIN_HINT_OFFSET)
        self._reclaim = ctypes.c_uint64.from_address(self.segment.address + RECLAIM_OFFSET)
        self._slots = (ctypes.c_uint64 * SLOTS).from_address(self.segment.address + SLOTS_OFFSET)
        self._counts = np.frombuffer(self._slots, dtype=np.uint64)  # the same counters, for batches
        self._gen_lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._no_ttl: set[str] = set()
        self._warned = False

    @property
    def fd(self) -> int:
        return self.segment.fd

    @staticmethod
    def slot_of(key: str) -> int:
        """The counter of ``key`` (this worker's string hash: stable for its lifetime, never sent as a hash)."""
        return hash(key) & (SLOTS - 1)

    def bump_all(self) -> None:
        """Every entry of every client goes stale (the worker is stopping)."""
        with self._gen_lock:
            self._gen.value += 1
            self._counts += np.uint64(1)
            self._gen.value += 1

    def change(self, keys: str | Iterable[str]) -> _Change:
        """Around any change to the visible objects of ``keys`` (one key or an iterable read on the way out):
        clients holding leases on them stop trusting them. A plain context-manager object, not a
        generator: it runs around every write request."""
        return _Change(self._gen, self._gen_lock, self._slots, self._counts, keys)

    def set_spin_hint(self, microseconds: float) -> None:
        """Tell clients how long to busy-poll for a reply (0: sleep at once); see kvstrata.server.worker."""
        if self._spin_hint is not None:
            self._spin_hint.value = int(microseconds)

    def ask_reclaim(self) -> None:
        """Ask every client to give back the leases its local-read cache keeps (a write found no room but leased
        objects): each client's keeper thread sees the count move within ``KEEPER_POLL_S`` and lets go of every
        entry no view of the application holds."""
        with self._gen_lock:
            if self._reclaim is not None:  # (closed: the worker stopped)
                self._reclaim.value += 1

    def key_lock(self, key: str) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    def key_locks(self, keys: Iterable[str]) -> list[threading.Lock]:
        """The stripes of ``keys``, each once, in the one order every caller takes them (no deadlock)."""
        stripes = self._stripes
        return [stripes[i] for i in sorted({hash(key) % _STRIPES for key in keys})]

    def written_many(self, keys: list[str], ttls: list[float | None]) -> None:
        """:meth:`written` of each key with its TTL; call holding :meth:`key_locks` of ``keys``."""
        no_ttl = self._no_ttl
        if ttls.count(None) == len(ttls) and len(no_ttl) + len(keys) <= MAX_TRACKED_KEYS:
            no_ttl.update(keys)  # what nearly every batch is: TTL-free, tracked
            return
        for key, ttl in zip(keys, ttls):
            self.written(key, ttl)

    def shown(self, keys: list[str], ttl: float | None) -> None:
        """Commits sent ahead of their copies made ``keys`` visible as they landed, all with ``ttl``: the store calls
        this under its lock (:meth:`kvstrata.store.engine.ObjectStore.set_visibility`), so the set changes in the same
        step as the versions, and no stripe is taken (stripes are taken before the store's lock, never after). None
        is needed: a write of one of these keys racing with the landing either shows its version before it (then
        replaced here) or after it, and then updates the set itself, as after any write."""
        self.written_many(keys, [ttl] * len(keys))

    def written(self, key: str, ttl: float | None) -> None:
        """Call under ``key_lock(key)`` right after a version of ``key`` became visible."""
        if ttl is not None:
            self._no_ttl.discard(key)
        elif len(self._no_ttl) < MAX_TRACKED_KEYS:
            self._no_ttl.add(key)
        elif not self._warned:
            self._warned = True
            log.info("tracking %d keys for local reads; newer keys are read through the worker", MAX_TRACKED_KEYS)

    def ttl_changed(self, key: str) -> None:
        """Call under ``key_lock(key)`` after ``expire`` touched ``key``."""
        self._no_ttl.discard(key)

    @property
    def no_ttl(self) -> set[str]:
        """Keys whose current version has no TTL (read-only use: batch handlers test membership inline)."""
        return self._no_ttl

    def cacheable(self, key: str, lease: object) -> bool:
        return key in self._no_ttl and not getattr(lease, "mutable", True)

    def close(self) -> None:
        self._gen = self._slots = self._counts = None  # type: ignore[assignment]  # never a store into an unmapped page
        self._spin_hint = self._reclaim = None  # type: ignore[assignment]
        self.segment.close()
