"""One client connection of the worker: its thread reads requests (the socket, or the shared-memory lane while
it polls), runs each through :data:`~kvstrata.server.handlers.HANDLERS` with the connection as the engine's
owner, and sends the replies; it also keeps what the client holds (leases, unsealed creates), the client's
lingering hints and the commits waiting for the client's landing word (:mod:`kvstrata.server.lane`), and gives
everything back when the client goes (:meth:`Session.cleanup`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any

from kvstrata.devobj import service as devobj_service
from kvstrata.errors import (
    ClosedError,
    ConnectionLost,
    InvalidValue,
    KeyExists,
    KeyNotFound,
    KvstrataError,
    ServerError,
    Timeout,
)
from kvstrata.server import lane as _lane
from kvstrata.server import protocol as P
from kvstrata.server.gil_spin import ReadyCheck
from kvstrata.server.handlers import HANDLERS, release
from kvstrata.transport import Connection
from kvstrata.transport.stream import ATTACH_MIN_BYTES, MAX_FDS, Attachment, pack, unpack

if TYPE_CHECKING:
    from kvstrata.server.worker import Worker

log = logging.getLogger("kvstrata.worker")
_owner_ids = itertools.count(1)
#: lane checks per socket check while a connection thread polls both (a check: ~0.1 us, against ~1 us)
_LANE_TURNS = 8
#: the longest a client may ask the worker to keep polling for its next request (``"linger"``, in us)
LINGER_MAX_US = 5000
#: a client's word that the copies of its commits sent ahead of them landed (kvstrata.server.lane) is polled for
#: this long, then every LANDING_NAP_S, for as long as the client stays connected and says nothing
LANDING_SPIN_S = 2e-3
LANDING_NAP_S = 50e-6
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


class Session:
    """One client connection: its owner id, what it was sent, what it holds."""

    def __init__(self, worker: Worker, conn: Connection, hello: dict) -> None:
        self.worker = worker
        self.store = worker.store
        self.conn = conn
        self.owner = next(_owner_ids)
        self.pid = hello.get("pid")
        self.name = f"pid {hello.get('pid', '?')}" + (f" ({hello['name']})" if hello.get("name") else "")
        # Large values go through shared memory only if the client can map it.
        self.shm = bool(hello.get("shm", True)) and conn.can_pass_fds
        self.sent_segments: set[int] = set()
        #: how many of the store's retired segments (``store.retired_segments``, in the order they went) this client
        #: was told of or never sent: the rest go with the next reply (:meth:`send`)
        self.retired_told = 0
        # the store's list of them (appended to, never replaced; a store without a memory tier's retirements: none)
        self._retired: list[int] = getattr(worker.store, "retired_segments", [])
        self.connected_at = time.time()
        #: one of a device-object link's connections (kvstrata.devobj.service): part of a client, not one
        self.devobj_link = bool(hello.get("devobj_link"))
        #: the client closed (rather than vanished): it waits for the connection's end, which comes after the cleanup
        self.said_bye = False
        self.leases: set[int] = set()
        self.writes: dict[str, float | None] = {}  # unsealed creates -> their TTL
        self.validity = worker.validity
        self.lane: _lane.Lane | None = None
        # Held while this lane's request is taken and answered, by this thread or the worker's lane poller
        # (kvstrata.server.lane_poller): each request is served once, and the lane is never closed mid-request.
        self.lane_lock = threading.Lock()
        self._drained = False  # whether the connection's read buffer was found empty since its last read
        self.landing_tags: collections.deque[int] = collections.deque()  # commits waiting for the lane's word
        # perf_counter time until which this connection polls for its next request whatever worker.spin says
        # (a request's "linger": the client said another request follows by then, e.g. a device write's commit)
        self.linger_until = 0.0
        self._ready: ReadyCheck | None = None  # the socket's readiness, checked while polling (made on first use)

    def open_lane(self) -> None:
        from kvstrata.memory.shm import SharedSegment

        seg = SharedSegment.create(_lane.LANE_BYTES, name="kvstrata-lane", hugepages="off", numa_node=None)
        self.lane = _lane.Lane(seg)

    def run(self) -> None:
        if hasattr(self.store, "guard_waits"):
            self.store.guard_waits(self.client_gone)  # a request waiting for a key ends when its client does
        while True:
            msg, from_lane = self._next()
            op = msg.get("op")
            if op == "bye":  # a clean close, as opposed to a crash
                self._count_local_hits(msg)
                self.said_bye = True
                return
            if op == "lane":  # the client stopped waiting on the lane: answer its request, then say so here
                self.worker.counters["lane_wakeups"] += 1
                with self.lane_lock:  # (or the lane poller is answering it: wait for that)
                    lane = self.lane
                    if lane is not None and lane.pending():
                        self.answer_lane(lane)
                    seq = lane.last_answered() if lane is not None else 0
                self.send({"seq": seq})
                continue
            if from_lane:
                self._lane_reply(self._handle_lane(msg))
                continue
            reply = self.handle(msg)
            if self.lane is not None and type(op) is str and op in _lane.LANE_OPS and "tag" not in msg:
                # the client found its lane unpolled: poll the lanes again while several clients are on
                self.worker.lane_poller.kick()
            if reply is None:
                continue
            try:
                self.send(reply)
            except TypeError as exc:  # an unencodable reply is a bug: report it, keep the connection
                log.exception("reply to %r for client %s could not be encoded", op, self.name)
                self._send_error(reply, ServerError(f"internal error in {op!r}: {exc}"))
            except InvalidValue as exc:  # a reply over the frame limit (a read of a huge range): nothing was sent
                self._send_error(reply, InvalidValue(f"{op}: the reply is too large to send ({exc}); ask for less"))

    def _send_error(self, reply: dict, exc: Exception) -> None:
        """``exc`` in the place of ``reply``, which could not be sent (under its tag, for a pipelined request)."""
        error = P.error_record(exc)
        if "tag" in reply:
            error["tag"] = reply["tag"]
        self.send(error)

    def _count_local_hits(self, msg: dict) -> None:
        n = msg.get("lh")
        if type(n) is int and 0 < n < 1 << 62:  # (a bad count is dropped: it is a statistic, not a request)
            self.worker.counters["local_hits"] += n

    def client_gone(self) -> bool:
        """Whether this connection's client is gone: the connection closed (the worker stopping), or its socket hung up
        (the client exited or was killed), even with requests it sent still unread (``POLLRDHUP``)."""
        conn = self.conn
        if conn.closed:
            return True
        fileno = getattr(conn, "fileno", None)
        if fileno is None:  # an in-process connection: closed is all there is
            return False
        try:
            poller = select.poll()
            poller.register(fileno(), select.POLLRDHUP)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # its descriptor closed under us
            return True

    def _next(self) -> tuple[dict, bool]:
        """The next request: ``(message, came through the lane)``.

        With a worker that busy-polls, the socket and the lane (if any) are polled for ``worker.spin`` seconds
        (the lane advertised as polled meanwhile), then the socket is waited on.
        """
        if self.landing_tags:
            if not self._drained:  # a request may be read already: serve it first
                try:
                    return self._recv(self.conn.recv(timeout=0)), False
                except Timeout:
                    self._drained = True
            self._watch_landings()  # until a request comes (the socket or the lane) or none waits
        spin, lane = self.worker.spin, self.lane
        if spin > 0.0 and self.linger_until:
            spin = max(spin, self.linger_until - time.perf_counter())
            self.linger_until = 0.0
        conn = self.conn
        if spin <= 0.0 or not hasattr(conn, "fileno"):  # (an in-process connection: its client shares our GIL)
            if lane is not None and not self.worker.lane_poller.spelling:  # (the poller's flag while it polls)
                lane.set_polling(False)
            return self._recv(conn.recv(spin=spin)), False
        if lane is not None:  # the flag stays up while a request is handled too: the client polls for the answer
            lane.set_polling(True)
        if not self._drained:  # frames already read into the connection's buffer show only here, not to poll
            try:
                return self._recv(conn.recv(timeout=0)), False
            except Timeout:  # ~7 us: not repeated until a socket read could have buffered another frame
                self._drained = True
        got = self._poll_for_request(lane, spin)
        if got is not None:
            return got
        if lane is not None:
            if not self.worker.lane_poller.spelling:  # (else the poller raised the flag and polls the lane now)
                lane.set_polling(False)
            if lane.pending():  # handed over while the flag went down
                taken = self._take_lane(lane)
                if taken is not None:
                    return taken, True
        return self._recv(conn.recv()), False

    def _poll_for_request(self, lane: _lane.Lane | None, spin: float) -> tuple[dict, bool] | None:
        """The next request if one comes within ``spin`` seconds of polling the lane (if any) and the socket.

        The GIL is never given up here (kvstrata.server.gil_spin): the worker's other threads get it at the
        switch interval. A loop that yielded each turn kept a new client's connect waiting for tens of ms.
        """
        conn = self.conn
        clock, ready = time.perf_counter, self._ready
        if ready is None:
            try:
                ready = self._ready = ReadyCheck(conn.fileno())
            except (OSError, ValueError) as exc:  # closed meanwhile: its descriptor reads -1
                raise ClosedError("connection closed by the worker") from exc
        pending = lane.pending if lane is not None else None
        end = clock() + spin
        while True:
            # the lane is checked every turn (a memory load), the socket every few (a system call)
            if pending is not None:
                for _ in range(_LANE_TURNS):
                    if pending():
                        taken = self._take_lane(lane)  # type: ignore[arg-type]
                        if taken is not None:
                            return taken, True
            if conn.closed:  # its descriptor may be another file's by now: never poll it again
                raise ClosedError("connection closed by the worker")
            try:
                readable = ready()
            except OSError as exc:  # the worker closed the connection (shutting down) meanwhile
                if conn.closed:
                    raise ClosedError("connection closed by the worker") from exc
                raise ConnectionLost(f"connection of client {self.name} failed: {exc}") from exc
            if readable:
                return self._recv(conn.recv()), False
            if clock() >= end:
                return None

    def _take_lane(self, lane: _lane.Lane) -> dict | None:
        """The lane's pending request, taken under its lock; None if the lane poller took it first."""
        with self.lane_lock:
            return unpack(lane.take()) if lane.pending() else None

    def landing_check(self, tag: Any) -> Any:
        """For a ``commit`` sent ahead of its copies: the callable the store asks whether they landed (the
        client's word in this connection's lane page; kvstrata.server.lane)."""
        lane = self.lane
        if lane is None or type(tag) is not int or tag <= 0:
            raise InvalidValue("landing: a commit ahead of its copies needs the connection's lane and a tag")
        landing, settled = lane.landing, lane.mark_settled

        def landed() -> bool | None:
            got = landing(tag)
            if got is not None:  # read: the client may write the words of its next call's commits
                settled(tag)
            return got

        return landed

    def _watch_landings(self) -> None:
        """While commits of this client wait for its word that their copies landed, poll the word (and settle
        them in the store as it comes, which wakes readers waiting for their keys) until a request arrives or
        none waits. Returns with commits still waiting when a request came: the next wait goes on watching."""
        lane, tags, conn = self.lane, self.landing_tags, self.conn
        landing, settle = lane.landing, self.store.settle  # type: ignore[union-attr]
        # First the work the commits' answers did not wait for (their pieces cut, their versions given), while the
        # copies still run: their landing then only shows the objects.
        self.store.cut_landings(self.owner)
        lane_poller = self.worker.lane_poller  # while it serves, it answers the lane: keep watching here
        yield_cpu, clock = os.sched_yield, time.perf_counter
        start = clock()
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | _HANGUP)
        while tags:
            for _ in range(_LANE_TURNS):
                if landing(tags[0]) is not None:  # the oldest resolved (the words only move forward)
                    settle(self.owner)
                    while tags and landing(tags[0]) is not None:
                        tags.popleft()
                    break
                if lane.pending() and not lane_poller.on:  # type: ignore[union-attr]
                    return
                yield_cpu()  # releases the GIL: the worker's other connections go on meanwhile
            if not tags or poller.poll(0):
                return  # a request (or the hang-up, which the read reports) to serve first
            if clock() - start > LANDING_SPIN_S:
                time.sleep(LANDING_NAP_S)

    def _recv(self, got: tuple[dict, list[int]]) -> dict:
        self._drained = False  # the read that brought this frame may have brought the next ones too
        msg, fds = got
        for fd in fds:  # clients have no reason to send descriptors
            _close(fd)
        return msg

    def answer_lane(self, lane: _lane.Lane) -> None:
        """Take, serve and answer the lane's pending request (under :attr:`lane_lock`)."""
        self._lane_reply(self._handle_lane(unpack(lane.take())))

    def _handle_lane(self, msg: dict) -> dict:
        """The reply to a request that came through the lane, whether taken while polling or when woken."""
        op = msg.get("op")
        if type(op) is not str or op not in _lane.LANE_OPS:  # its reply could need descriptors, or not fit
            return P.error_record(ServerError(f"request {op!r:.100} cannot travel through the lane"))
        reply = self.handle(msg)
        return reply if reply is not None else {}

    def _lane_reply(self, reply: dict) -> None:
        if not reply:
            self.lane.answer(_EMPTY_REPLY)  # type: ignore[union-attr]
            return
        reply.pop("_segs", None)  # lane ops point into no segment
        try:
            payload = pack(reply)
        except TypeError as exc:
            log.exception("lane reply for client %s could not be encoded", self.name)
            payload = pack(P.error_record(ServerError(f"internal error: {exc}")))
        if len(payload) > _lane.REPLY_BYTES:
            payload = pack(P.error_record(ServerError(f"reply of {len(payload)} bytes too large for the lane")))
        self.lane.answer(payload)  # type: ignore[union-attr]

    def handle(self, msg: dict) -> dict | None:
        """Run one request; its reply (an error record for a refused one), None for a one-way op."""
        op = msg.get("op")
        self.worker.counters["requests"] += 1
        handler = HANDLERS.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise ServerError(f"unknown request {op!r:.100}")
            linger = msg.get("linger")
            if linger:  # another request of this client follows within this many us: poll until then
                self.linger_until = time.perf_counter() + min(P.check_size(linger, "linger"), LINGER_MAX_US) * 1e-6
            if "lh" in msg:  # reads the client served from shared memory since its last request
                self._count_local_hits(msg)
            if msg.get("rel"):  # releases deferred by the client's garbage collector
                release(self, {"ids": P.check_ids(msg["rel"], "rel")})
            aborts = msg.get("abort_keys")
            if aborts:  # writes whose buffers were dropped unsealed
                for key in P.check_keys(aborts, "abort_keys"):
                    try:
                        self.store.abort(key, owner=self.owner)
                        self.writes.pop(key, None)
                    except (KvstrataError, ValueError, TypeError):
                        pass  # not this client's unsealed write (any more): nothing to abort
            reply = handler(self, msg)
        except (KeyNotFound, KeyExists, Timeout) as exc:  # answers, not faults (the store counts misses)
            reply = P.error_record(exc)
        except (KvstrataError, ValueError, TypeError, KeyError) as exc:
            # (a wait whose client was killed, or whose connection the worker closed, ends with ClosedError: no request
            # was refused, and nobody hears of it)
            if not (isinstance(exc, ClosedError) and self.client_gone()):
                self.worker.counters["errors"] += 1
            reply = P.error_record(exc)
        except Exception as exc:  # a bug: say so, keep serving
            self.worker.counters["errors"] += 1
            log.exception("request %r from client %s failed", op, self.name)
            reply = P.error_record(ServerError(f"internal error in {op!r}: {type(exc).__name__}: {exc}"))
        if reply is devobj_service.DEFERRED:  # a parked device-object poll or a one-way request
            return None
        if handler is not None and op in P.ONE_WAY_OPS:
            if "err" in reply:  # nobody waits for an answer: a reply would desynchronize the client
                log.warning("client %s: bad %s request: %s", self.name, op, reply["err"][1])
            return None
        tag = msg.get("tag")
        if tag is not None:  # a pipelined request: the client matches its reply by this
            reply["tag"] = tag
        return reply

    def send(self, reply: dict) -> None:
        if len(self._retired) != self.retired_told:
            self._tell_retired(reply, self._retired)
        new = reply.pop("_segs", None)
        if new and len(new) > MAX_FDS:  # the rest are fetched by the client with a "segments" request
            self.sent_segments.difference_update(new[MAX_FDS:])
            new = new[:MAX_FDS]
        if new:
            segs = self.store.segments
            reply["segs"] = [[i, segs[i].nbytes] for i in new]
            self.conn.send(reply, [segs[i].fd for i in new])
            self.sent_segments.update(new)
        else:
            self.conn.send(reply)

    def _tell_retired(self, reply: dict, retired: list[int]) -> None:
        """Say in ``reply`` which of the segments sent to this client were retired since it was last told: it
        unregisters them with CUDA (its page-locking would keep their pages from the kernel) and unmaps them."""
        start, end = self.retired_told, len(retired)  # (the store only appends to the list)
        self.retired_told = end
        gone = [i for i in retired[start:end] if i in self.sent_segments]
        if gone:
            reply["retired"] = gone
            self.sent_segments.difference_update(gone)

    def cleanup(self) -> str:
        devobj = devobj_service.session_closed(self)  # its device objects vanish, their waiters get errors
        leases, writes = len(self.leases), len(self.writes)
        try:
            self.store.release_owner(self.owner)
        except ClosedError:  # the worker is shutting down: the store is gone with everything in it
            return ""
        self.leases.clear()
        self.writes.clear()
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        parts = list(devobj)
        if leases:
            parts.append(f"released {leases} read lease{'s' * (leases != 1)}")
        if writes:
            parts.append(f"{writes} unfinished write{'s' * (writes != 1)} aborted")
        return f"; {', '.join(parts)}" if parts else ""

    # helpers -------------------------------------------------------------------------------------
    def loc(self, location: Any, reply: dict) -> list[int]:
        if location.size and location.segment not in self.sent_segments:
            reply.setdefault("_segs", []).append(location.segment)
            self.sent_segments.add(location.segment)  # once per reply, even for many keys
        return [location.segment, location.offset, location.size]

    def new_segments(self, locs: list[int], reply: dict) -> None:
        """Note in ``reply`` the segments of flat ``[segment, offset, size] * n`` locations not sent yet."""
        sent = self.sent_segments
        segs = set(locs[0::3])
        if not segs <= sent:
            new = sorted(i for i in segs - sent if any(locs[k + 2] for k in range(0, len(locs), 3) if locs[k] == i))
            if new:
                reply.setdefault("_segs", []).extend(new)
                sent.update(new)

    def write_options(self, msg: dict) -> dict:
        """The engine's write keywords from a request's fields. Callers must not change the dict."""
        get = msg.get
        ttl, mode, nx = get("ttl"), get("mode", "memory"), get("nx", False)
        if ttl is None and nx is False and mode == "memory":  # what nearly every write asks for
            plain = _PLAIN_WRITE.get("opts")
            if plain is None:
                plain = _PLAIN_WRITE["opts"] = {"ttl": None, "write_mode": _write_mode("memory"), "nx": False}
            return plain
        return {
            "ttl": None if ttl is None else P.check_ttl(ttl),
            "write_mode": _write_mode(mode),
            "nx": bool(nx),
        }

    def lease_item(self, lease: Any, reply: dict) -> dict:
        """Inline the bytes of a small object (and drop the lease), else hand out the lease. With no shared memory
        (TCP) a large object's bytes go as an attachment straight out of the store, its lease held until sent."""
        if not self.shm or lease.size < P.INLINE_MAX:
            if lease.size >= ATTACH_MIN_BYTES:
                lease_id = lease.lease_id
                self.leases.add(lease_id)
                return {"v": Attachment(self.store.buffer(lease.location), lambda: self._sent(lease_id))}
            try:
                return {"v": bytes(self.store.buffer(lease.location))}
            finally:
                self.store.release(lease.lease_id)
        self.leases.add(lease.lease_id)
        return {"lease": lease.lease_id, "loc": self.loc(lease.location, reply)}

    def _sent(self, lease_id: int) -> None:
        """Drop the lease an attachment's bytes were sent under (unless the client's leaving released it already)."""
        if lease_id in self.leases:
            self.leases.discard(lease_id)
            self.store.release(lease_id)


_WRITE_MODES: dict[str, Any] = {}
_PLAIN_WRITE: dict[str, dict] = {}  # the write options of a plain write, built once
#: the reply of every successful write, encoded once
_EMPTY_REPLY = pack({})


def _write_mode(name: Any) -> Any:
    mode = _WRITE_MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        from kvstrata.store import WriteMode

        mode = _WRITE_MODES[name] = WriteMode(P.check_write_mode(name))
    return mode


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
