"""A client's connection to its worker: the plumbing under :class:`~kvstrata.client.remote.RemoteBackend`.

Requests one at a time (``request``) or pipelined by tag (``send_tagged`` / ``tagged_reply``: a reply read
by whoever reads the connection next waits in a stash for its sender); small requests through the
shared-memory lane (:mod:`kvstrata.server.lane`) while the worker polls it; lease releases and aborts
deferred from finalizers riding along with the next request; the worker's segments mapped from the
descriptors it sends; the local-read cache (:mod:`kvstrata.client.local_reads`) set up from the handshake.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstrata._proc import PID
from kvstrata.client._shared import Loc, _segment_tensor
from kvstrata.client.local_reads import MAX_BYTES, LocalReads
from kvstrata.errors import ClosedError, ConnectionLost, InvalidArgument, KvstrataError, ProtocolError, Timeout
from kvstrata.server import lane as _lane
from kvstrata.server import protocol as P
from kvstrata.store.placements import BUCKETS as PLACEMENT_BUCKETS
from kvstrata.store.placements import TABLE_BYTES as PLACEMENT_TABLE_BYTES
from kvstrata.store.placements import PlacementHints
from kvstrata.transport.stream import pack, unpack

log = logging.getLogger(__name__)
#: how often the local-read cache's keeper looks for leases to give back (the worker waits up to
#: ``kvstrata.store.tiering.RECLAIM_WAIT_S`` for them when a write finds no room but leased objects)
KEEPER_POLL_S = 0.01
#: ... and for how many of its looks the application must have made no call before it gives back stale entries' leases
#: and deferred ones (a busy client's calls carry them, with no message of their own)
KEEPER_IDLE_ROUNDS = 10
KEEPER_JOIN_S = 2.0  # close() waits this long for it (it never waits on anything but a send)
#: seconds a lane request is polled for before the worker is asked over the socket, at least
_LANE_MIN_POLL = 50e-6
#: ... and at most, while the worker's polling flag stays up and this host has a core for every client. The
#: worker's lane poller serves many clients' lanes in turn (kvstrata.server.lane_poller): an answer can take
#: a few of their requests' time, and waking the worker over the socket costs it more than the wait. With a
#: 2 ms bound, 24 clients' 4 KiB sets on the 32-CPU H200 host once fell from 44k to 7.3k ops/s, 40% of them
#: woke the worker: each wake-up took the GIL from the poller, whose slower turns timed out more clients. The
#: bound is for a poller held up by one slow request (an eviction to disk): the others then go to their threads.
_LANE_POLLED_MAX = 20e-3
#: a lane request not answered after this long is checked every _LANE_NAP_S, the GIL released meanwhile. The
#: first turns yield the CPU, which releases the GIL too but retakes it before a woken thread of this process
#: runs, and resets CPython's forced switch for it each time: a thread of the application (the model's) that
#: waits for the GIL would wait for as long as the lane request took (up to _LANE_POLLED_MAX). Beyond the
#: answers of a busy poller (24 clients on the H200 host: p99 0.5-0.6 ms), so it costs them nothing.
_LANE_NAP_AFTER = 1e-3
_LANE_NAP_S = 20e-6

#: how long a worker seen there (its socket not at EOF) is taken as there without looking again, by cached reads
WORKER_SEEN_S = 1e-3
#: how long ``close()`` waits for the worker to have released what the client held (a frozen worker: no longer)
GOODBYE_WAIT_S = 2.0
#: how long ``close()`` waits for a request of another thread to end before it ends the request itself (a ``get``
#: waiting for its key holds the connection as long as it waits: with ``timeout=None``, for ever)
CLOSE_WAIT_S = 0.05


class WorkerConnection:
    """A connection to a worker, and what this process maps of it.

    :class:`~kvstrata.client.remote.RemoteBackend` adds the calls.
    """

    #: seconds a worker may take to answer, beyond the wait a request asks for (a hung worker)
    request_timeout = 120.0

    def __init__(self, address: str, *, timeout: float = 10.0, name: str | None = None) -> None:
        from kvstrata.transport import connect

        hello = {"shm": True, "lane": _lane.supported()}
        if name:
            hello["name"] = name
        self.address = address
        self._conn = connect(address, timeout=timeout, hello=hello)
        self.inline_max = int(self._conn.peer_info.get("inline_max", P.INLINE_MAX))
        #: the worker takes and gives integer columns as bytes (protocol: "columns")
        self.columns = self._conn.peer_info.get("columns") == 1
        self.shm = self._conn.can_pass_fds
        self._segments: dict[int, Any] = {}
        #: segment index -> bytes mapped, of every segment this process maps (what a copy from a placement hint may
        #: read: :meth:`maps`, in one dict for a native lookup)
        self.segment_limits: dict[int, int] = {}
        self._tensors: dict[int, Any] = {}
        # told of segments the worker retired (Registrations.retire: unmaps them once no copy can read them)
        self._on_retired: Any = None
        self._lock = threading.Lock()
        self._deferred: collections.deque[int] = collections.deque()
        self._deferred_aborts: collections.deque[str] = collections.deque()
        self._pid = PID[0]
        self._there_until = 0.0  # the worker was seen there at a moment less than WORKER_SEEN_S before this
        self._readable: Any = None  # a poll object on the connection's socket, made on _worker_there's first call
        self._broken = ""
        self._closed = False
        fds = list(self._conn.handshake_fds)
        self._lane: _lane.Lane | None = None
        at = self._conn.peer_info.get("lane")
        if isinstance(at, int) and 0 < at < len(fds):
            from kvstrata.memory.shm import SharedSegment

            self._lane = _lane.Lane(SharedSegment.attach(fds.pop(at), _lane.LANE_BYTES))
        # Where the worker's objects lie (kvstrata.store.placements): device reads start copies before their leases
        self.placements: PlacementHints | None = None
        at = self._conn.peer_info.get("placements")
        if isinstance(at, int) and 0 < at < len(fds):
            from kvstrata.memory.shm import SharedSegment

            fd = fds.pop(at)
            if self._conn.peer_info.get("placement_buckets") == PLACEMENT_BUCKETS:
                self.placements = PlacementHints(SharedSegment.attach(fd, PLACEMENT_TABLE_BYTES))
            else:  # another kvstrata version's worker
                os.close(fd)
        self._local: LocalReads | None = None
        if "generation_page" in self._conn.peer_info and fds:
            from kvstrata.memory.shm import SharedSegment
            from kvstrata.server.validity import PAGE_BYTES, SLOTS, SLOTS_OFFSET, TABLE_BYTES

            spin_offset = self._conn.peer_info.get("spin_hint")
            if not isinstance(spin_offset, int) or not 0 <= spin_offset <= PAGE_BYTES - 8 or spin_offset % 8:
                spin_offset = None
            if self._conn.peer_info.get("pid") == os.getpid():  # the worker runs on our GIL: never poll
                spin_offset = None
            cache_bytes = self._conn.peer_info.get("cache_bytes")
            page_fd = fds.pop(0)
            info = self._conn.peer_info
            if info.get("slots") != SLOTS_OFFSET or info.get("slot_count") != SLOTS:  # another version's worker
                os.close(page_fd)
                log.warning("worker at %s lays out its local-read table differently: every read asks it", address)
            else:
                self._local = LocalReads(
                    SharedSegment.attach(page_fd, TABLE_BYTES),
                    max_bytes=cache_bytes if isinstance(cache_bytes, int) and cache_bytes >= 0 else MAX_BYTES,
                    spin_offset=spin_offset,
                    slots_offset=SLOTS_OFFSET,
                )
        # The local-read cache's keeper (_keep): gives back what the cache lets go of while no call is made
        self._keeper_stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._calls = 0  # requests prepared: the keeper tells a busy client from an idle one by them
        # Leases shared by the local-read cache and zero-copy views made from its entries: how many
        # of them hold each one. Such a lease goes back to the worker only when the last lets go, so
        # a view's bytes stay pinned even after the cache dropped its entry.
        self._holders: dict[int, int] = {}
        # Kept device reads in flight (RemoteBackend.kept_leases), counted by the pin epoch they began in. While any
        # is, the leases this client lets go of are parked here instead of going back to the worker, so the bytes
        # such a read copies stay pinned by one count per call rather than a hold per key (64 keys: ~8 us of holds
        # and releases on the development machine, before the first copy and after the last). Leases parked in
        # epoch e go back once no read of epoch e or earlier is in flight: reads that keep overlapping (async calls
        # back to back) hold them up only as long as the reads that were already running.
        self._pins: dict[int, int] = {}
        self._pin_epoch = 0
        self._parked: collections.deque[tuple[int, list[int]]] = collections.deque()
        # Pipelined requests (:meth:`send_tagged`): replies read by whoever reads the connection next and
        # kept here by tag until their sender collects them (replies come in request order).
        self._stash: dict[int, dict] = {}
        # Replies are read under _read_lock alone by a thread collecting a pipelined reply, so another thread may
        # send meanwhile (an async call's completion thread waits for its commits' answers while the issuing
        # thread queues the next call's requests). An ordinary request holds _lock from its send to its reply,
        # and _read_lock while it reads: one is outstanding at a time, and a pipelined reader that comes upon its
        # reply first leaves it in _untagged.
        self._read_lock = threading.Lock()
        self._untagged: list[dict] = []
        self._untagged_due = False  # an ordinary request was sent and its reply not read yet
        self._tag = 0
        self._hits_told = 0  # the local-read cache's hits the worker was told of
        self._read_tag = 0  # the tag of the last pipelined reply read off the connection
        self._landing_last = 0  # the tag of the last commit sent ahead of its copies (RemoteBackend.can_land)
        #: a cluster client's: the fingerprint of the member list its writes are routed by now (None: say none), sent
        #: with each routed write (protocol.ROUTED_WRITE_OPS) for the worker to check (Worker.not_owned)
        self.routed_by: Callable[[], int | None] | None = None
        self._absorb_segments(self._conn.peer_info.get("segs", []), fds)
        self._start_keeper()

    # plumbing ----------------------------------------------------------------------------------------
    def request(self, msg: dict) -> dict:
        with self._lock:
            self._prepare(msg)
            spin = self._local.spin() if self._local is not None else 0.0
            lane = self._lane
            if lane is not None and msg["op"] in _lane.LANE_OPS and lane.polling():
                try:
                    payload = pack(msg)
                except InvalidArgument:
                    self._unprepare(msg)
                    raise
                if len(payload) <= _lane.REQUEST_BYTES:
                    reply = self._lane_request(lane, payload, spin)
                    if "err" in reply:
                        raise P.error_from_record(reply["err"])
                    return reply
            self._untagged_due = True
            try:
                self._conn.send(msg)
            except InvalidArgument:  # not encodable (a frame too large...): nothing of it was sent
                self._untagged_due = False
                self._unprepare(msg)
                raise
            try:
                reply = self._untagged_reply(msg, spin)
            except KvstrataError:
                raise  # the connection's own failures mark it (lost, or the worker silent) where they happen
            except BaseException as exc:
                self._abandon(msg, exc)
                raise
        if "err" in reply:
            raise P.error_from_record(reply["err"])
        return reply

    def _abandon(self, msg: dict, exc: BaseException) -> None:
        """A request sent and its reply not read (the wait interrupted: KeyboardInterrupt, a signal handler's
        exception): that reply would answer the next request, so this connection is done (the worker releases
        what this client held when it closes). Call under the lock."""
        self._broken = f"{msg.get('op')!r} was interrupted by {type(exc).__name__} before its reply came"
        self._conn.close()

    def send_tagged(self, msg: dict, *, carry: bool = True) -> int:
        """Send ``msg`` as a pipelined request and return its tag at once; :meth:`tagged_reply` collects
        the reply. Lets a caller keep several requests in flight, so the worker handles one while the
        caller prepares the next (requests still run in the order sent). ``carry=False``: deferred lease
        releases and aborts do not ride along (they would delay this reply; a later message takes them)."""
        with self._lock:
            self._prepare(msg, carry=carry)
            msg["tag"] = tag = self._tag + 1
            try:
                self._conn.send(msg)
            except ConnectionLost as exc:
                self._broken = f"a request could not be sent: {exc}"
                raise
            except InvalidArgument:  # not encodable: nothing of it was sent
                self._unprepare(msg)
                raise
            self._tag = tag
            return tag

    def tagged_reply(self, tag: int, wait: float | None = 0) -> dict:
        """The reply to the pipelined request ``tag`` (raising its error), reading the connection as far
        as needed; ``wait``: the seconds that request asked the worker to wait (None: no limit). Other threads
        may send meanwhile (only the connection's reading is held)."""
        spin = self._local.spin() if self._local is not None else 0.0
        with self._read_lock:
            while tag not in self._stash:
                if self._broken:
                    raise ConnectionLost(f"connection to the worker at {self.address} was lost ({self._broken})")
                # an ordinary request sent before ours may wait on the worker for as long as it asked
                limit = None if self._untagged_due else wait
                reply = self._read_reply({"op": "pipelined request", "timeout": limit}, spin)
                got = reply.get("tag")
                if got is None:
                    if self._untagged_due and not self._untagged:
                        self._untagged.append(reply)  # its sender, waiting for _read_lock, takes it
                        continue
                    self._broken = "an unexpected reply"
                    self._conn.close()
                    raise ProtocolError(f"worker sent a reply nobody asked for while {tag} was awaited")
                self._stash[got] = reply
                self._read_tag = got
            reply = self._stash.pop(tag)
        if "err" in reply:
            raise P.error_from_record(reply["err"])
        return reply

    def _prepare(self, msg: dict, *, carry: bool = True) -> None:
        """Checks before a request is sent, and what rides along with it (call under the lock)."""
        self._calls += 1  # (the keeper leaves a busy client's cache to its calls)
        if self._closed:
            raise ClosedError("client is closed")
        if self._broken:
            raise ConnectionLost(f"connection to the worker at {self.address} was lost ({self._broken}); reconnect")
        if self._pid != PID[0]:
            raise ClosedError("this client was connected in the parent process; connect again after fork()")
        routed_by = self.routed_by
        if routed_by is not None and msg["op"] in P.ROUTED_WRITE_OPS:
            view = routed_by()
            if view is not None:
                msg["view"] = view
        local = self._local
        if local is not None:
            if len(local):
                self._deferred.extend(local.stale())
            if local.hits != self._hits_told:  # the worker's hit count includes the reads it never saw
                msg["lh"] = local.hits - self._hits_told
                self._hits_told = local.hits
        if not carry:
            return
        if self._deferred:
            rel = self._outgoing(self._drain_deferred())
            if rel:
                msg["rel"] = rel
        if self._deferred_aborts:
            msg["abort_keys"] = [self._deferred_aborts.popleft() for _ in range(len(self._deferred_aborts))]

    def _unprepare(self, msg: dict) -> None:
        """Undo :meth:`_prepare` for ``msg``, which could not be encoded (nothing of it was sent): the releases and
        aborts it took go back to their queues for the next request, the hits it told are told again (call under the
        lock). The ids are those left after the holds were counted: none is held any more, so the next drain sends
        them as they are. The keys the client takes are checked beforehand (``kvstrata.client._shared.check_key``):
        this is for whatever gets past that."""
        rel = msg.pop("rel", None)
        if rel:
            self._deferred.extend(rel)
        aborts = msg.pop("abort_keys", None)
        if aborts:
            self._deferred_aborts.extend(aborts)
        told = msg.pop("lh", 0)
        if told:
            self._hits_told -= told

    def _untagged_reply(self, msg: dict, spin: float) -> dict:
        """The reply to the ordinary request ``msg`` just sent (call under the lock). Replies of pipelined
        requests sent before it come first: they are kept for their senders."""
        with self._read_lock:
            while True:
                if self._untagged:  # a pipelined reader read it first
                    self._untagged_due = False
                    return self._untagged.pop()
                reply = self._read_reply(msg, spin)
                tag = reply.get("tag")
                if tag is None:
                    self._untagged_due = False
                    return reply
                self._stash[tag] = reply
                self._read_tag = tag

    def _worker_there(self) -> bool:
        """Whether the worker is still there, as far as this client can tell with no round trip (call under the
        lock): a dead one makes the socket readable at EOF. A socket readable while a pipelined reply is due
        holds that reply; the worker is taken as there (the reply, or the loss, comes to whoever reads it).
        Seen there less than :data:`WORKER_SEEN_S` ago (by this check, or by an answer it sent), it is taken as there
        with no system call: a device call asks stage after stage (~1.4 us per ``select`` on the development machine,
        a few times that cold)."""
        if self._broken or self._conn.closed:
            return False  # lost (a send or a read failed): nothing the cache holds is served any more
        if self._read_tag != self._tag:
            return True
        now = time.monotonic()
        if now < self._there_until:
            return True  # seen there a moment ago (a device call's stages ask one after another)
        if self._readable is None:  # (poll, not select: select cannot take a descriptor numbered 1024 or more)
            self._readable = select.poll()
            self._readable.register(self._conn.fileno(), select.POLLIN)
        if self._readable.poll(0):
            return False
        self._there_until = now + WORKER_SEEN_S
        return True

    def _read_reply(self, msg: dict, spin: float) -> dict:
        """The next reply on the connection, its new segments mapped (call under ``_read_lock``)."""
        try:
            wait = msg.get("timeout", 0)  # None: the worker waits until the key exists, and so do we
            reply, fds = self._conn.recv(timeout=None if wait is None else self.request_timeout + wait, spin=spin)
        except Timeout:
            # The reply may still come and would answer the next request: this connection is done.
            self._broken = "the worker stopped answering"
            self._conn.close()
            raise ConnectionLost(
                f"worker at {self.address} did not answer {msg.get('op')!r} within {self.request_timeout:.3g} s"
            ) from None
        except ConnectionLost as exc:
            if self._closed:  # close() ended the wait (see close): the worker ended the connection for it
                raise ClosedError(f"client is closed (while {msg.get('op')!r} waited for its reply)") from exc
            raise
        self._there_until = time.monotonic() + WORKER_SEEN_S  # it answered: there (see _worker_there)
        if fds or "segs" in reply:
            self._absorb_segments(reply.pop("segs", []), fds)
        if "retired" in reply:
            self._segments_retired(reply.pop("retired"))
        return reply

    def _lane_request(self, lane: _lane.Lane, payload: bytes, spin: float) -> dict:
        """One request through the lane (under the lock): poll for the answer while the worker polls, else
        tell the worker over the socket and wait for its word there (see :mod:`kvstrata.server.lane`)."""
        seq = lane.submit(payload)
        clock, yield_cpu = time.perf_counter, os.sched_yield
        start = clock()
        end = start + (_LANE_POLLED_MAX if spin > 0.0 else _LANE_MIN_POLL)
        naps = start + _LANE_NAP_AFTER
        while not lane.answered(seq):
            now = clock()
            if now >= end or not lane.polling():
                break
            if now >= naps:  # a long wait: let this process's other threads have the GIL (see _LANE_NAP_AFTER)
                time.sleep(_LANE_NAP_S)
            else:
                yield_cpu()
        else:
            self._there_until = time.monotonic() + WORKER_SEEN_S  # it answered: there (see _worker_there)
            return unpack(lane.reply())
        if not lane.answered(seq):  # the worker stopped polling, or is slow: ask it over the socket
            self._untagged_due = True
            try:
                self._conn.send({"op": "lane", "seq": seq})
                reply = self._untagged_reply({"op": "lane"}, 0.0)
            except KvstrataError:
                raise
            except BaseException as exc:
                self._abandon({"op": "lane"}, exc)
                raise
            if "err" in reply:
                raise P.error_from_record(reply["err"])
            if not lane.answered(seq):
                raise ProtocolError(f"worker answered lane request {seq} with {reply.get('seq')!r}")
        return unpack(lane.reply())

    def _drain_deferred(self) -> list[int]:
        """Deferred releases that are due (call under the lock): shared leases only when their last holder lets go."""
        # popleft as many times as there are now, in C (a finalizer may append meanwhile, never lost)
        out = list(map(operator.call, itertools.repeat(self._deferred.popleft, len(self._deferred))))
        return self._unhold(out) if self._holders else out

    def _unhold(self, ids: list[int]) -> list[int]:
        out = []
        holders = self._holders
        for lease_id in ids:
            n = holders.get(lease_id)
            if n is None:
                out.append(lease_id)
            elif n > 1:
                holders[lease_id] = n - 1
            else:
                del holders[lease_id]
                out.append(lease_id)
        return out

    def _hold(self, lease_id: int, n: int = 1) -> None:
        self._holders[lease_id] = self._holders.get(lease_id, 0) + n

    def _pin(self) -> int:
        """Pin every lease this client holds until :meth:`release` gets the returned token back, first in its list
        (call under the lock). The token is negative: never a lease id."""
        epoch = self._pin_epoch
        self._pins[epoch] = self._pins.get(epoch, 0) + 1
        return -1 - epoch

    def _outgoing(self, ids: list[int]) -> list[int]:
        """The leases of ``ids`` that may go back to the worker now: all, or none while a pin is held (they are
        parked until the pins held now are given back). Call under the lock."""
        if not self._pins or not ids:
            return ids
        self._parked.append((self._pin_epoch, ids))
        self._pin_epoch += 1  # pins taken from now on do not hold these up
        return []

    def _unpin(self, token: int) -> list[int]:
        """Give a pin back (:meth:`_pin`'s token); the parked leases no pin holds up any more. Call under the lock."""
        epoch, pins = -1 - token, self._pins
        left = pins[epoch] - 1
        if left:
            pins[epoch] = left
        else:
            del pins[epoch]
        parked, out = self._parked, []
        oldest = min(pins, default=self._pin_epoch + 1)
        while parked and parked[0][0] < oldest:
            out += parked.popleft()[1]
        return out

    def _absorb_segments(self, segs: list, fds: list[int]) -> None:
        from kvstrata.memory.shm import SharedSegment

        if len(segs) != len(fds):
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"worker sent {len(fds)} descriptors for {len(segs)} segments")
        for (index, nbytes), fd in zip(segs, fds):
            if index in self._segments:
                os.close(fd)
            else:
                self._segments[index] = seg = SharedSegment.attach(fd, nbytes)
                self.segment_limits[index] = seg.nbytes

    def watch_retired_segments(self, fn: Any) -> None:
        """Have ``fn(indices, let_go)`` told of the segments the worker retires from now on (``let_go(index)`` unmaps
        one; ``fn`` calls it once nothing copies from it: :meth:`kvstrata.client.device.Registrations.retire`).
        Without ``fn``, a retired segment is unmapped as soon as the worker says so."""
        self._on_retired = fn

    def _segments_retired(self, indices: Any) -> None:
        """The worker retired these segments (emptied, their memory given back: ``kvstrata.store.tiers.memory``) and
        says so with the next reply to a client it sent them to. No copy started from now on reads them (they leave
        the places a placement hint may point to); their mapping and CUDA registration go once none can."""
        if type(indices) is not list or not all(type(i) is int for i in indices):
            # advice about memory, not part of the reply's answer: the call goes on, the segments stay mapped
            log.warning("worker sent retired segments as %.100r: ignored", indices)
            return
        for index in indices:
            self.segment_limits.pop(index, None)
            self._tensors.pop(index, None)
        if self._on_retired is not None:
            self._on_retired(indices, self._let_go)
        else:
            for index in indices:
                self._let_go(index)

    def _let_go(self, index: int) -> None:
        """Unmap retired segment ``index`` (its pages went back to the kernel when the worker retired it)."""
        seg = self._segments.pop(index, None)
        if seg is not None:
            _close_segment(seg)

    def view(self, loc: Any) -> memoryview:
        if loc.size == 0:
            return memoryview(bytearray())
        seg = self._segment(loc.segment)
        return seg.buffer[loc.offset : loc.offset + loc.size]

    def _segment(self, index: int) -> Any:
        seg = self._segments.get(index)
        if seg is None:  # not sent with the reply (too many new segments at once): ask for it
            self.request({"op": "segments", "indices": [index]})
            seg = self._segments.get(index)
            if seg is None:
                raise ProtocolError(f"worker pointed into segment {index}, which it does not have")
        return seg

    def segment_tensor(self, index: int) -> Any:
        t = self._tensors.get(index)
        if t is None:
            t = self._tensors[index] = _segment_tensor(self._segment(index))
        return t

    def segment_address(self, index: int) -> int:
        """Where segment ``index`` is mapped in this process."""
        seg = self._segments.get(index)
        return (seg if seg is not None else self._segment(index)).address

    def segment_nbytes(self, index: int) -> int:
        return self._segment(index).nbytes

    def maps(self, segment: int, offset: int, size: int) -> bool:
        """Whether ``size`` bytes at ``offset`` of segment ``segment`` lie in memory this process has mapped
        (what a copy started from a placement hint may read; never raises)."""
        limit = self.segment_limits.get(segment)  # (a retired segment is in none)
        return limit is not None and offset >= 0 and offset + size <= limit

    def connection_lost(self) -> str:
        """Why the connection to the worker is gone, or "" while it is not: a send or a read found it lost, or it was
        ended here (an interrupted wait, a silent worker, a malformed reply). The worker then released this client's
        leases and aborted its unfinished writes."""
        if self._broken:
            return f"connection to the worker at {self.address} was lost ({self._broken})"
        if self._conn.closed and not self._closed:
            return f"connection to the worker at {self.address} was lost"
        return ""

    def release(self, ids: list[int]) -> None:
        """Give back leases ``ids`` (a kept read's pin token may come first: :meth:`_pin`)."""
        if self._pid != PID[0]:
            # A copy inherited through fork(): the leases and the socket are the parent's (and the lock may be held
            # for good: copied while a thread of the parent, absent here, held it)
            return
        with self._lock:
            if self._closed or self._conn.closed:
                return  # the worker released them when the connection ended
            unpinned = None
            if ids and ids[0] < 0:
                unpinned = self._unpin(ids[0])
                ids = ids[1:]
            local = self._local
            if local is not None and len(local):  # the cache's work left for later, and what it let go of, go too
                local.settle()
                self._deferred.extend(local.dropped())
            if self._deferred:
                self._deferred.extend(ids)
                ids = self._drain_deferred()
            elif self._holders:  # nothing deferred (a device call's end, most often): straight to the holds
                ids = self._unhold(ids)
            ids = self._outgoing(ids)
            if unpinned:
                ids = unpinned + ids
            if ids:
                self._conn.send({"op": "release", "ids": ids})

    def _start_keeper(self) -> None:
        """Start the local-read cache's keeper thread (once the connection is set up; no cache: none)."""
        if self._local is not None and self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="kvstrata-cache-keeper", daemon=True)
            self._keeper.start()

    def _keep(self) -> None:
        """The keeper thread, every :data:`KEEPER_POLL_S`: where the worker asked for the leases caches keep
        (:meth:`LocalReads.reclaim_asked`), give back every one the cache keeps (views the application holds keep
        theirs); else, where the application made no call for :data:`KEEPER_IDLE_ROUNDS` looks and the cache holds
        leases, give back those of stale entries (a key deleted or rewritten since: its old version stays pinned
        until then) and the leases deferred meanwhile. A busy client's calls carry these themselves, with no message
        of their own. The keeper never waits for the connection: a call in progress carries them too."""
        stop, lock = self._keeper_stop, self._lock
        calls, idle = -1, 0
        while not stop.wait(KEEPER_POLL_S):
            local = self._local
            if local is None:
                return
            reclaim = local.reclaim_asked()
            if calls != self._calls:
                calls, idle = self._calls, 0
            else:
                idle += 1
            if not reclaim and (idle < KEEPER_IDLE_ROUNDS or (not len(local) and not self._deferred)):
                continue  # busy (its next call carries what is due), or nothing held
            if not lock.acquire(blocking=False):
                continue
            try:
                if self._closed or self._broken or self._conn.closed or self._pid != PID[0]:
                    return
                self._deferred.extend(local.clear() if reclaim else local.stale())
                if self._deferred:
                    ids = self._outgoing(self._drain_deferred())
                    if ids:
                        self._conn.send({"op": "release", "ids": ids})
            except KvstrataError:
                return  # the connection is gone: the worker released every lease with it
            finally:
                lock.release()

    def defer_release(self, lease_id: int) -> None:
        """From a finalizer: no locks or I/O here, the next request carries it."""
        self._deferred.append(lease_id)

    def defer_abort(self, key: str) -> None:
        """From a finalizer of a buffer dropped unsealed: the next request aborts the write."""
        self._deferred_aborts.append(key)

    @staticmethod
    def _item(item: dict) -> Any:
        return P.error_from_record(item["err"]) if "err" in item else item

    @staticmethod
    def _loc(raw: list) -> Loc:
        return Loc(*raw)

    def _say_goodbye(self) -> None:
        """Tell the worker this client is done and wait for it to have let go of what the client held (call under the
        lock, once ``_closed`` is set)."""
        if not self._conn.closed:
            try:
                self._conn.send(self._bye())
            except KvstrataError:
                pass
            else:
                self._await_end()
        self._conn.close()  # the worker has released our leases and aborted our unfinished writes

    def _bye(self) -> dict:
        bye: dict = {"op": "bye"}
        if self._local is not None and self._local.hits != self._hits_told:
            bye["lh"] = self._local.hits - self._hits_told
        return bye

    def _end_waiting_request(self) -> None:
        """``close()`` while another thread's request holds the lock past :data:`CLOSE_WAIT_S`: most likely a ``get``
        waiting for its key, which with ``timeout=None`` would hold it for ever. The goodbye goes behind that request
        (one-way, a frame of its own), then this side of the connection stops writing: a hang-up, for which the worker
        ends the waiting request with ClosedError (which its thread raises); it then reads the goodbye, lets go of
        everything this client held and ends the connection, as after any goodbye. (A hang-up alone would do, but the
        worker ends such a connection before it lets go: close() would return first.) A worker that has not ended it
        within :data:`GOODBYE_WAIT_S` is cut off (the reads shut down too, which wakes the waiting thread)."""
        self._closed = True  # (from here on, every call is refused)
        deadline = time.monotonic() + GOODBYE_WAIT_S
        try:
            self._conn.send(self._bye())
            with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:  # (a copy: the original stays open)
                sock.shutdown(socket.SHUT_WR)
        except (KvstrataError, OSError):
            self._conn.close()  # lost meanwhile: nothing to wait for
        if not self._lock.acquire(timeout=GOODBYE_WAIT_S):
            self._conn.close()
            self._lock.acquire()  # the request ends at once: its reads fail
        try:
            if not self._conn.closed:  # (the worker's end, after the waiting request's answer: at once, most often)
                self._await_end(deadline - time.monotonic())
            self._conn.close()
        finally:
            self._lock.release()

    def _await_end(self, wait: float | None = None) -> None:
        """After the goodbye: wait (up to ``wait`` seconds, else :data:`GOODBYE_WAIT_S`) for the worker to end the
        connection, which it does once it has let go of everything this client held, so that what ``close()`` gave back
        is back when it returns (another process's write finds the room, a count of leases is exact). Not while another
        thread of this process reads a reply on the connection (a waiting call): that one would lose it."""
        if not self._read_lock.acquire(blocking=False):
            return
        try:
            _drain_until_end(self._conn, GOODBYE_WAIT_S if wait is None else wait)
        finally:
            self._read_lock.release()

    def close(self) -> None:
        self._keeper_stop.set()
        if self._closed:
            return
        if self._pid != PID[0]:
            # A copy inherited through fork(): only this process's handles go; the parent's connection, leases and
            # writes stay as they are (nothing is sent, the socket is not shut down, and the lock is not waited for:
            # it may be held for good, copied while a thread of the parent, absent here, held it)
            self._closed = True
            self._conn.close()
        elif self._lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                if self._closed:
                    return
                self._closed = True
                self._say_goodbye()
            finally:
                self._lock.release()
        else:
            self._end_waiting_request()
        self._tensors.clear()
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        keeper = self._keeper
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(KEEPER_JOIN_S)  # it reads the cache's page with no lock: unmapped only once it is gone
        if self._local is not None and (keeper is None or not keeper.is_alive()):
            self._local.close()
        if self.placements is not None:
            hints, self.placements = self.placements, None
            hints.close(_close_segment)
        self.segment_limits.clear()
        for seg in self._segments.values():
            _close_segment(seg)
        self._segments.clear()


def _drain_until_end(conn: Any, timeout: float) -> None:
    """Read (and drop) what ``conn`` still brings until the peer ends it, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            _, fds = conn.recv(timeout=left)
        except (KvstrataError, OSError):
            return  # the end (ConnectionLost), or the wait ran out (Timeout): either way, done
        for fd in fds:
            os.close(fd)


def _close_segment(seg: Any) -> None:
    try:
        seg.close()
    except BufferError:
        # A view the user still holds pins the mapping; it goes when the last view does.
        log.debug("segment still viewed by the application; unmapped when the last view goes")
