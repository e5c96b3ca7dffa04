"""The kvstrata client: KV and object APIs over a worker (``unix://``) or an in-process store (embedded).

Example::

    import kvstrata, numpy as np
    with kvstrata.connect(embedded=True, memory_bytes="256MiB") as kv:
        kv.set("greeting", b"hello")
        assert kv.get("greeting") == b"hello"
        with kv.create("array", 4096) as buf:          # written in place, sealed on exit
            buf.numpy(np.float32)[:] = 1.0
        with kv.get_buffers(["array"])[0] as view:     # zero-copy, read-only
            assert view.numpy(np.float32).sum() == 1024
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from kvstrata._proc import PID
from kvstrata.client import device as _device
from kvstrata.client import reservation as _reservation
from kvstrata.client._shared import MAX_OBJECT_BYTES, check_key, check_keys
from kvstrata.client.backends import EmbeddedBackend, RemoteBackend
from kvstrata.client.buffers import ReadBuffer, WritableBuffer
from kvstrata.client.device_calls import DeviceCallsMixin, on_pool_thread
from kvstrata.client.values import byte_view
from kvstrata.devobj.service import DeviceObjectsMixin
from kvstrata.errors import CapacityError, ClosedError, InvalidType, InvalidValue, KeyExists, KvstrataError
from kvstrata.server import protocol as P

Result = Any  # per-key: a value (or None) on success, the KvstrataError instance on failure
#: a ``mset`` of at least this many keys writes its values of the backend's ``shared_batch_bytes`` or more through
#: shared memory (one create and one seal request for them all) rather than inline in its request. Through a worker on
#: the development machine, 1,000 values a call: 4 KiB ~15 us a key that way against ~26 inline, 16 KiB 14 against
#: 30, 1 KiB 16 against 21; 64-256 B alike either way (``tools/probe_batch_writes.py`` and a variant, session 31).
MSET_SHARED_MIN_KEYS = 16


def _one_or_many(keys: Any, results: list[Any]) -> Any:
    return results[0] if isinstance(keys, str) else results


class Client(DeviceCallsMixin, DeviceObjectsMixin):
    """A handle on a node's store. Build it with :func:`kvstrata.connect`; thread-safe; close it when done.

    Single-key calls raise (``KeyNotFound``, ``KeyExists``, ``Timeout``, ``CapacityError``...); batch
    calls return one result per key, the exception instance in the slot of a refused key.
    A worker client sends one request at a time on its connection, so a ``get`` waiting for a key
    holds up the client's other threads: give threads that wait their own client.
    """

    def __init__(self, backend: Any, *, reserve_bytes: int = _reservation.RESERVE_BYTES) -> None:
        self._backend = backend
        self._reservation = _reservation.WriteReservation(reserve_bytes)
        self._closed = False
        self._close_lock = threading.Lock()  # one close() does the work
        self._close_done = threading.Event()  # ... and the others return once it is done
        self._pid = PID[0]
        self._issuer: concurrent.futures.ThreadPoolExecutor | None = None  # async calls' copies queued
        self._completer: concurrent.futures.ThreadPoolExecutor | None = None  # and waited for
        self._exec_lock = threading.Lock()
        self._registrations = _device.Registrations()
        # segments the worker retires are unregistered and unmapped once no copy of this client can read them
        backend.watch_retired_segments(self._registrations.retire)
        self._counter = itertools.count()

    # lifecycle -----------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The worker's address (``unix:///...``), or ``"embedded"`` for an in-process store."""
        return self._backend.address

    @property
    def embedded(self) -> bool:
        """Whether the store runs in this process (``connect(embedded=True)``) rather than in a worker."""
        return isinstance(self._backend, EmbeddedBackend)

    @property
    def store(self) -> Any:
        """The in-process ObjectStore (embedded clients only)."""
        if not self.embedded:
            raise AttributeError("store: only an embedded client has an in-process store")
        return self._backend.store

    def close(self) -> None:
        """Release every lease and unfinished write of this client (idempotent: a close() beside another one returns
        when that one is done, except on an async call's callback thread, which that one waits for)."""
        with self._close_lock:
            first = not self._closed
            self._closed = True
        if not first:
            if not on_pool_thread(self):
                self._close_done.wait()
            return
        if self._pid != PID[0]:
            # A copy inherited through fork(): the worker's connection, leases, device objects and CUDA
            # registrations are the parent's. Only this process's handles go (nothing the parent sees).
            try:
                self._backend.close()
            finally:
                self._close_done.set()
            return
        if on_pool_thread(self):
            # Called from an async call's callback, on a thread of the pools joined below: the rest runs on a thread
            # of its own once this one is free to finish the calls still queued.
            threading.Thread(target=self._finish_close, name="kvstrata-close").start()
            return
        self._finish_close()

    def _finish_close(self) -> None:
        try:
            self._close_device_objects()
            # Pending async calls finish first (their copies use the segments unmapped below); one that waits for a
            # missing key holds this up to its timeout.
            for pool in (self._issuer, self._completer):  # the issuer hands its calls' waits on
                if pool is not None:
                    pool.shutdown(wait=True)
            self._registrations.undo()  # before the segments are unmapped
        finally:
            try:
                self._backend.close()  # whatever failed above: the worker's leases and memory go back
            finally:
                self._close_done.set()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _b(self) -> Any:
        if self._closed:
            raise ClosedError("client is closed")
        return self._backend

    def __repr__(self) -> str:
        return f"<kvstrata.Client {self.address}{' closed' if self._closed else ''}>"

    # KV ------------------------------------------------------------------------------------------
    @staticmethod
    def _write_opts(ttl: Any, nx: bool, write_mode: Any) -> dict:
        if type(nx) is not bool:  # (nx="no" would be true)
            raise InvalidType(f"nx: must be a bool, got {type(nx).__name__}")
        return {"ttl": P.check_ttl(ttl), "nx": nx, "mode": P.check_write_mode(write_mode)}

    def set(
        self, key: str, value: Any, *, ttl: float | None = None, nx: bool = False, write_mode: str = "memory"
    ) -> None:
        """Store ``value`` (bytes-like, numpy array, CPU tensor: its raw bytes) under ``key``.

        ``ttl`` seconds (None/0: until deleted); ``nx``: only if absent (else KeyExists);
        ``write_mode``: ``memory``, ``write_through``, ``write_back`` or ``evictable``.
        A value over the inline limit is copied once, straight into shared memory.
        """
        check_key(key)
        view = byte_view(value)
        opts = self._write_opts(ttl, nx, write_mode)
        backend = self._b()
        if len(view) < backend.inline_max or not backend.shm:
            backend.put(key, view, opts)
            return
        self._write_through_shm(backend, key, backend.create(key, len(view), opts), view)
        backend.finish("seal", key)

    def _mset_repeated(self, pairs: list, keys: list[str], **opts: Any) -> list[Result]:
        """:meth:`mset` of pairs that name a key more than once: each key written once (what writing the pairs in
        order would leave), the other pairs given that write's result (``KeyExists`` for those ``nx`` refuses)."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
            last[key] = i
        chosen = first if opts["nx"] else last
        order = sorted(chosen.values())
        done = dict(zip(order, self.mset([pairs[i] for i in order], **opts)))
        out: list[Result] = []
        for i, key in enumerate(keys):
            got = done.get(i, done[chosen[key]])
            if i not in done and opts["nx"] and got is None:
                got = KeyExists(f"key {key!r} already exists")
            out.append(got)
        return out

    @staticmethod
    def _write_through_shm(backend: Any, key: str, loc: Any, view: memoryview) -> None:
        try:
            backend.view(loc)[:] = view
        except BaseException:
            backend.finish("abort", key)
            raise

    def get(self, key: str, *, timeout: float = 0) -> bytes:
        """The value of ``key`` as bytes, waiting up to ``timeout`` seconds for it to appear.

        KeyNotFound at once when ``timeout`` is 0, Timeout when it ran out; ``timeout=None`` waits
        until the key exists (as in the store and ``queue.Queue.get``).
        """
        check_key(key)
        return self._b().get(key, P.check_timeout(timeout))

    def mget(self, keys: Iterable[str], *, timeout: float = 0) -> list[Result]:
        """Values of ``keys``: bytes, or the exception (KeyNotFound, Timeout...) in a missing key's slot.

        ``timeout`` as in :meth:`get`, for the batch: 0 does not wait, None waits for every key."""
        keys = check_keys(keys)
        backend = self._b()  # (a closed client refuses an empty batch too)
        return backend.mget(keys, P.check_timeout(timeout)) if keys else []

    def mset(
        self,
        items: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        ttl: float | None = None,
        nx: bool = False,
        write_mode: str = "memory",
    ) -> list[Result]:
        """Store many values; returns None per stored key, the exception where a key was refused.

        A key named twice ends as if its pairs were written in order: the last value stands (with ``nx``, the first;
        the later ones are refused with ``KeyExists``)."""
        pairs = _pairs(items)
        keys = check_keys([k for k, _ in pairs])
        opts = self._write_opts(ttl, nx, write_mode)  # (before the way for repeated keys reads nx)
        if len(set(keys)) != len(keys):
            return self._mset_repeated(pairs, keys, ttl=ttl, nx=nx, write_mode=write_mode)
        views = [byte_view(v, f"items[{k!r}]") for k, v in pairs]
        backend = self._b()
        results: list[Result] = [None] * len(keys)
        # Values past the backend's inline limit go through shared memory (create, copy, seal); so do those past its
        # batch limit in a call of many keys, where two requests for the batch cost less than the copies of its
        # values through the socket.
        limit = backend.inline_max
        if len(views) >= MSET_SHARED_MIN_KEYS:
            limit = min(limit, backend.shared_batch_bytes)
        small = [i for i, v in enumerate(views) if len(v) < limit or not backend.shm]
        large = [i for i, v in enumerate(views) if not (len(v) < limit or not backend.shm)]
        if small:
            for i, r in zip(small, backend.mput([(keys[i], views[i]) for i in small], opts)):
                results[i] = r if isinstance(r, BaseException) else None
        if large:
            locs = backend.mcreate([(keys[i], len(views[i])) for i in large], opts)
            unsealed = [i for i, loc in zip(large, locs) if not isinstance(loc, BaseException)]
            created = []
            try:
                for i, loc in zip(large, locs):
                    if isinstance(loc, BaseException):
                        results[i] = loc
                        continue
                    try:
                        self._write_through_shm(backend, keys[i], loc, views[i])
                    except Exception as exc:  # that key is aborted; the others go on
                        results[i] = exc
                        unsealed.remove(i)
                        continue
                    created.append(i)
            except BaseException:  # interrupted: no create of this batch may stay open
                self._abort_quietly(backend, [keys[i] for i in unsealed])
                raise
            for i, r in zip(created, backend.mseal([keys[i] for i in created]) if created else []):
                results[i] = r
        return results

    @staticmethod
    def _abort_quietly(backend: Any, keys: list[str]) -> None:
        """Abort unsealed creates while another error is on its way out (theirs would hide it)."""
        for key in keys:
            try:
                backend.finish("abort", key)
            except KvstrataError:
                pass

    def read(self, key: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``key``'s value from ``offset`` (ValueError for a range outside it)."""
        check_key(key)
        offset, size = P.check_size(offset, "offset"), P.check_size(size)
        # Past 2**63 no store has the bytes, and the request could not be encoded (2**64): refused here, naming the
        # argument at fault, in both modes
        if offset + size > MAX_OBJECT_BYTES:
            most = f"past the end of any object (at most {MAX_OBJECT_BYTES} bytes)"
            if offset > MAX_OBJECT_BYTES:
                raise InvalidValue(f"offset: {offset} is {most}")
            raise InvalidValue(f"size: range [{offset}, {offset + size}) is {most}")
        return self._b().read(key, offset, size)

    def delete(self, keys: str | Iterable[str]) -> bool | list[bool]:
        """Delete keys; True where a key existed. A str gives one bool, an iterable a list."""
        return _one_or_many(keys, self._keys_op("delete", keys))

    def exists(self, keys: str | Iterable[str]) -> bool | list[bool]:
        """Whether each key exists (up to 100,000 keys per call)."""
        return _one_or_many(keys, self._keys_op("exists", keys))

    def expire(self, keys: str | Iterable[str], ttl: float | None) -> bool | list[bool]:
        """Set keys' time to live (None/0: until deleted); True where the key existed."""
        return _one_or_many(keys, self._keys_op("expire", keys, ttl=P.check_ttl(ttl)))

    def size(self, keys: str | Iterable[str]) -> int | list[int | None] | None:
        """Value size in bytes per key (None where missing)."""
        return _one_or_many(keys, self._keys_op("sizes", keys))

    def _keys_op(self, op: str, keys: Any, **kw: Any) -> list[Any]:
        keys = check_keys(keys)
        backend = self._b()  # (a closed client refuses an empty batch too)
        return backend.keys_op(op, keys, **kw) if keys else []

    def generate_key(self, prefix: str = "") -> str:
        """A new unique key, ``prefix`` followed by 32 hex digits."""
        if not isinstance(prefix, str):
            raise InvalidType(f"prefix: must be a str, got {type(prefix).__name__}")
        return check_key(f"{prefix}{uuid.uuid4().hex}", "prefix")

    # objects -------------------------------------------------------------------------------------
    def create(
        self, key: str, size: int, *, ttl: float | None = None, nx: bool = False, write_mode: str = "memory"
    ) -> WritableBuffer:
        """Reserve ``size`` bytes of shared memory for ``key``; fill the returned buffer, then seal/publish."""
        check_key(key)
        size = P.check_size(size)
        if size > MAX_OBJECT_BYTES:  # what a store says of any size it has no room for, and 2**64 cannot be sent
            raise CapacityError(f"size: {size} bytes does not fit any store (at most {MAX_OBJECT_BYTES} bytes)")
        backend = self._b()
        if not backend.shm:
            raise KvstrataError("create needs shared memory with the worker (connect over unix://)")
        loc = backend.create(key, size, self._write_opts(ttl, nx, write_mode))
        return WritableBuffer(self, key, loc, backend.view(loc))

    def _finish_write(self, action: str, key: str) -> None:
        self._b().finish(action, key)

    def get_buffers(self, keys: str | Iterable[str], *, timeout: float = 0) -> list[ReadBuffer | KvstrataError]:
        """Zero-copy read-only views of objects, each holding a lease until released (or collected); the exception in
        a missing key's slot. ``timeout`` as in :meth:`get`: 0 does not wait, None waits for every key.

        Through a worker over TCP (no shared memory): views of the values as the reply brought them, in this
        process's memory (no lease; nothing copied after the socket's read: ``get``'s bytes cost a second copy of
        each value, into fresh memory)."""
        keys = check_keys(keys)
        backend = self._b()
        if not backend.shm and hasattr(backend, "mget_views"):
            views = backend.mget_views(keys, P.check_timeout(timeout)) if keys else []
            return [
                v if isinstance(v, BaseException) else ReadBuffer(self, key, None, memoryview(v))
                for key, v in zip(keys, views)
            ]
        out: list[Any] = []
        leases = backend.acquire(keys, P.check_timeout(timeout), cache=True) if keys else []
        for key, lease in zip(keys, leases):
            if isinstance(lease, BaseException):
                out.append(lease)
            else:
                out.append(ReadBuffer(self, key, lease.lease_id, backend.view(lease.location)))
        return out

    def _release_leases(self, ids: list[int]) -> None:
        if not self._closed:
            self._backend.release(ids)

    def _defer_release(self, lease_id: int) -> None:
        if not self._closed:
            self._backend.defer_release(lease_id)

    def _defer_abort(self, key: str) -> None:
        if not self._closed:
            self._backend.defer_abort(key)

    def incref(self, keys: str | Iterable[str]) -> int | list[int]:
        """Add one global reference per key; returns the new counts."""
        return _one_or_many(keys, self._keys_op("incref", keys))

    def decref(self, keys: str | Iterable[str]) -> int | list[int]:
        """Drop one global reference per key; an object whose count reaches 0 is deleted."""
        return _one_or_many(keys, self._keys_op("decref", keys))

    def refcount(self, key: str) -> int:
        """The global reference count of ``key`` (:meth:`incref` / :meth:`decref`; 0 when never counted)."""
        return self._b().refcount(check_key(key))

    # operations ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The store's and worker's figures: tiers' use, objects, hits, misses, evictions, spills, clients."""
        return self._b().stats()

    def flush(self) -> None:
        """Write write-back data to SSD now."""
        self._b().flush()

    def ping(self) -> None:
        """A round trip to the worker (ConnectionLost when it is gone); nothing to do for an embedded store."""
        if isinstance(self._b(), RemoteBackend):
            self._backend.request({"op": "ping"})


def _pairs(items: Any) -> list[tuple[Any, Any]]:
    """``mset``'s items as a list of ``(key, value)``: a mapping's, or the pairs given (TypeError naming the item
    that is not a pair)."""
    if isinstance(items, Mapping):
        return list(items.items())
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise InvalidType(f"items: expected a mapping or an iterable of (key, value) pairs, got {type(items).__name__}")
    pairs = list(items)
    for i, pair in enumerate(pairs):
        if (type(pair) is not tuple and type(pair) is not list) or len(pair) != 2:
            got = f"{len(pair)} items" if isinstance(pair, tuple | list) else type(pair).__name__
            raise InvalidType(f"items[{i}]: expected a (key, value) pair, got {got}")
    return pairs
