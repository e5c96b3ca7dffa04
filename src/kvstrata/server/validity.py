"""What lets a client answer repeated small ``get``s from shared memory without asking the worker.

A client may keep a lease on a small, immutable, TTL-free object and serve later ``get``s of that
key straight from the segment, as long as nothing changed since it took the lease. "Nothing
changed" is one 64-bit **generation** in a shared page every client maps read-only: the worker
bumps it before and after every change it makes (put, seal, publish, delete, expire, decref), so
a client that read generation G before its request may serve the leased bytes while the page still
says G. The leased bytes themselves never move or change (a lease pins that version).

Only the worker's own changes bump the generation, so only objects whose visibility nothing else
can end are cacheable: sealed (not published), with no TTL (the engine expires those on its own),
written since this worker started (a TTL read back from SSD after a restart is not known here).
The no-TTL set is kept exact under concurrent writers of one key by per-key lock stripes around
the engine call and the set update.
"""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

_STRIPES = 64
#: byte offset, in the page, of the worker's advice to clients: microseconds to busy-poll for a reply
SPIN_HINT_OFFSET = 8
MAX_TRACKED_KEYS = 1_000_000  # beyond this many, new keys are just not cacheable (bounded memory)
PAGE_BYTES = 4096


class _Change:
    """``with validity.change():`` bumps the generation on the way in and on the way out.

    The bump is inlined (not a call to :meth:`Validity.bump`): this runs twice around every write."""

    __slots__ = ("_gen", "_lock")

    def __init__(self, gen: ctypes.c_uint64, lock: threading.Lock) -> None:
        self._gen, self._lock = gen, lock

    def __enter__(self) -> None:
        with self._lock:
            self._gen.value += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._gen.value += 1


class Validity:
    """The generation page and the set of keys whose current version has no TTL."""

    def __init__(self) -> None:
        from kvstrata.memory.shm import SharedSegment

        self.segment = SharedSegment.create(PAGE_BYTES, name="kvstrata-generation", hugepages="off", numa_node=None)
        # One aligned 8-byte store/load: readers never see a torn value.
        self._gen = ctypes.c_uint64.from_address(self.segment.address)
        self._spin_hint = ctypes.c_uint64.from_address(self.segment.address + SPIN_HINT_OFFSET)
        self._gen_lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._no_ttl: set[str] = set()
        self._change = _Change(self._gen, self._gen_lock)
        self._warned = False

    @property
    def fd(self) -> int:
        return self.segment.fd

    def bump(self) -> None:
        with self._gen_lock:
            self._gen.value += 1

    def change(self) -> _Change:
        """Around any change to visible objects: readers holding the old generation stop trusting it.

        A plain context-manager object, not a generator: it runs around every write request."""
        return self._change

    def set_spin_hint(self, microseconds: float) -> None:
        """Tell clients how long to busy-poll for a reply (0: sleep at once); see kvstrata.server.worker."""
        if self._spin_hint is not None:
            self._spin_hint.value = int(microseconds)

    def key_lock(self, key: str) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

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
        self._gen = self._change._gen = None  # type: ignore[assignment]  # never a store into an unmapped page
        self._spin_hint = None  # type: ignore[assignment]
        self.segment.close()
