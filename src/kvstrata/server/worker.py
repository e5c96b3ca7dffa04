"""The node worker: owns an :class:`~kvstrata.store.ObjectStore`, serves clients over a transport.

One thread per client connection runs request -> engine call -> reply (:class:`~kvstrata.server.session.Session`,
the connection's side of it). The connection is the
engine's ``owner``: when a client closes, crashes or is SIGKILLed, its socket reads EOF and the
worker calls ``release_owner`` (its leases are released, its unfinished writes aborted, so no
partial object ever becomes visible). Shared segments are handed to a client the first time a
reply points into them. A bad request gets an error record back; it never takes the worker down.

Example (what ``kvstrata worker`` does)::

    worker = Worker(WorkerConfig.load(flags={"socket": "/tmp/kv.sock", "memory": "1GiB"})).start()
    lost = worker.serve_forever()   # until SIGTERM/SIGINT/SIGHUP or worker.stop(); write-back objects not flushed
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvstrata.cluster.placement import Placement
from kvstrata.devobj import service as devobj_service
from kvstrata.errors import ClosedError, ConnectionLost, InvalidValue, NotOwner, TransportError
from kvstrata.server import lane as _lane
from kvstrata.server import protocol as P
from kvstrata.server.config import WorkerConfig
from kvstrata.server.gil_spin import GIL_SWITCH_S
from kvstrata.server.http_metrics import MetricsServer
from kvstrata.server.lane_poller import LanePoller
from kvstrata.server.session import Session
from kvstrata.server.validity import SLOTS, SLOTS_OFFSET, SPIN_HINT_OFFSET, Validity
from kvstrata.store.placements import BUCKETS as PLACEMENT_BUCKETS
from kvstrata.store.placements import PlacementTable
from kvstrata.transport import Connection, Listener, listen
from kvstrata.transport.core import OUT_OF_FDS_ERRNOS, HelloRefused, out_of_fds_reason
from kvstrata.transport.stream import MAX_FDS

log = logging.getLogger("kvstrata.worker")

#: clients listed one by one in the stats (and ``kvstrata status``); the count covers them all
CLIENT_LIST_MAX = 64
#: the lane poller serves while at most this many clients per CPU are connected (on the 2-CPU development VM, 4
#: clients' 4 KiB sets went from 9-10k to 16-18k ops/s with it; past that its clients' polling starves it)
POLLED_CLIENTS_PER_CPU = 2
#: one client's local-read cache may pin 1/CACHE_SHARE of the memory tier (kvstrata.client.local_reads)
CACHE_SHARE = 16
#: signals that shut a worker down cleanly in serve_forever (SIGHUP: the terminal of a `kvstrata worker &` closed)
SHUTDOWN_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


class Worker:
    """A running worker. ``start()`` listens; ``stop()`` (or SIGTERM, SIGINT, SIGHUP in ``serve_forever``) shuts
    down cleanly, and says how many write-back objects it could not flush to SSD (lost).

    A ``store`` passed in must be changed only through this worker: clients' local reads trust the
    worker to announce every change (:mod:`kvstrata.server.validity`).
    """

    def __init__(self, config: WorkerConfig, *, store: Any = None) -> None:
        self.config = config
        self._store = store
        self._own_store = store is None
        self._listener: Listener | None = None
        self.validity: Validity | None = None
        self.placements: PlacementTable | None = None  # where objects lie, for clients' early copies
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.started_at = time.time()
        self.counters: Counter[str] = Counter()
        self._cpus = len(os.sched_getaffinity(0))
        #: seconds a connection thread busy-polls for its next request (see _update_spin)
        self.spin = 0.0
        #: polls every client's lane while several are connected (see _update_spin)
        self.lane_poller = LanePoller(config.spin_us * 1e-6)
        self.metrics_server: MetricsServer | None = None  # GET /metrics, with config.metrics_address
        #: in cluster mode (config.cluster): the TCP listener for other hosts, and this worker's entry in the list
        self._cluster_listener: Listener | None = None
        self.membership: Any = None
        self.member: Any = None
        _WORKERS.add(self)
        #: write-back objects the store could not flush to SSD when stop() closed it: lost with the worker
        self.unflushed = 0
        self._stop_began = False  # (set by stop(): _stopped is set by a signal before stop() runs)
        #: what stop()'s hand-off of objects to the other workers of its cluster did (kvstrata.server.drain), if any
        self.drained: dict[str, Any] | None = None
        #: in a cluster with cluster_rebalance: hands objects on at each change of the member list
        self.rebalancer: Any = None
        #: in a cluster: (a placement over the member list as this worker last saw it, its node id), which a write a
        #: client routed by another list is checked against (not_owned); None outside one
        self._owning: tuple[Any, str] | None = None
        self._stop_watch: Any = None  # (ends the watch of the member list: _on_members)
        #: what clients and peers of its TCP listeners must prove they hold (kvstrata.transport.core), and what it
        #: answers other workers' challenges with when it hands objects on
        self._token: bytes | None = config.auth_token()

    # lifecycle -----------------------------------------------------------------------------------
    @property
    def store(self) -> Any:
        return self._store

    @property
    def address(self) -> str:
        if self._listener is None:
            raise ClosedError("worker is not listening (call start())")
        return self._listener.address

    def start(self) -> Worker:
        if self._store is None:
            from kvstrata.store import ObjectStore

            self._store = ObjectStore(self.config.store_config())
        self.validity = Validity()
        if hasattr(self._store, "set_visibility"):  # commits settled outside a request's change (landing)
            self._store.set_visibility(self.validity)
            self._store.set_reclaim(self.validity.ask_reclaim)  # a write short of room asks the caches' leases back
        if self.config.placement_table and hasattr(self._store, "publish_placements"):
            self.placements = PlacementTable()
            self._store.publish_placements(self.placements)
        if hasattr(self._store, "add_segment_listener"):
            self._store.add_segment_listener(self._on_segment)
        self.lane_poller.start()
        try:
            self._listener = listen(
                self.config.address,
                self._serve,
                on_hello=self._on_hello,
                on_abandon=self._on_abandon,
                token=self._token if self.config.address.startswith("tcp://") else None,
                mode=self.config.socket_mode,
            )
        except BaseException:
            self.lane_poller.stop()
            if self._own_store:
                self._store.close()
            raise
        endpoint = self.config.metrics_endpoint()
        if endpoint is not None:
            try:
                self.metrics_server = MetricsServer(self.stats, *endpoint)
            except OSError as exc:
                self.stop()
                raise InvalidValue(
                    f"metrics_address: cannot serve metrics at {self.config.metrics_address!r}: {exc}"
                ) from exc
            log.info("Prometheus metrics at %s", self.metrics_server.url)
        if self.config.cluster:
            try:
                self._join_cluster()
            except BaseException:
                self.stop()
                raise
        stats = self._store.stats()
        log.info(
            "worker pid %d listening on %s (memory tier %s, disk tier %s)",
            _pid(),
            self._listener.address,
            _fmt(self.config.memory),
            f"{_fmt(self.config.disk_size)} in {self.config.disk_dir}" if self.config.disk_dir else "off",
        )
        log.debug("store stats at start: %s", stats)
        if self.config.disk_dir:
            self.config.record_default_disk_size()  # (the store made its folder)
        self._warn_if_disk_short()
        self._warn_if_memory_short()
        return self

    def _join_cluster(self) -> None:
        """Listen on ``cluster_listen`` too and list this worker in ``cluster`` (kvstrata.cluster), so that clients
        anywhere route keys to it; it stays listed while it lives (a lease it renews) and leaves at :meth:`stop`."""
        import socket as _socket

        from kvstrata import __version__ as kvstrata_version
        from kvstrata.cluster.membership import Member, advertised_address, open_membership

        config = self.config
        self._cluster_listener = listen(
            config.cluster_listen, self._serve, on_hello=self._on_hello, on_abandon=self._on_abandon, token=self._token
        )
        address = config.cluster_advertise or advertised_address(self._cluster_listener.address)
        local = self._listener.address if self._listener.address.startswith("unix://") else ""
        self.member = Member(
            node_id=config.node_id or address.removeprefix("tcp://"),
            address=address,
            socket=local,
            host=_socket.gethostname(),
            info={
                "pid": _pid(),
                "memory": config.memory,
                "disk": config.disk_size if config.disk_dir else 0,
                "started_at": round(self.started_at, 3),
                "version": kvstrata_version,
                "replicas": config.cluster_replicas,
            },
        )
        self.membership = open_membership(config.cluster)
        try:
            self._join_as(self.member)
            members = self.membership.members()
            self._owning = (Placement(members), self.member.node_id)
            if config.cluster_rebalance:
                self._start_rebalancer(members)
            self._stop_watch = self.membership.watch(self._on_members)
        except BaseException:
            self.membership.close()
            self.membership = None
            raise
        log.info("joined cluster %s as %s (%s)", config.cluster, self.member.node_id, address)

    def _on_members(self, members: dict[str, Any]) -> None:
        """A new member list: writes routed by another one are checked against it (not_owned) before the objects
        it no longer owns are handed on (a stale client's write that came after that would sit out of sight)."""
        self._owning = (Placement(members), self.member.node_id)
        rebalancer = self.rebalancer
        if rebalancer is not None:
            rebalancer.update(members)

    def not_owned(self, view: Any) -> Callable[[str], NotOwner | None] | None:
        """For a write a cluster client routed by the member list whose fingerprint is ``view``
        (:attr:`Placement.fingerprint <kvstrata.cluster.placement.Placement.fingerprint>`): a function giving a
        key's :class:`NotOwner` refusal where that is not this worker's list and the key is not its own under its
        list, else None; None in place of the function where nothing is checked (the lists agree, nearly always, or
        no cluster). The client re-reads its list: a stale client's write would otherwise land on a worker that had
        handed the key on already, out of its readers' sight (kvstrata.server.handlers refuses the keys)."""
        owning = self._owning
        if owning is None or view == owning[0].fingerprint:
            return None
        placement, me = owning
        replicas = self.config.cluster_replicas

        def refuse(key: str) -> NotOwner | None:
            owners = placement.rank(key)[:replicas]
            if me in owners:
                return None
            self.counters["not_owner"] += 1
            return NotOwner(
                f"worker {me} does not own key {key!r} under its member list ({len(placement)} workers: owned by "
                f"{', '.join(owners) or 'none'}), and the write was routed by another list: re-read the list"
            )

        return refuse

    def _start_rebalancer(self, members: dict[str, Any]) -> None:
        """Hand objects on at each change of the member list from now on (kvstrata.server.rebalance)."""
        from kvstrata.server.rebalance import Rebalancer

        store = self._store

        def drop(keys: list[str], versions: list[int]) -> list[bool]:
            if self.validity is None:
                return store.delete(keys, versions=versions)
            with self.validity.change(keys):  # (clients reading from shared memory stop trusting these keys)
                return store.delete(keys, versions=versions)

        self.rebalancer = Rebalancer(
            self.member.node_id,
            members,
            listing=store.listing,
            read=self._lend,
            drop=drop,
            replicas=self.config.cluster_replicas,
            token=self._token,
        )

    def _join_as(self, member: Any) -> None:
        """Join as ``member``; where a worker of this host that is gone still holds the node id (restarted within
        its lease: a crash, or systemd's restart), wait for its lease to run out (at most ``cluster_ttl``)."""
        from kvstrata.errors import KeyExists

        deadline = time.monotonic() + self.config.cluster_ttl + 2.0
        told = False
        while True:
            try:
                self.membership.join(member, ttl=self.config.cluster_ttl)
                return
            except KeyExists:
                held = self.membership.members().get(member.node_id)
                if (held is not None and not _dead_here(held, member)) or time.monotonic() > deadline:
                    raise
                if not told:
                    log.warning(
                        "node id %s is still listed for pid %s of this host, which is gone: waiting for its lease "
                        "to run out (at most %g s)",
                        member.node_id,
                        held.info.get("pid") if held is not None else "?",
                        self.config.cluster_ttl,
                    )
                    told = True
                time.sleep(0.2)

    def _heirs(self) -> dict[str, str] | None:
        """The other live members' addresses by node id, read before this worker leaves (None: not in a cluster, or
        the list could not be read: nothing is handed on, and the log says why)."""
        membership, me = self.membership, self.member
        if membership is None or me is None:
            return None
        try:
            members = membership.members()
        except Exception as exc:  # (etcd out of reach: the objects stay here, as without a drain)
            log.warning("cannot read the member list of %s to hand objects on: %s", self.config.cluster, exc)
            return None
        return {node: m.address for node, m in members.items() if node != me.node_id}

    def _lend(self, key: str) -> Any:
        """``key``'s value for a hand-off to another worker (kvstrata.server.handoff): a large one sent straight out of
        the store, under a lease given back once it is sent (no copy, no fresh memory to fault in), a small one
        copied. KeyNotFound where it went meanwhile."""
        from kvstrata.transport.stream import ATTACH_MIN_BYTES, Attachment

        store = self._store
        lease = store.acquire(key, owner=_HANDOFF, timeout=0)
        if lease.size < ATTACH_MIN_BYTES:
            try:
                return bytes(store.buffer(lease.location))
            finally:
                store.release(lease.lease_id)
        return Attachment(store.buffer(lease.location), lambda: store.release(lease.lease_id))

    def _drain(self, heirs: dict[str, str], seconds: float) -> None:
        """Hand this worker's objects to their owners among ``heirs`` (see :mod:`kvstrata.server.drain`)."""
        from kvstrata.server.drain import drain

        store = self._store
        replicas = self.config.cluster_replicas
        me = self.member.node_id if self.member else ""
        with_me, without_me = Placement([*heirs, me]), Placement(heirs)

        def targets(key: str) -> list[str]:
            """The key's owners without this worker that were not with it (one, where it was an owner); all of them
            for a copy here it did not own (a stray, or one a rebalance had not dropped yet: write-once keeps
            theirs)."""
            was, now = with_me.owners(key, replicas), without_me.owners(key, replicas)
            return [n for n in now if n not in was] if me in was else now

        report = drain(
            store.listing(),
            self._lend,
            targets,
            heirs,
            deadline=time.monotonic() + seconds,
            name=f"drain from {self.member.node_id if self.member else '?'}",
            token=self._token,
        )
        self.drained = report.as_dict()
        level = logging.WARNING if report.failed or report.left else logging.INFO
        log.log(
            level,
            "handed on %d objects (%s) to %d workers in %.2f s; %d were there already, %d failed, %d left at the "
            "deadline%s",
            report.moved,
            _fmt(report.bytes_moved),
            len(heirs),
            report.seconds,
            report.present,
            report.failed,
            report.left,
            f" ({'; '.join(report.errors[:3])})" if report.errors else "",
        )

    def _leave_cluster(self) -> None:
        """Off the cluster's list first (clients stop routing here), then the listener for other hosts closes."""
        stop_watch, self._stop_watch = self._stop_watch, None
        if stop_watch is not None:
            stop_watch()
        self._owning = None  # (off the list: writes it is still sent are taken, and drained)
        rebalancer, self.rebalancer = self.rebalancer, None
        if rebalancer is not None:  # (before the drain: it takes over, and no copy here is dropped meanwhile)
            rebalancer.close()
        membership, self.membership = self.membership, None
        if membership is not None:
            membership.close()
        listener, self._cluster_listener = self._cluster_listener, None
        if listener is not None:
            listener.stop()

    def _warn_if_memory_short(self) -> None:
        """Say so at start when the memory tier is larger than the machine's RAM or this process's cgroup memory
        limit: it grows by segments as it fills, and the kernel's OOM killer would end the worker before it is full."""
        from kvstrata.server import config as _config

        try:
            limits = (("physical RAM", _config.physical_memory_bytes()),)
        except Exception:  # (psutil could not say)
            limits = ()
        limits += (("this process's cgroup memory limit", _config.cgroup_memory_limit()),)
        for what, have in limits:
            if have is not None and self.config.memory > have:
                log.warning(
                    "memory tier of %s, but %s is %s: the worker may be killed for memory before the tier is full "
                    "(lower --memory)",
                    _fmt(self.config.memory),
                    what,
                    _fmt(have),
                )

    def _warn_if_disk_short(self) -> None:
        """The SSD tier's size is a promise to the writes it takes: say so at start when its file system cannot
        keep it (a full file system then refuses writes with CapacityError, rather than the tier's accounting)."""
        if not self.config.disk_dir:
            return
        import shutil

        try:
            free = shutil.disk_usage(self.config.disk_dir).free
        except OSError:
            return
        used = (self._store.stats().get("tiers", {}).get("disk") or {}).get("used", 0)
        if self.config.disk_size - used > free:
            log.warning(
                "disk tier of %s in %s, but its file system has %s free: writes will be refused once it is full "
                "(lower --disk-size)",
                _fmt(self.config.disk_size),
                self.config.disk_dir,
                _fmt(free),
            )

    def serve_forever(self) -> int:
        """Block until stop() or SIGTERM/SIGINT/SIGHUP (when called from the main thread), then shut down.

        Returns what :meth:`stop` does: the write-back objects that could not be flushed (0: none lost).
        """
        if threading.current_thread() is threading.main_thread():
            _tune_gc()
            sys.setswitchinterval(GIL_SWITCH_S)  # polling threads never pause on their own (server.gil_spin)
            for sig in SHUTDOWN_SIGNALS:
                signal.signal(sig, lambda signum, frame: self._on_signal(signum))
        while not self._stopped.wait(0.5):
            pass
        return self.stop()

    def _on_signal(self, signum: int) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        self._stopped.set()

    def stop(self, *, drain_s: float | None = None) -> int:
        """Stop listening, disconnect clients, flush write-back data and close the store (idempotent).

        In a cluster, ``drain_s`` (default: the ``cluster_drain`` setting; 0: none) is how long it may spend, once its
        clients are gone, writing its objects to the workers that own their keys without it
        (:mod:`kvstrata.server.drain`; what it did is in :attr:`drained`). Returns how many write-back objects could
        not be flushed to SSD (lost with the worker; 0: none), also kept in :attr:`unflushed`.
        """
        first, self._stop_began = not self._stop_began, True
        if not first:  # (a second stop hands nothing on: the first did, or is doing it)
            drain_s = 0.0
        elif drain_s is None:
            drain_s = float(self.config.cluster_drain)
        heirs = self._heirs() if drain_s > 0 else None
        self._stopped.set()
        self._leave_cluster()
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        if self.validity is not None:
            self.validity.bump_all()  # clients stop answering from shared memory
        if self._listener is not None:
            self._listener.stop()
        self.lane_poller.stop()
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.conn.close()
        if self._store is not None and hasattr(self._store, "wake_waiters"):
            self._store.wake_waiters()  # requests waiting for keys see their connections closed (Session.client_gone)
        deadline = time.monotonic() + 5  # let requests in flight finish before the store goes
        while self._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        if heirs and self._store is not None and drain_s:
            self._drain(heirs, drain_s)
        if self.placements is not None and self._store is not None:
            self._store.publish_placements(None)  # a shared store outlives this worker: stop its writes here
        if self._store is not None and hasattr(self._store, "set_visibility"):
            self._store.set_visibility(None)  # (and its bumps of this worker's validity table, closed below)
            self._store.set_reclaim(None)
        if self._store is not None and self._own_store:
            self._store.close()
            self.unflushed = int(self._store.unflushed or 0)
            if self.unflushed:
                log.error("worker stopped; %d write-back objects could not be flushed (see above)", self.unflushed)
            else:
                log.info("worker stopped; write-back data flushed")
            self._own_store = False
        if self.validity is not None:
            self.validity.close()
            self.validity = None  # type: ignore[assignment]
        if self.placements is not None:
            self.placements.close()
            self.placements = None
        return self.unflushed

    def __enter__(self) -> Worker:
        return self if self._listener else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # stats ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The store's stats plus the worker's own (clients, requests, errors, uptime)."""
        stats = dict(self._store.stats())
        now = time.time()
        with self._lock:
            clients = [s for s in self._sessions.values() if not s.devobj_link]
            stats["clients"] = len(clients)
            stats["device_object_connections"] = len(self._sessions) - len(clients)
            # who holds what: the first thing to look at when memory stays leased or a write stays open
            stats["client_list"] = [
                {
                    "name": s.name,
                    "pid": s.pid,
                    "connected_seconds": round(now - s.connected_at, 1),
                    "leases": len(s.leases),
                    "open_writes": len(s.writes),
                }
                for s in clients[:CLIENT_LIST_MAX]
            ]
        # Hits the clients served from shared memory with no request, as they reported them (with their next request)
        local = self.counters["local_hits"]
        stats["local_hits"] = local
        stats["hits"] = stats.get("hits", 0) + local
        stats["requests"] = self.counters["requests"]
        stats["request_errors"] = self.counters["errors"]
        stats["connections"] = self.counters["connections"]
        stats["lane_requests_polled"] = self.lane_poller.served
        stats["lane_poll_spells"] = self.lane_poller.spells
        stats["lane_poll_kicks"] = self.lane_poller.kicks
        stats["lane_wakeups"] = self.counters["lane_wakeups"]  # lane requests the client had to wake us for
        stats["uptime_seconds"] = round(time.time() - self.started_at, 3)
        member = self.member
        if member is not None:
            stats["cluster"] = {"url": self.config.cluster, "node_id": member.node_id, "address": member.address}
            stats["cluster"]["replicas"] = self.config.cluster_replicas
            # writes routed by an out-of-date member list, refused as not this worker's (Worker.not_owned)
            stats["cluster"]["stale_writes_refused"] = self.counters["not_owner"]
            rebalancer = self.rebalancer
            if rebalancer is not None:
                stats["cluster"]["rebalance"] = {"runs": rebalancer.runs, "running": rebalancer.running}
                stats["cluster"]["rebalance"]["retry_in_s"] = rebalancer.retry_in
                stats["cluster"]["rebalance"]["last"] = rebalancer.last
        broker = getattr(self, "devobj_broker", None)  # started by the first device-object client
        if broker is not None:
            stats["device_objects"] = broker.stats()
        return stats

    # connections ---------------------------------------------------------------------------------
    def _on_segment(self, segment: Any) -> None:
        log.info("memory tier grew: %d segments, newest %s", len(self._store.segments), _fmt(segment.nbytes))

    def _on_hello(self, conn: Connection, hello: dict) -> tuple[dict, list[int]]:
        """The welcome's fields and descriptors for a new client, whose session this lists.

        A worker out of descriptors (the client's lane could not be made) turns the client away with the reason
        (:class:`HelloRefused`) and goes on serving the others.
        """
        try:
            return self._welcome(conn, hello)
        except OSError as exc:
            if exc.errno not in OUT_OF_FDS_ERRNOS:
                raise
            session = getattr(conn, "session", None)
            conn.session = None  # type: ignore[attr-defined]
            if session is not None and session.lane is not None:  # (made before what failed)
                session.lane.close()
                session.lane = None
            with self._lock:
                n = len(self._sessions)
            raise HelloRefused(out_of_fds_reason(exc, f": {n} clients connected")) from exc

    def _welcome(self, conn: Connection, hello: dict) -> tuple[dict, list[int]]:
        session = Session(self, conn, hello)
        conn.session = session  # type: ignore[attr-defined]
        reply: dict = {"inline_max": P.INLINE_MAX, "max_batch": P.MAX_BATCH, "columns": 1}
        fds: list[int] = []
        if session.shm:  # map what exists now; later segments come with the first reply pointing into them
            # room for the page, the placements, the lane, devobj's page
            gone = self._store.retired_segments
            session.retired_told = len(gone)  # taken first: a segment retired after this is told of with a reply
            retired = set(gone[: session.retired_told])
            segs = [(i, seg) for i, seg in enumerate(self._store.segments) if i not in retired][: MAX_FDS - 4]
            reply["segs"] = [[i, seg.nbytes] for i, seg in segs]
            reply["generation_page"] = 0  # fds[0]: the page of server.validity, for local reads
            reply["spin_hint"] = SPIN_HINT_OFFSET  # where in that page the polling advice is
            reply["slots"] = SLOTS_OFFSET  # where in it the per-key counters start
            reply["slot_count"] = SLOTS  # and how many there are
            # what one client may keep leased for local reads (pinned: not evictable while held)
            reply["cache_bytes"] = self.config.memory // CACHE_SHARE
            fds = [self.validity.fd] + [seg.fd for _, seg in segs]
            if self.placements is not None:
                reply["placements"] = len(fds)  # where objects lie (store.placements): early copies
                reply["placement_buckets"] = PLACEMENT_BUCKETS
                fds.append(self.placements.fd)
            session.sent_segments.update(i for i, _ in segs)
            if hello.get("lane") and _lane.supported():
                session.open_lane()
                reply["lane"] = len(fds)
                fds.append(session.lane.segment.fd)
        if hello.get("devobj_generation"):  # a device-object link: its broker's generation page
            reply["devobj_generation"] = len(fds)
            fds.append(devobj_service.broker_of(self).generation_fd)
        # Listed before the welcome goes: a client whose connect() returned is counted (stats, status) at once
        with self._lock:
            self._sessions[session.owner] = session
            self.counters["connections"] += 1
            self._update_spin()
        return reply, fds

    def _on_abandon(self, conn: Connection) -> None:
        """A client that left before its welcome: nothing will serve its session, so let go of what _on_hello
        opened for it (its lane's shared memory)."""
        session = getattr(conn, "session", None)
        if session is not None:
            conn.session = None  # type: ignore[attr-defined]
            try:
                session.cleanup()
            finally:
                with self._lock:
                    self._sessions.pop(session.owner, None)
                    self._update_spin()

    def _serve(self, conn: Connection) -> None:
        session: Session = conn.session  # type: ignore[attr-defined]
        with self._lock:  # (listed by _on_hello)
            n = len(self._sessions)
        if session.lane is not None:
            self.lane_poller.attach(session)
        (log.debug if session.devobj_link else log.info)("client %s connected (%d connected)", session.name, n)
        why = "disconnected"
        try:
            session.run()
        except ConnectionLost:
            why = "went away without closing (exited, crashed or killed)"
        except ClosedError:
            why = "was disconnected by the worker"
        except TransportError as exc:
            why = f"broke the protocol ({exc})"
        finally:
            if not session.said_bye:
                conn.close()
            if session.lane is not None:
                self.lane_poller.detach(session)  # before cleanup closes the lane
            # Listed until its leases and writes are back, so that a client count that dropped means they are; and a
            # client that closed waits in close() for the connection's end, so it ends after the cleanup. Unlisted
            # before that end: a count read once close() returned no longer counts it.
            try:
                released = session.cleanup()
            finally:
                with self._lock:
                    self._sessions.pop(session.owner, None)
                    n = len(self._sessions)
                    self._update_spin()
                conn.close()
            conn.session = None  # type: ignore[attr-defined]  # the two refer to each other: freed by refcount
            quiet = session.devobj_link and not released  # a link's connection that took nothing with it
            (log.debug if quiet else log.info)("client %s %s%s (%d connected)", session.name, why, released, n)

    def _update_spin(self) -> None:
        """Busy-poll only where it cannot hurt: waking a sleeping thread costs ~50 us, a small request ~20.

        The worker's thread polls only while one client is connected: with several, polling threads
        would pass the GIL among themselves between every two requests, and their cores are better
        spent on the clients (measured on the 2 x H200 host: a device-object publisher and subscriber,
        four connections, all polled, made a 4 KiB hand-off take 743 us instead of 445). With several
        clients, one thread polls all their lanes instead, while small requests flow
        (:mod:`kvstrata.server.lane_poller`). Clients poll for replies while every client and the worker can
        have a core of their own; the worker advertises that in the generation page. Call under ``self._lock``.
        """
        n = len(self._sessions)
        spin_us = self.config.spin_us if self._cpus >= 2 else 0.0
        # A client in this very process (embedded use, tests) shares our GIL: polling would starve it.
        in_process = any(s.pid == os.getpid() for s in self._sessions.values())
        self.spin = spin_us * 1e-6 if n == 1 and not in_process else 0.0
        # the poller's clients poll for their answers too: past POLLED_CLIENTS_PER_CPU they would starve it
        self.lane_poller.set_on(spin_us > 0 and 2 <= n <= POLLED_CLIENTS_PER_CPU * self._cpus and not in_process)
        if self.validity is not None:
            self.validity.set_spin_hint(spin_us if n + 1 <= self._cpus else 0)


#: allocations between young collections in a worker process (CPython's default: 700)
GC_YOUNG_THRESHOLD = 50_000


def _tune_gc() -> None:
    """Collect cycles less often in a process that serves (``serve_forever`` from the main thread).

    A request allocates its message, reply and per-key records, which die by reference counting,
    while every write adds a long-lived Entry. At CPython's default threshold a young collection ran
    every few requests and the older generations, which walk every stored object, often enough to
    cost ~0.7 ms per 64-key request (half of a 64-key ``mcreate``). Objects alive at startup are frozen
    out of the collector's walks altogether.
    """
    import gc

    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), middle, old)


def _dead_here(member: Any, me: Any) -> bool:
    """Whether ``member`` (listed under the node id ``me`` wants) was a worker of this host whose process is gone, so
    its entry only waits to lapse: its pid is not running, or is this process's while it is not this worker (a
    container restarted with the same pid, often 1, and hostname: the predecessor was this pid too)."""
    import socket as _socket

    pid = member.info.get("pid")
    if member.host != _socket.gethostname() or type(pid) is not int:
        return False
    if pid == _pid():
        return member.info.get("started_at") != me.info.get("started_at") and not _running_here(member)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (alive, another user's)
        return False
    return False


#: the owner of the leases a hand-off reads objects under (kvstrata.server.handoff)
_HANDOFF = object()
#: this process's workers (a restarted container's predecessor had this pid too: see _dead_here)
_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


def _running_here(member: Any) -> bool:
    """Whether a worker of this process is listed as ``member`` now (two workers of one process under one id)."""
    return any(
        w.member is not None and not w._stopped.is_set() and w.member.info == member.info for w in list(_WORKERS)
    )


def _pid() -> int:
    import os

    return os.getpid()


def _fmt(n: int) -> str:
    from kvstrata.units import format_size

    return format_size(n)
