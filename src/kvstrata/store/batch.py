"""Batch writes with per-key results, and the write-once form used by ``mset_d2h``.

``create_many`` / ``seal_many`` run a whole batch in one critical section (the worker answers a
device call's stage of keys with them): the batch's objects are carved side by side where one free
range holds them all, and sealed together, the blocks of the versions they replace given back as
ranges. ``put_many`` is :meth:`~kvstrata.store.engine.ObjectStore.put` per key, its small values written many
per hold of the lock.

Every key of a batch gets its own result: ``None`` (done), a :class:`~kvstrata.store.Location`
(for creates) or the :class:`~kvstrata.errors.KvstrataError` that key met (``KeyExists`` for a
write-once key already present, ``CapacityError``...). One failed key never hides the others. Bad
arguments to ``put_many`` (a non-str key, a non-bytes value, a negative size) are still a
ValueError/TypeError for the whole call, raised before anything is written; ``create_many`` and
``seal_many`` return them in the key's slot.

Example::

    store.put_many([("a", b"1"), ("b", b"2")], nx=True)    # write-once: [None, None]
    store.put_many([("a", b"x"), ("c", b"3")], nx=True)    # [KeyExists(...), None]; "a" unchanged

This is a mixin of :class:`~kvstrata.store.engine.ObjectStore`.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable

from kvstrata.errors import CapacityError, ClosedError, InvalidValue, KeyExists, KeyNotFound, KvstrataError, ServerError
from kvstrata.store.config import WriteMode
from kvstrata.store.objects import (
    FAST_KEY_CHARS,
    Entry,
    as_bytes_view,
    check_key,
    check_mode,
    check_size,
    check_ttl,
)
from kvstrata.store.tiers.base import Location
from kvstrata.store.writes import _OPEN_CREATE, _SMALL, reusable_block

#: the most small values ``put_many`` writes per hold of the lock, and the most bytes: a hold stays ~1 ms on the
#: development machine, so another client's request waits at most about that
PUT_CHUNK = 256
PUT_CHUNK_BYTES = 4 << 20


class BatchMixin:
    """``put_many`` / ``create_many`` / ``seal_many`` of the engine (see the module docstring; the last two
    are one critical section each)."""

    def put_many(
        self,
        items: Iterable[tuple[str, object]],
        *,
        owner: object = None,
        ttl: float | None = None,
        write_mode: WriteMode | str = WriteMode.MEMORY,
        nx: bool = False,
    ) -> list[KvstrataError | None]:
        """:meth:`put` for each ``(key, value)``; per-key results. With ``nx=True``: write-once.

        Runs of small values (as :meth:`put` copies under the lock) are written :data:`PUT_CHUNK` keys (or
        :data:`PUT_CHUNK_BYTES`) per hold of the lock, not one hold per key: the per-key lock, checks and calls
        made a batch of 64-byte values cost ~15-20 us a key on the development machine."""
        pairs = _pairs(items, "items")
        views = []
        for key, value in pairs:
            check_key(key, "items")
            views.append(as_bytes_view(value))
        self._check_batch_options(ttl, write_mode)
        mode = check_mode(write_mode)
        ttl_s = 0.0 if ttl is None else check_ttl(ttl)
        n = len(pairs)
        out: list[KvstrataError | None] = [None] * n
        small = mode is not WriteMode.WRITE_THROUGH
        fits, put_small = self._mem.fits_ever, self._put_small_locked
        i = 0
        while i < n:
            if not small or views[i].nbytes > _SMALL:
                try:
                    self.put(pairs[i][0], views[i], owner=owner, ttl=ttl, write_mode=mode, nx=nx)
                except KvstrataError as exc:
                    out[i] = exc
                i += 1
                continue
            with self._lock:  # a run of small values, as put writes one
                stop, held, run = min(n, i + PUT_CHUNK), 0, []
                while i < stop and held < PUT_CHUNK_BYTES and (size := views[i].nbytes) <= _SMALL:
                    run.append(i)
                    held += size
                    i += 1
                blocks = self._run_blocks_locked(pairs, views, run, nx)
                try:
                    for j in run:
                        key, view = pairs[j][0], views[j]
                        try:
                            loc = blocks.pop(j, None)
                            if loc is not None:
                                self._put_small_at_locked(key, view, loc, owner, mode, ttl_s, nx)
                                continue
                            if not fits(view.nbytes):  # (a tier smaller than the value: put's own check)
                                self._check_write(key, view.nbytes, ttl, mode)
                            put_small(key, view, view.nbytes, owner, mode, ttl_s, nx)
                        except KvstrataError as exc:
                            out[j] = exc
                finally:
                    # Cut short by an unexpected error (a bug): the blocks no value was given go back. The one being
                    # written then stays taken (it may already be a visible version's: never freed twice).
                    if blocks:
                        self._mem.free_many(list(blocks.values()))
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return out

    def _run_blocks_locked(self, pairs: list, views: list, run: list[int], nx: bool) -> dict[int, Location]:
        """New blocks for the values of ``run`` (positions in ``pairs``) that ``put`` would allocate one by one (not
        empty, not rewritten in place over an old version's block of the same size), carved side by side from one
        free range: one allocation instead of one per value (an allocation was about half of a small put's time
        on the development machine). Empty where there are fewer than two or no free range holds them all (then
        each value is put on its own, which evicts to make room)."""
        objects, creating, fresh = self._objects, self._creating, []
        for j in run:
            size = views[j].nbytes
            key = pairs[j][0]
            old = objects.get(key)
            if nx and (old is not None or key in creating):
                continue  # most likely refused (put_small tells): no block for it
            if size and (nx or not reusable_block(old, size)):
                fresh.append(j)
        if len(fresh) < 2 or self._closing:
            return {}
        locs = self._mem.allocate_run([views[j].nbytes for j in fresh])
        return {} if locs is None else dict(zip(fresh, locs))

    def _check_batch_options(self, ttl: object, write_mode: object) -> None:
        check_ttl(ttl)
        if check_mode(write_mode) in (WriteMode.WRITE_THROUGH, WriteMode.WRITE_BACK) and self._disk is None:
            raise InvalidValue(
                f"write_mode: {write_mode} needs an SSD tier (the worker's --disk-dir, or disk_dir= of an "
                f"embedded store)"
            )

    def create_many(
        self,
        items: Iterable[tuple[str, int]],
        *,
        owner: object,
        ttl: float | None = None,
        write_mode: WriteMode | str = WriteMode.MEMORY,
        nx: bool = False,
    ) -> list[Location | KvstrataError | ValueError | TypeError]:
        """:meth:`create` per ``(key, size)``, in one critical section; a refused key yields its exception.

        The batch's objects are carved side by side out of one free range where one holds them all (so
        their copies merge into long runs); otherwise, or for what did not fit, one by one with eviction.
        """
        items = items if isinstance(items, list) else list(items)
        out: list = [None] * len(items)
        try:
            mode, ttl_s = self._check_write("_", 0, ttl, write_mode)  # the batch's options, checked once
        except (KvstrataError, ValueError, TypeError) as exc:
            return [exc] * len(items)
        fits = self._mem.fits_ever
        todo: list[int] = []  # positions that passed the checks, counted in _creating, in order
        with self._lock:
            if self._closing:
                return [ClosedError("the object store is closed")] * len(items)
            creating, objects = self._creating, self._objects
            for i, (key, size) in enumerate(items):
                try:
                    if type(key) is not str or not key or len(key) > FAST_KEY_CHARS or not key.isascii():
                        check_key(key)
                    if type(size) is not int or size < 0:
                        check_size(size)
                    if not fits(size):
                        self._check_write(key, size, ttl, write_mode)  # raises its CapacityError
                    if nx and (key in creating or (key in objects and self._lookup(key) is not None)):
                        raise KeyExists(f"key {key!r} already exists")
                except (KvstrataError, ValueError, TypeError) as exc:
                    out[i] = exc
                    continue
                creating[key] = creating.get(key, 0) + 1  # before allocating, as in _reserve_locked
                todo.append(i)
            sized = [i for i in todo if items[i][1]]
            run = self._mem.allocate_run([items[i][1] for i in sized]) if len(sized) > 1 else None
            if run is not None:
                for i, loc in zip(sized, run):
                    out[i] = loc
                if self._mem.used > self._high:
                    self._wake.set()
            versions, pending = self._versions, self._pending
            creates = self._owner_creates.get(owner)
            if creates is None and todo:
                creates = self._owner_creates[owner] = set()
            # Values larger than a segment first: segments are emptied for them, and the batch's own unsealed smaller
            # objects, allocated before, would keep them from being emptied
            big = self.config.segment_bytes
            for i in sorted(todo, key=lambda i: items[i][1] <= big) if run is None else todo:
                key, size = items[i]
                loc = out[i]
                if loc is None:
                    try:
                        loc = self._allocate(size)  # may release the lock to evict
                    except (KvstrataError, ValueError, TypeError) as exc:
                        self._uncreate(key)
                        out[i] = exc
                        continue
                    out[i] = loc
                try:
                    hold = self._hold_disk_locked(key, size, mode)
                except CapacityError as exc:
                    self._uncreate(key)
                    self._free_loc(loc)
                    out[i] = exc
                    continue
                e = Entry(key, size, loc, mode, next(versions), owner)
                e.disk_hold = hold
                if ttl_s:
                    e.ttl = ttl_s
                if (key, owner) in pending:  # this owner's earlier create of it is open (named twice, say)
                    self._abort_locked(e)
                    out[i] = KeyExists(_OPEN_CREATE.format(key=key))
                    continue
                pending[(key, owner)] = e
                creates.add(key)
        if self._announced < len(self._mem.segments):
            self._announce_segments()
        return out

    def seal_many(self, keys: Iterable[str], *, owner: object) -> list[KvstrataError | ValueError | TypeError | None]:
        """:meth:`seal` per key (None where sealed, the exception where refused); creates that need no SSD
        write are sealed in one critical section."""
        out: list = []
        slow: list[tuple[int, Entry]] = []
        fast: list[Entry] = []
        fast_at: list[int] = []  # each one's place in out
        with self._lock:
            pending, creating, closed = self._pending, self._creating, self._closing
            creates = self._owner_creates.get(owner)
            for key in keys:
                try:
                    if type(key) is not str or not key or len(key) > FAST_KEY_CHARS or not key.isascii():
                        check_key(key)
                    e = pending.pop((key, owner), None)
                    if e is None:
                        raise KeyNotFound(f"no create of key {key!r} in progress for this owner")
                except (KvstrataError, ValueError, TypeError) as exc:
                    out.append(exc)
                    continue
                if creates is not None:
                    creates.discard(key)
                out.append(None)
                if e.mode is WriteMode.WRITE_THROUGH or closed:
                    slow.append((len(out) - 1, e))
                    continue
                n = creating.get(key, 0) - 1  # _uncreate, inline
                if n > 0:
                    creating[key] = n
                else:
                    creating.pop(key, None)
                fast.append(e)
                fast_at.append(len(out) - 1)
            if fast:
                refused = self._seal_batch_locked(fast)
                if refused:
                    for n, exc in refused:
                        out[fast_at[n]] = exc
            if creates is not None and not creates:
                self._owner_creates.pop(owner, None)
        return self._finish_slow(slow, out)

    def _finish_slow(self, slow: list[tuple[int, Entry]], out: list) -> list:
        """Seal the entries of a batch that write an SSD file (outside the lock, as in seal): ``out[i]`` the
        exception of a refused one. Returns ``out``."""
        for i, e in slow:
            try:
                self._finish(e, mutable=False)
            except (KvstrataError, ValueError, TypeError) as exc:
                out[i] = exc
        return out

    def _seal_batch_locked(
        self, entries: list[Entry], *, published: bool = False
    ) -> list[tuple[int, ServerError]] | None:
        """:meth:`_seal_locked` of each entry in order (none has an SSD file to commit; all become immutable),
        with the loop's lookups hoisted and the blocks of the versions they replace given back together.
        ``published``: their placements are in the table already.

        An entry replacing a version whose SSD file cannot be deleted is freed, never shown (that version stays):
        returned as ``(position in entries, error)``; None when there is none."""
        if self._placements is not None and not published:
            # Before the loop, not after: their bytes are final, and a reader that copies from these places at once
            # asks for its leases under this lock, so it gets them once the loop is done (and they confirm its
            # copies). After a mset_d2h of 64 keys (its commit settled when the client said the copies landed), the
            # first key was in the table 11 us after the call returned (median) against 31, on the development
            # machine (session 30): a read of those keys right after finds it, and goes in one pass.
            self._placements.publish(entries, sealing=True)
        objects, dirty, waiters = self._objects, self._dirty, self._waiters
        clock_add, clock_remove = self._clock.add, self._clock.remove
        freed: list[Entry] = []
        refused = None
        now = 0.0
        for n, e in enumerate(entries):
            key = e.key
            old = objects.get(key)
            if old is not None:
                if old.on_disk:
                    try:
                        self._unlink_replaced(old)
                    except ServerError as exc:
                        self._free_locked(e)
                        if refused is None:
                            refused = []
                        refused.append((n, exc))
                        continue
                e.ref = old.ref
                if old.on_disk or old.gpu is not None or dirty:
                    self._retire(old, freed=freed)
                else:  # _retire of a version in DRAM only, inline: what a rewritten device-call stage replaces
                    old.dead = True
                    self._evict_blocked = False
                    clock_remove(key, old)
                    if old.leases == 0:
                        if old.loc is not None and old.loc.size:
                            freed.append(old)
                        else:
                            old.loc = None
            e.sealed = True
            e.mutable = False
            if e.ttl:
                if not now:
                    now = time.monotonic()
                e.expires = now + e.ttl
                heapq.heappush(self._ttl_heap, (e.expires, e.version, key))
            objects[key] = e
            if e.size:
                clock_add(key, e)
            if e.mode is WriteMode.WRITE_BACK:
                e.dirty = True
                dirty[key] = e
                self._wake.set()
            if waiters:
                w = waiters.get(key)
                if w is not None:
                    w[0].notify_all()
        if freed:
            self._free_entries(freed)
        if self._mem.used > self._high:
            self._wake.set()
        return refused


def _pairs(items: object, name: str) -> list[tuple]:
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise InvalidValue(f"{name}: must be a sequence of (key, value) pairs, got {type(items).__name__}")
    pairs = list(items)
    for p in pairs:
        if not isinstance(p, tuple | list) or len(p) != 2:
            raise InvalidValue(f"{name}: every item must be a (key, value) pair, got {p!r:.60}")
    return pairs


__all__ = ["BatchMixin"]
