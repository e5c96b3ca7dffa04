"""The in-process backend: a :class:`~kvstrata.client.Client` calling an :class:`~kvstrata.store.ObjectStore` directly.

It answers the calls :class:`~kvstrata.client.remote.RemoteBackend` answers, with the same results, views
straight into the store's segments and no wire (:mod:`kvstrata.client.backends`).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from kvstrata._proc import PID
from kvstrata.client._shared import Lease, Loc, _segment_tensor
from kvstrata.errors import CapacityError, ClosedError, KvstrataError

_embedded_owners = itertools.count(1)


class EmbeddedBackend:
    """An :class:`~kvstrata.store.ObjectStore` in this process; closing the client closes an owned store."""

    shm = True
    address = "embedded"
    shared_batch_bytes = 1 << 62  # no wire: a batch's put copies each value once either way

    def __init__(self, store: Any, *, own_store: bool) -> None:
        self.store = store
        self._own_store = own_store
        self.owner = ("embedded", PID[0], next(_embedded_owners))
        self.inline_max = 1 << 62  # no wire: put copies once either way
        self._tensors: dict[int, Any] = {}
        self._closed = False
        # Finalizers may run inside the store's critical section (GC can strike anywhere), so they
        # only queue their work here; the next call drains it.
        self._deferred: collections.deque[int] = collections.deque()
        self._deferred_aborts: collections.deque[str] = collections.deque()
        self._retire_listener: Any = None  # (watch_retired_segments)

    def _check(self) -> Any:
        if self._closed:
            raise ClosedError("client is closed")
        if self.owner[1] != PID[0]:
            # The store's bookkeeping was copied by fork(), its shared memory was not: the two copies would hand
            # out the same bytes twice.
            raise ClosedError("this embedded store belongs to the parent process; open one after fork()")
        while self._deferred:
            self.store.release(self._deferred.popleft())
        while self._deferred_aborts:
            key = self._deferred_aborts.popleft()
            _result(lambda key=key: self.store.abort(key, owner=self.owner))
        return self.store

    def _opts(self, opts: dict) -> dict:
        from kvstrata.store import WriteMode

        return {"ttl": opts["ttl"], "nx": opts["nx"], "write_mode": WriteMode(opts["mode"])}

    def view(self, loc: Any) -> memoryview:
        return self._check().buffer(loc)

    def segment_tensor(self, index: int) -> Any:
        t = self._tensors.get(index)
        if t is None:
            t = self._tensors[index] = _segment_tensor(self._check().segments[index])
        return t

    def segment_address(self, index: int) -> int:
        return self._check().segments[index].address

    def segment_nbytes(self, index: int) -> int:
        return self._check().segments[index].nbytes

    @staticmethod
    def connection_lost() -> str:
        """No connection to lose in-process (see ``WorkerConnection.connection_lost``)."""
        return ""

    def release(self, ids: list[int]) -> None:
        if self._closed:
            return
        for lease_id in ids:
            self.store.release(lease_id)

    def defer_release(self, lease_id: int) -> None:
        self._deferred.append(lease_id)

    def defer_abort(self, key: str) -> None:
        self._deferred_aborts.append(key)

    def put(self, key: str, data: memoryview, opts: dict) -> None:
        self._check().put(key, data, owner=self.owner, **self._opts(opts))

    def mput(self, items: list[tuple[str, memoryview]], opts: dict) -> list[Any]:
        """The store's ``put_many`` (small values many per hold of its lock), with per-key results. The keys and
        values come checked: what it raises for the whole call (an option no key can be written with) is every
        key's result, as one ``put`` per key would have it."""
        try:
            return self._check().put_many(items, owner=self.owner, **self._opts(opts))
        except (KvstrataError, ValueError, TypeError) as exc:
            return [exc] * len(items)

    def create(self, key: str, size: int, opts: dict) -> Any:
        return self._check().create(key, size, owner=self.owner, **self._opts(opts))

    def mcreate(self, items: list[tuple[str, int]], opts: dict) -> list[Any]:
        return [_result(lambda k=k, n=n: self.create(k, n, opts)) for k, n in items]

    # The pipelined forms (see RemoteBackend): in-process, "sent" is done at once.
    def mcreate_start(self, items: list[tuple[str, int]], opts: dict) -> Any:
        return self.mcreate(items, opts)

    def mseal_start(self, keys: list[str]) -> Any:
        return self.mseal(keys)

    def acquire_start(
        self,
        keys: list[str],
        timeout: float,
        *,
        cache: bool | str = False,
        carry: bool = True,
        placements: bool = False,
        send: bool = True,
        local: bool = True,
    ) -> Any:
        return self.acquire(keys, timeout, cache=cache)

    @staticmethod
    def kept_leases(keys: list[str]) -> None:
        """No local-read cache here: every lease is taken from the store (``acquire_start``)."""

    @staticmethod
    def acquire_send(token: Any) -> Any:
        """Leases here are taken by the start: nothing to send."""
        return token

    @staticmethod
    def acquire_local(token: Any) -> list[Any]:
        """Every lease (or error) here is known at the start."""
        return token

    @staticmethod
    def acquire_ready(token: Any) -> bool:
        return True

    @staticmethod
    def acquire_placements(token: Any) -> None:
        """Leases here are taken at once: no copy ever starts ahead of one (see RemoteBackend)."""

    @staticmethod
    def placement_hints(keys: list[str]) -> None:
        """No placement table in-process: leases cost no round trip here."""

    @staticmethod
    def settle() -> None:
        """Nothing is left for later here (no local-read cache)."""

    def reserve_start(self, nbytes: int) -> Any:
        return _result(lambda: Loc(*self._check().reserve(self.owner, nbytes)))

    @staticmethod
    def reserve_finish(token: Any) -> Any:
        if isinstance(token, BaseException):
            raise token
        return token

    #: commits run in this process, after the copies: never ahead of them
    can_land = False

    def commit_start(
        self, items: list[tuple[str, int, int]], opts: dict, linger_us: int = 0, *, landing: bool = False
    ) -> Any:
        store = self._check()
        results = store.commit(self.owner, items, **self._opts(opts))
        rest = store.reservation(self.owner)
        return results, None if rest is None else rest.offset

    @staticmethod
    def linger(us: int) -> None:
        """Nothing to do: no worker thread to keep awake in this process."""

    @staticmethod
    def mcreate_finish(token: Any) -> list[Any]:
        return token

    mseal_finish = acquire_finish = commit_finish = mcreate_finish

    def finish(self, action: str, key: str) -> None:
        getattr(self._check(), action)(key, owner=self.owner)

    def mseal(self, keys: list[str]) -> list[Any]:
        return [_result(lambda k=k: self.finish("seal", k)) for k in keys]

    def get(self, key: str, timeout: float) -> bytes:
        return self._check().get_bytes(key, timeout=timeout)

    def mget(self, keys: list[str], timeout: float) -> list[Any]:
        out = []
        store = self._check()
        for key, r in zip(keys, store.acquire_many(keys, owner=self.owner, timeout=timeout)):
            if isinstance(r, CapacityError):  # on SSD only, and DRAM full of leased bytes: read from SSD, as get does
                try:
                    out.append(store.get_bytes(key, timeout=0))
                except KvstrataError as exc:
                    out.append(exc)
                continue
            if isinstance(r, BaseException):
                out.append(r)
                continue
            try:
                out.append(bytes(self.store.buffer(r.location)))
            finally:
                self.store.release(r.lease_id)
        return out

    def acquire(self, keys: list[str], timeout: float, *, cache: bool | str = False) -> list[Any]:
        results = self._check().acquire_many(keys, owner=self.owner, timeout=timeout)
        return [r if isinstance(r, BaseException) else Lease(r.lease_id, r.location, r.mutable) for r in results]

    def read(self, key: str, offset: int, size: int) -> bytes:
        return self._check().read(key, offset, size)

    def keys_op(self, op: str, keys: list[str], **kw: Any) -> list[Any]:
        store = self._check()
        if op == "expire":
            return list(store.expire(keys, kw["ttl"]))
        return list(getattr(store, op)(keys))

    def refcount(self, key: str) -> int:
        return self._check().refcount(key)

    def stats(self) -> dict:
        stats = dict(self._check().stats())
        stats.setdefault("clients", 1)
        return stats

    def flush(self) -> None:
        self._check().flush()

    def watch_retired_segments(self, fn: Any) -> None:
        """Have ``fn([index], None)`` told of each segment the store retires from now on (the store keeps the
        mapping: nothing to let go of here but the caller's CUDA registration)."""

        def retired(index: int) -> None:
            self._tensors.pop(index, None)
            fn([index], None)

        self._retire_listener = retired
        self.store.add_retire_listener(retired)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tensors.clear()
        if self.owner[1] != PID[0]:
            return  # a copy inherited through fork(): the store is the parent's (nothing flushed or unlocked here)
        if self._retire_listener is not None:
            self.store.remove_retire_listener(self._retire_listener)
        self.store.release_owner(self.owner)
        if self._own_store:
            self.store.close()


def _result(fn: Any) -> Any:
    """Per-key result: None/value on success, the exception instance on a refused key."""
    try:
        return fn()
    except (KvstrataError, ValueError, TypeError) as exc:
        return exc
