"""A client of a whole cluster: each key goes to the workers that own it (:mod:`kvstrata.cluster`).

:class:`ClusterClient` keeps the cluster's member list (watched, so joins and departures show within a moment)
and one :class:`~kvstrata.client.Client` per worker it has talked to: through the worker's Unix socket when the
worker runs on this host (so values move through shared memory, and device reads run at pinned-DMA speed), else
over TCP. A key's owners are the ``replicas`` live workers that rank first for it
(:func:`kvstrata.cluster.placement.rank`): writes go to all of them, reads to the first that has the key.

At each change of the member list the workers hand their objects to the keys' new owners
(:mod:`kvstrata.server.rebalance`, unless they run with ``cluster_rebalance`` off). Meanwhile, a client keeps the set
of live workers from before its last change too (a join, a departure, a worker skipped or back), and a read that
misses on a key's owners asks the key's owners under that set as well: a key written before the change is found
while it moves (with ``replicas=2``, even when one of its workers died). A worker whose connection fails is skipped
(its keys' next-ranked workers stand in) until the list shows another run of it or ``ttl`` passes.

Each write carries the fingerprint of the member list it was routed by. A worker whose own list differs refuses the
keys it does not own under that list (:class:`~kvstrata.errors.NotOwner`): this client's list is out of date (its
watch is behind), so the worker may have handed those keys on already, and a value written there now would sit out
of its readers' sight. The client then reads the list again and writes those keys to their owners under it.

Example (two workers of one process, listed in memory; across hosts the address is ``etcd://HOST:2379/NAME``)::

    >>> import kvstrata
    >>> from kvstrata.server import Worker, WorkerConfig
    >>> workers = [
    ...     Worker(WorkerConfig(socket="tcp://127.0.0.1:0", memory=16 << 20, disk_dir="", cluster="inproc://doc-kv",
    ...                         cluster_listen="tcp://127.0.0.1:0")).start()
    ...     for _ in range(2)
    ... ]
    >>> with kvstrata.connect(cluster="inproc://doc-kv") as kv:
    ...     kv.mset({f"k{i}": b"v%d" % i for i in range(8)}) == [None] * 8
    ...     kv.get("k3"), len(kv.nodes)
    True
    (b'v3', 2)
    >>> for w in workers:
    ...     _ = w.stop()
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import numbers
import os
import socket as _socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvstrata.client._shared import check_key, check_keys
from kvstrata.client.client import _one_or_many, _pairs
from kvstrata.cluster.membership import DEFAULT_TTL_S, Member, Membership, open_membership
from kvstrata.cluster.placement import Placement, fingerprint
from kvstrata.errors import (
    ClosedError,
    ConnectionLost,
    InvalidType,
    InvalidValue,
    KeyExists,
    KeyNotFound,
    NotOwner,
    Timeout,
    TransportError,
)
from kvstrata.server.protocol import check_timeout

log = logging.getLogger(__name__)

Result = Any  # per key: a value (or None) on success, the exception on failure, as Client's batch calls
#: errors that say a worker could not be reached (so its keys' next workers stand in), not that a key was refused
UNREACHABLE = (ConnectionLost, TransportError, ClosedError, ConnectionError)
#: a batch of KV calls goes to its workers at once (a thread each) from this many keys or bytes; smaller ones go to
#: them in turn: with values of a few KiB, a thread's hand-off costs more than the calls (32 keys of 4 KiB over 3
#: workers on the development machine: 190 us in turn, 410 at once). Device calls always go at once.
PARALLEL_MIN_KEYS = 64
PARALLEL_MIN_BYTES = 1 << 20
#: seconds a client writes without its list's fingerprint after a worker refused a write routed by a list the client
#: had just read again: the worker's list is the one behind (it catches up within moments), and the client's writes
#: are routed by a list as fresh as the membership store's
UNCHECKED_S = 1.0


class NoWorkers(TransportError):
    """The cluster lists no live worker (none started, or every one unreachable)."""


class ClusterClient:
    """The key-value and device-object calls of :class:`~kvstrata.client.Client`, over every worker of a cluster.

    Build it with ``kvstrata.connect(cluster="etcd://HOST:2379/NAME")``. Thread-safe; close it when done.
    ``replicas``: how many workers keep each key written through this client (reads need any one of them); None (the
    default): what the cluster's workers say (their ``cluster_replicas`` setting: the most any listed worker says),
    1 where they say nothing.
    ``prefer_local``: reach a worker on this host through its Unix socket (shared memory) rather than TCP.
    ``timeout``: seconds to wait for a worker's connection (a listed worker is up: a worker that does not answer
    within it is skipped, and its keys' next workers stand in). ``ttl``: seconds a worker whose connection failed is
    skipped while the member list still shows it (its lease has not run out yet).
    """

    def __init__(
        self,
        membership: Membership | str,
        *,
        replicas: int | None = None,
        timeout: float = 3.0,
        prefer_local: bool = True,
        ttl: float = DEFAULT_TTL_S,
        name: str | None = None,
        connect: Callable[..., Any] | None = None,
    ) -> None:
        if replicas is not None and (type(replicas) is not int or replicas < 1):
            raise InvalidValue(f"replicas: must be an int of at least 1 (or None: the cluster's), got {replicas!r}")
        if type(prefer_local) is not bool:
            raise InvalidType(f"prefer_local: must be a bool, got {type(prefer_local).__name__}")
        timeout = _seconds("timeout", timeout, positive=True)
        ttl = _seconds("ttl", ttl, positive=False)
        self._own_membership = isinstance(membership, str)
        self.membership = open_membership(membership) if isinstance(membership, str) else membership
        self._replicas_given = replicas
        self._told_replicas = False  # (warned that it differs from the workers' count)
        #: how many workers each key written through this client goes to
        self.replicas = replicas or 1
        self._timeout = timeout
        self._prefer_local = prefer_local
        self._ttl = ttl
        self._name = name
        if connect is None:
            from kvstrata.client import connect
        self._connect = connect
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._members_fingerprint: int | None = None  # (Placement.fingerprint of the listed workers)
        self._unchecked_until = 0.0  # (monotonic time until which writes carry no fingerprint: UNCHECKED_S)
        #: the live workers (listed, not skipped) at the last call, and before their last change: where keys written
        #: before that change (a join, a departure, a worker skipped or back) were written
        self._live_now: tuple[str, ...] = ()
        self._live_before: tuple[str, ...] = ()
        self._clients: dict[str, tuple[Any, tuple]] = {}  # node -> (its client, the incarnation it is connected to)
        #: node -> (monotonic time until which it is skipped, the incarnation whose connection failed)
        self._suspects: dict[str, tuple[float, tuple]] = {}
        #: ((live nodes, previous list's nodes), their placements), rebuilt when either changes
        self._placed: tuple[Any, Any] = ((None, None), (None, None))
        #: the per-worker calls of one batch (_run); the async_* calls run on a pool of their own (_async_pool), since
        #: each waits for its batch's per-worker calls: on one pool, 32 async calls at once took every thread and
        #: waited forever for the calls queued behind them
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._async_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        try:
            self._on_members(self.membership.members())
            self._stop_watch = self.membership.watch(self._on_members)
        except BaseException:
            if self._own_membership:
                self.membership.close()
            raise

    # the member list -----------------------------------------------------------------------------------------
    def _on_members(self, members: dict[str, Member]) -> None:
        """A new member list: clients of departed or restarted workers closed, a restarted worker no longer skipped
        (its new incarnation is not the one whose connection failed)."""
        gone = []
        with self._lock:
            for node in list(self._clients):
                if node not in members or _incarnation(members[node]) != self._clients[node][1]:
                    gone.append(self._clients.pop(node)[0])
            self._suspects = {
                n: (until, inc)
                for n, (until, inc) in self._suspects.items()
                if n in members and _incarnation(members[n]) == inc
            }
            self._members = dict(members)
            self._members_fingerprint = fingerprint(members)
            said = max((_said_replicas(m) for m in members.values()), default=None)
            if self._replicas_given is None and said is not None:
                self.replicas = said
            mismatch = said is not None and self._replicas_given not in (None, said) and not self._told_replicas
            self._told_replicas |= mismatch
        if mismatch:  # (the workers restore their own count at each change: more copies are dropped, fewer kept)
            log.warning(
                "replicas=%d, but the workers of %s keep %d copies of each key (their cluster_replicas): at each "
                "change of the member list they hand on and keep %d",
                self._replicas_given,
                self.membership.url,
                said,
                said,
            )
        for client in gone:
            self._close_quietly(client)

    def refresh(self) -> None:
        """Read the member list now (it is watched anyway; this is for a caller that knows it changed)."""
        self._on_members(self.membership.members())

    def _routed_by(self) -> int | None:
        """The fingerprint each routed write carries (its worker checks it: Worker.not_owned); None: none now.

        (It is read as the write is sent, a moment after the write was routed: a change of the list in between sends
        the new list's fingerprint with a write routed by the old one, which the worker then does not check. That
        window is as short as the routing, where a client's out-of-date list lasts as long as its watch lags.)"""
        if self._unchecked_until and time.monotonic() < self._unchecked_until:
            return None
        return self._members_fingerprint

    def _refused_as_not_owner(self) -> None:
        """A worker refused a write routed by this client's member list (NotOwner): read the list again. Where it
        has not changed, the worker's is the list behind: writes carry no fingerprint for :data:`UNCHECKED_S`."""
        before = self._members_fingerprint
        try:
            self.refresh()
        except Exception as exc:  # (the membership store out of reach: the retry goes unchecked)
            log.warning("cannot re-read the members of %s after a worker refused a write: %s", self.membership.url, exc)
        if self._members_fingerprint == before:
            self._unchecked_until = time.monotonic() + UNCHECKED_S

    @property
    def nodes(self) -> list[str]:
        """The live workers' node ids (listed, and not skipped after a failed connection), sorted."""
        with self._lock:
            return sorted(self._live())

    def _live(self) -> list[str]:
        now = time.monotonic()
        return [n for n in self._members if n not in self._suspects or self._suspects[n][0] <= now]

    def owners(self, key: str) -> list[str]:
        """The live workers a write of ``key`` goes to, in rank order."""
        check_key(key)
        return self._views()[0].rank(key)[: self.replicas]

    def _candidates(self, key: str, live: Placement, previous: Placement | None) -> list[str]:
        """Where a read of ``key`` looks, in order: its owners now, then its owners before the last change of the
        live workers (a key written then went there)."""
        found = live.rank(key)[: self.replicas]
        if previous is not None:
            found += [n for n in previous.rank(key)[: self.replicas] if n not in found and n in live.nodes]
        return found

    def _views(self) -> tuple[Placement, Placement | None]:
        """Placements over the live workers and over those before their last change (None where the same set)."""
        with self._lock:
            if self._closed:  # (every call routes through here first)
                raise ClosedError("cluster client is closed")
            live = tuple(sorted(self._live()))
            if live != self._live_now:
                self._live_before, self._live_now = self._live_now, live
            previous = tuple(n for n in self._live_before if n in self._members)
            if self._placed[0] != (live, previous):
                before = Placement(previous) if previous and set(previous) != set(live) else None
                self._placed = ((live, previous), (Placement(live), before))
            views = self._placed[1]
        if not live:
            raise self._no_workers()
        return views

    def _no_workers(self) -> NoWorkers:
        with self._lock:
            listed = sorted(self._members)
        if listed:
            return NoWorkers(f"no worker of {self.membership.url} can be reached (listed: {', '.join(listed)})")
        return NoWorkers(f"no worker is listed in {self.membership.url} (start one with kvstrata worker --cluster)")

    # per-worker clients -----------------------------------------------------------------------------------------
    def client(self, node: str) -> Any:
        """The :class:`~kvstrata.client.Client` of worker ``node`` (connected at first use)."""
        return self._client(node)[0]

    def _client(self, node: str) -> tuple[Any, tuple]:
        """Worker ``node``'s client and the incarnation of the worker it is connected to."""
        with self._lock:
            if self._closed:
                raise ClosedError("cluster client is closed")
            held = self._clients.get(node)
            member = self._members.get(node)
        if held is not None:
            return held
        if member is None:
            raise KeyNotFound(f"no worker {node!r} in {self.membership.url}")
        address = member.address
        local = member.socket.removeprefix("unix://") if member.socket.startswith("unix://") else ""
        if self._prefer_local and local and member.host == _socket.gethostname() and os.path.exists(local):
            address = member.socket
        incarnation = _incarnation(member)
        try:
            client = self._connect(address=address, timeout=self._timeout, name=self._name)
        except UNREACHABLE as exc:
            self._suspect(node, exc, incarnation)
            raise
        backend = getattr(client, "_backend", None)
        if hasattr(backend, "routed_by"):  # (a worker connection: its routed writes say which list routed them)
            backend.routed_by = self._routed_by
        with self._lock:
            listed = self._members.get(node)
            if self._closed or listed is None or _incarnation(listed) != incarnation:  # (closed, or it left)
                racing, held = client, None
            else:
                held = self._clients.get(node)
                if held is None:
                    self._clients[node] = held = (client, incarnation)
                    racing = None
                else:
                    racing = client
        if racing is not None:
            self._close_quietly(racing)
        if held is None:
            raise ConnectionLost(f"worker {node} left {self.membership.url}")
        return held

    def _suspect(self, node: str, exc: BaseException, incarnation: tuple) -> None:
        """Skip ``node`` for ``ttl`` (its connection failed; the list may still show it), and re-read the list. Not
        where the list shows another incarnation of it already (it restarted: the failed connection was the old
        one's)."""
        with self._lock:
            listed = self._members.get(node)
            if listed is not None and _incarnation(listed) != incarnation:
                suspected = False
            else:
                self._suspects[node] = (time.monotonic() + self._ttl, incarnation)
                suspected = True
            held = self._clients.get(node)
            client = self._clients.pop(node)[0] if held is not None and held[1] == incarnation else None
        if suspected:
            log.warning(
                "worker %s of %s unreachable, skipped for %.0f s: %s", node, self.membership.url, self._ttl, exc
            )
        if client is not None:
            self._close_quietly(client)
        try:
            self.refresh()
        except Exception as refresh_exc:  # (etcd out of reach: the list stays as it was)
            log.warning("cannot re-read the members of %s: %s", self.membership.url, refresh_exc)

    @staticmethod
    def _close_quietly(client: Any) -> None:
        try:
            client.close()
        except Exception:
            pass

    def _run(self, calls: dict[str, Callable[[Any], Any]], *, parallel: bool = True) -> dict[str, Any]:
        """``calls[node](node's client)`` for each node, at once (a thread each past the first); each result or the
        exception it raised. A node that cannot be reached is suspected (skipped from then on)."""

        def one(node: str, call: Callable[[Any], Any]) -> Any:
            incarnation: tuple | None = None
            try:
                client, incarnation = self._client(node)
                return call(client)
            except UNREACHABLE as exc:
                if incarnation is not None and (not isinstance(exc, ClosedError) or not self._closed):
                    self._suspect(node, exc, incarnation)  # (a failed connect suspected it already)
                return exc
            except Exception as exc:  # (a refusal of the whole call: the keys' slots carry it)
                return exc

        items = list(calls.items())
        if not items:  # (no key to send anywhere: an empty batch, or a retry with no worker left to stand in)
            return {}
        if len(items) == 1 or not parallel:  # (a thread's hand-off costs more than a few small calls in turn)
            return {node: one(node, call) for node, call in items}
        pool = self._executor()
        try:
            futures = {node: pool.submit(one, node, call) for node, call in items[1:]}
        except RuntimeError as exc:  # (close() shut the pool down meanwhile)
            raise ClosedError("cluster client is closed") from exc
        out = {items[0][0]: one(*items[0])}
        for node, future in futures.items():
            out[node] = future.result()
        return out

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:  # (not a new pool that nothing would shut down)
                raise ClosedError("cluster client is closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="kvstrata-cluster")
            return self._pool

    def _async_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise ClosedError("cluster client is closed")
            if self._async_pool is None:
                self._async_pool = concurrent.futures.ThreadPoolExecutor(
                    32, thread_name_prefix="kvstrata-cluster-async"
                )
            return self._async_pool

    # routing ------------------------------------------------------------------------------------------------------
    def _write(
        self,
        keys: list[str],
        batch: Callable[[Any, list[int]], list[Result]],
        *,
        write_once: bool = False,
        parallel: bool = True,
    ) -> list[Result]:
        """Each key written on its owners by ``batch(client, indices)``: a key's result is None where every owner took
        it, else the first refusal. Where a worker cannot be reached, its keys go to the next-ranked live workers
        (once; a second failure is the key's result); where a worker refused keys as not its own under its member
        list (NotOwner: this client's list is out of date), the list is read again and they go to their owners under
        it (once). ``write_once`` (nx, mset_d2h): a key one owner refused as
        existing is taken back from the owners that stored it (it was not there before this write), so its
        replicas keep the one value that was there first."""
        results: list[Result] = [None] * len(keys)
        todo = list(range(len(keys)))
        done: list[set[str]] = [set() for _ in keys]  # the workers that took each key
        stale = False  # a worker refused keys routed by an out-of-date list
        for attempt in range(2):
            if stale:
                self._refused_as_not_owner()
            live, _ = self._views()
            groups: dict[str, list[int]] = {}
            for i in todo:
                for node in [n for n in live.rank(keys[i]) if n not in done[i]][: self.replicas - len(done[i])]:
                    groups.setdefault(node, []).append(i)
            outcome = self._run(
                {node: (lambda c, idx=idx: batch(c, idx)) for node, idx in groups.items()}, parallel=parallel
            )
            retry = set()
            for node, idx in groups.items():
                got = outcome[node]
                for j, i in enumerate(idx):
                    r = got if isinstance(got, BaseException) else got[j]
                    if r is None:
                        done[i].add(node)
                    elif isinstance(r, UNREACHABLE) and attempt == 0:
                        retry.add(i)
                    elif isinstance(r, NotOwner) and attempt == 0:
                        retry.add(i)
                        stale = True
                    elif results[i] is None:
                        results[i] = r
            todo = sorted(i for i in retry if results[i] is None)
            if not todo:
                break
        for i in todo:
            if not done[i] and results[i] is None:
                results[i] = ConnectionLost(f"no worker of {self.membership.url} took key {keys[i]!r}")
        if write_once:
            undo: dict[str, list[int]] = {}
            for i, r in enumerate(results):
                if isinstance(r, KeyExists):
                    for node in done[i]:
                        undo.setdefault(node, []).append(i)
            if undo:
                self._run({n: (lambda c, idx=idx: c.delete([keys[i] for i in idx])) for n, idx in undo.items()})
        return results

    def _read(
        self,
        keys: list[str],
        batch: Callable[[Any, list[int]], list[Result]],
        missing: Callable[[Result], bool],
        *,
        parallel: bool = True,
    ) -> list[Result]:
        """Each key read from the first of its candidates (owners now, then owners under the previous list) whose
        answer is not ``missing``: a batch per worker per round. A key missing everywhere keeps its first answer."""
        results: list[Result] = [None] * len(keys)
        live, previous = self._views()
        candidates = [self._candidates(k, live, previous) for k in keys]
        todo = list(range(len(keys)))
        first: dict[int, Result] = {}
        step = 0
        while todo:
            groups: dict[str, list[int]] = {}
            for i in todo:
                if step < len(candidates[i]):
                    groups.setdefault(candidates[i][step], []).append(i)
            if not groups:
                break
            outcome = self._run(
                {node: (lambda c, idx=idx: batch(c, idx)) for node, idx in groups.items()}, parallel=parallel
            )
            nxt = []
            for node, idx in groups.items():
                got = outcome[node]
                for j, i in enumerate(idx):
                    r = got if isinstance(got, BaseException) else got[j]
                    if isinstance(r, UNREACHABLE) or missing(r):
                        # a key's answer where no worker has it: a worker's miss rather than one's silence
                        if i not in first or (isinstance(first[i], UNREACHABLE) and not isinstance(r, UNREACHABLE)):
                            first[i] = r
                        nxt.append(i)
                    else:
                        results[i] = r
            todo = [i for i in todo if i in set(nxt)]
            step += 1
        for i in todo:
            results[i] = first.get(i, KeyNotFound(f"key {keys[i]!r} not found"))
        return results

    def _wait_on_first_owners(
        self, keys: list[str], results: list[Result], wait: Callable[[Any, list[int]], list[Result]]
    ) -> None:
        """The keys ``results`` has missing, waited for by ``wait(client, indices)`` on each key's first owner (where a
        new write of it lands); their slots take what the waits return."""
        waiting = [i for i, r in enumerate(results) if _is_miss(r)]
        if not waiting:
            return
        live, _ = self._views()
        groups: dict[str, list[int]] = {}
        for i in waiting:
            groups.setdefault(live.rank(keys[i])[0], []).append(i)
        outcome = self._run({n: (lambda c, idx=idx: wait(c, idx)) for n, idx in groups.items()})
        for node, idx in groups.items():
            got = outcome[node]
            for j, i in enumerate(idx):
                results[i] = got if isinstance(got, BaseException) else got[j]

    @staticmethod
    def _raise(result: Result) -> Any:
        if isinstance(result, BaseException):
            raise result
        return result

    # KV ---------------------------------------------------------------------------------------------------------
    def set(self, key: str, value: Any, *, ttl: float | None = None, nx: bool = False, write_mode: str = "memory"):
        """Store ``value`` under ``key`` on its owners (as :meth:`Client.set`)."""
        check_key(key)
        self._raise(self.mset([(key, value)], ttl=ttl, nx=nx, write_mode=write_mode)[0])

    def mset(
        self,
        items: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        ttl: float | None = None,
        nx: bool = False,
        write_mode: str = "memory",
    ) -> list[Result]:
        """Store many values, each on its owners; None per stored key, the exception where a key was refused."""
        pairs = _pairs(items)
        keys = check_keys([k for k, _ in pairs])
        return self._write(
            keys,
            lambda c, idx: c.mset([pairs[i] for i in idx], ttl=ttl, nx=nx, write_mode=write_mode),
            write_once=nx,
            parallel=len(keys) >= PARALLEL_MIN_KEYS or sum(map(_nbytes, (v for _, v in pairs))) >= PARALLEL_MIN_BYTES,
        )

    def get(self, key: str, *, timeout: float = 0) -> bytes:
        """The value of ``key`` from the first of its workers that has it; ``timeout`` as in :meth:`Client.get`
        (a wait is on the key's first owner, where a new write lands)."""
        check_key(key)
        return self._raise(self.mget([key], timeout=timeout)[0])

    def mget(self, keys: Iterable[str], *, timeout: float = 0) -> list[Result]:
        """Values of ``keys``: bytes, or the exception in a missing key's slot. With ``timeout`` (None: forever),
        keys missing everywhere are then waited for on their first owners."""
        keys = check_keys(keys)
        timeout = check_timeout(timeout)  # (refused here, not only once a key turns out missing)
        if not keys:
            return []
        many = len(keys) >= PARALLEL_MIN_KEYS
        results = self._read(keys, lambda c, idx: c.mget([keys[i] for i in idx]), _is_miss, parallel=many)
        if timeout != 0:
            self._wait_on_first_owners(keys, results, lambda c, idx: c.mget([keys[i] for i in idx], timeout=timeout))
        return results

    def get_buffers(self, keys: str | Iterable[str], *, timeout: float = 0) -> list[Result]:
        """:meth:`Client.get_buffers` from the first of each key's workers that has it: a zero-copy leased view where
        the worker is on this host (its shared memory), the value as the reply brought it over TCP (no copy after the
        socket's read, where :meth:`mget` copies each value into bytes); the exception in a missing key's slot.
        ``timeout`` as in :meth:`mget`. A buffer is its worker client's: released (and unusable) if that worker
        leaves the list or restarts."""
        keys = check_keys(keys)
        timeout = check_timeout(timeout)
        if not keys:
            return []
        many = len(keys) >= PARALLEL_MIN_KEYS
        results = self._read(keys, lambda c, idx: c.get_buffers([keys[i] for i in idx]), _is_miss, parallel=many)
        if timeout != 0:
            self._wait_on_first_owners(
                keys, results, lambda c, idx: c.get_buffers([keys[i] for i in idx], timeout=timeout)
            )
        return results

    def read(self, key: str, offset: int, size: int) -> bytes:
        """``size`` bytes of ``key``'s value from ``offset``, from the first of its workers that has it."""
        check_key(key)
        return self._raise(self._read([key], lambda c, idx: [_result(c.read, key, offset, size)], _is_miss)[0])

    def delete(self, keys: str | Iterable[str]) -> bool | list[bool]:
        """Delete keys from every worker that may hold them; True where one did."""
        return _one_or_many(keys, self._everywhere("delete", keys))

    def exists(self, keys: str | Iterable[str]) -> bool | list[bool]:
        """Whether each key is on one of its workers."""
        listed = check_keys([keys] if isinstance(keys, str) else keys)
        many = len(listed) >= PARALLEL_MIN_KEYS
        found = self._read(
            listed, lambda c, idx: c.exists([listed[i] for i in idx]), lambda r: r is False, parallel=many
        )
        return _one_or_many(keys, [self._raise(r) is True for r in found])

    def expire(self, keys: str | Iterable[str], ttl: float | None) -> bool | list[bool]:
        """Set keys' time to live on every worker that holds them; True where one did."""
        return _one_or_many(keys, self._everywhere("expire", keys, ttl))

    def size(self, keys: str | Iterable[str]) -> int | list[int | None] | None:
        """Each key's size in bytes, None where no worker has it."""
        listed = check_keys([keys] if isinstance(keys, str) else keys)
        many = len(listed) >= PARALLEL_MIN_KEYS
        found = self._read(listed, lambda c, idx: c.size([listed[i] for i in idx]), lambda r: r is None, parallel=many)
        return _one_or_many(keys, [None if isinstance(r, KeyNotFound) else self._raise(r) for r in found])

    def _everywhere(self, op: str, keys: Any, *args: Any) -> list[bool]:
        """``op`` (delete, expire) on each key's every candidate worker; True where any held the key."""
        listed = check_keys([keys] if isinstance(keys, str) else keys)
        if not listed:
            return []
        live, previous = self._views()
        groups: dict[str, list[int]] = {}
        for i, key in enumerate(listed):
            for node in self._candidates(key, live, previous):
                groups.setdefault(node, []).append(i)
        outcome = self._run(
            {n: (lambda c, idx=idx: getattr(c, op)([listed[i] for i in idx], *args)) for n, idx in groups.items()},
            parallel=len(listed) >= PARALLEL_MIN_KEYS,
        )
        found = [False] * len(listed)
        for node, idx in groups.items():
            got = outcome[node]
            if isinstance(got, BaseException):
                if not isinstance(got, UNREACHABLE):
                    raise got
                continue  # (its keys go with it)
            for j, i in enumerate(idx):
                found[i] = found[i] or bool(got[j])
        return found

    # device objects ------------------------------------------------------------------------------------------------
    def mset_d2h(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, stream: Any = None
    ) -> list[Result]:
        """:meth:`Client.mset_d2h` with each key on its owners (write-once: an existing key is KeyExists)."""
        keys, tensor_lists = self._device_args(keys, tensor_lists)
        return self._write(
            keys,
            lambda c, idx: c.mset_d2h([keys[i] for i in idx], [tensor_lists[i] for i in idx], stream=stream),
            write_once=True,
        )

    def mget_h2d(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, timeout: float = 0, stream: Any = None
    ) -> list[Result]:
        """:meth:`Client.mget_h2d` from the first of each key's workers that has it; None per key filled."""
        keys, tensor_lists = self._device_args(keys, tensor_lists)
        timeout = check_timeout(timeout)

        def batch(c: Any, idx: list[int]) -> list[Result]:
            return c.mget_h2d([keys[i] for i in idx], [tensor_lists[i] for i in idx], stream=stream)

        results = self._read(keys, batch, _is_miss)
        if timeout != 0:

            def wait(c: Any, idx: list[int]) -> list[Result]:
                tensors = [tensor_lists[i] for i in idx]
                return c.mget_h2d([keys[i] for i in idx], tensors, timeout=timeout, stream=stream)

            self._wait_on_first_owners(keys, results, wait)
        return results

    def async_mset_d2h(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, stream: Any = None
    ) -> concurrent.futures.Future:
        """:meth:`mset_d2h` on a background thread (ordered after ``stream``, default: the current stream now)."""
        stream = _current_stream(tensor_lists) if stream is None else stream
        return self._async_executor().submit(self.mset_d2h, keys, tensor_lists, stream=stream)

    def async_mget_h2d(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, timeout: float = 0, stream: Any = None
    ) -> concurrent.futures.Future:
        """:meth:`mget_h2d` on a background thread (ordered after ``stream``, default: the current stream now)."""
        stream = _current_stream(tensor_lists) if stream is None else stream
        return self._async_executor().submit(self.mget_h2d, keys, tensor_lists, timeout=timeout, stream=stream)

    @staticmethod
    def _device_args(keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]]) -> tuple[list[str], list[Any]]:
        keys = check_keys(keys)
        if isinstance(tensor_lists, str | bytes) or not isinstance(tensor_lists, Sequence):
            raise InvalidType(f"tensor_lists: must be a list of tensor lists, got {type(tensor_lists).__name__}")
        if len(tensor_lists) != len(keys):
            raise InvalidValue(f"tensor_lists: {len(tensor_lists)} lists for {len(keys)} keys")
        return keys, list(tensor_lists)

    # the rest -----------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Each live worker's :meth:`Client.stats` (or the error that kept it from answering), by node id."""
        live, _ = self._views()
        outcome = self._run({node: (lambda c: c.stats()) for node in live.nodes})
        return {
            "cluster": self.membership.url,
            "replicas": self.replicas,
            "nodes": {n: (repr(r) if isinstance(r, BaseException) else r) for n, r in sorted(outcome.items())},
        }

    def ping(self) -> None:
        """Raise unless every live worker answers."""
        live, _ = self._views()
        for node, r in self._run({node: (lambda c: c.ping()) for node in live.nodes}).items():
            if isinstance(r, BaseException):
                raise ConnectionLost(f"worker {node} of {self.membership.url} did not answer: {r}") from r

    def close(self) -> None:
        """Close every worker's client, stop watching the list (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            clients, self._clients = [client for client, _ in self._clients.values()], {}
            pools = [self._async_pool, self._pool]  # (the async calls first: they use the other pool)
            self._pool = self._async_pool = None
        self._stop_watch()
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        for client in clients:
            self._close_quietly(client)
        if self._own_membership:
            self.membership.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = " closed" if self._closed else ""
        return f"<kvstrata.ClusterClient {self.membership.url} {len(self._members)} workers{closed}>"


def _seconds(name: str, value: Any, *, positive: bool) -> float:
    """A finite number of seconds (> 0 where ``positive``, else >= 0), or InvalidType / InvalidValue naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidType(f"{name}: must be seconds (a number), got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise InvalidValue(f"{name}: must be a finite number of seconds {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def _said_replicas(member: Member) -> int:
    """How many copies of each key worker ``member`` says its cluster keeps (1 where it says nothing usable)."""
    said = member.info.get("replicas")
    return said if type(said) is int and 1 <= said <= 16 else 1


def _incarnation(member: Member | None) -> tuple:
    """What tells one run of a worker from the next under the same node id (a restart on the same address)."""
    if member is None:
        return ()
    return (member, member.info.get("pid"), member.info.get("started_at"))


def _nbytes(value: Any) -> int:
    """A value's size where it says (bytes-likes, arrays, tensors), else 0."""
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return len(value) if isinstance(value, bytes | bytearray) else 0


def _is_miss(result: Result) -> bool:
    return isinstance(result, KeyNotFound | Timeout)


def _result(fn: Callable[..., Any], *args: Any) -> Result:
    try:
        return fn(*args)
    except (KeyNotFound, *UNREACHABLE) as exc:
        return exc


def _current_stream(tensor_lists: Sequence[Sequence[Any]]) -> Any:
    """The current CUDA stream of the first CUDA tensor's device (None without one): an async call's copies wait
    for the work queued on it at the call, as the one-worker client's do."""
    for tensors in tensor_lists:
        for t in tensors:
            device = getattr(t, "device", None)
            if device is not None and device.type == "cuda":
                import torch

                return torch.cuda.current_stream(device)
    return None
