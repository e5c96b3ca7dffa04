"""The worker's backend: a :class:`~kvstrata.client.Client` speaking :mod:`kvstrata.server.protocol` to a worker.

It maps the worker's segments from the descriptors it is sent, reads current values straight out of
them through the local-read cache (:mod:`kvstrata.client.local_reads`), sends small requests through
the shared-memory lane (:mod:`kvstrata.server.lane`) and pipelines tagged requests (``send_tagged``).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import threading
import time
from itertools import repeat
from typing import Any

from kvstrata.client.backends import Lease, Loc, _segment_tensor
from kvstrata.client.local_reads import MAX_BYTES, LocalReads
from kvstrata.errors import ClosedError, ConnectionLost, KvstrataError, ProtocolError, Timeout
from kvstrata.server import lane as _lane
from kvstrata.server import protocol as P
from kvstrata.transport.stream import pack, unpack

log = logging.getLogger(__name__)
#: seconds a lane request is polled for before the worker is asked over the socket, at least
_LANE_MIN_POLL = 50e-6
_ONE = 1  # a flag of 1: a mutable object (kvstrata.server.handlers._acquire)

#: builds a NamedTuple from a tuple in C (its generated __new__ is Python: twice the cost over a 64-key reply)
_new = tuple.__new__


def _locs(flat: list[int]) -> Any:
    """The :class:`Loc` of each ``[segment, offset, size]`` of a flat reply list."""
    return map(_new, repeat(Loc), zip(flat[0::3], flat[1::3], flat[2::3]))


class RemoteBackend:
    """A connection to a worker. Requests are serialized on the connection (one at a time)."""

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
        self.shm = self._conn.can_pass_fds
        self._segments: dict[int, Any] = {}
        self._tensors: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._deferred: collections.deque[int] = collections.deque()
        self._deferred_aborts: collections.deque[str] = collections.deque()
        self._pid = os.getpid()
        self._broken = ""
        self._closed = False
        fds = list(self._conn.handshake_fds)
        self._lane: _lane.Lane | None = None
        at = self._conn.peer_info.get("lane")
        if isinstance(at, int) and 0 < at < len(fds):
            from kvstrata.memory.shm import SharedSegment

            self._lane = _lane.Lane(SharedSegment.attach(fds.pop(at), _lane.LANE_BYTES))
        self._local: LocalReads | None = None
        if "generation_page" in self._conn.peer_info and fds:
            from kvstrata.memory.shm import SharedSegment
            from kvstrata.server.validity import PAGE_BYTES, SLOTS_OFFSET, TABLE_BYTES

            spin_offset = self._conn.peer_info.get("spin_hint")
            if not isinstance(spin_offset, int) or not 0 <= spin_offset <= PAGE_BYTES - 8 or spin_offset % 8:
                spin_offset = None
            if self._conn.peer_info.get("pid") == os.getpid():  # the worker runs on our GIL: never poll
                spin_offset = None
            cache_bytes = self._conn.peer_info.get("cache_bytes")
            page_fd = fds.pop(0)
            if self._conn.peer_info.get("slots") != SLOTS_OFFSET:  # another kvstrata version's worker
                os.close(page_fd)
                log.warning("worker at %s lays out its local-read table differently: every read asks it", address)
            else:
                self._local = LocalReads(
                    SharedSegment.attach(page_fd, TABLE_BYTES),
                    max_bytes=cache_bytes if isinstance(cache_bytes, int) and cache_bytes >= 0 else MAX_BYTES,
                    spin_offset=spin_offset,
                    slots_offset=SLOTS_OFFSET,
                )
        # Leases shared by the local-read cache and zero-copy views made from its entries: how many
        # of them hold each one. Such a lease goes back to the worker only when the last lets go, so
        # a view's bytes stay pinned even after the cache dropped its entry.
        self._holders: dict[int, int] = {}
        # Pipelined requests (:meth:`send_tagged`): replies read by whoever reads the connection next and
        # kept here by tag until their sender collects them (replies come in request order).
        self._stash: dict[int, dict] = {}
        self._tag = 0
        self._absorb_segments(self._conn.peer_info.get("segs", []), fds)

    # plumbing ----------------------------------------------------------------------------------------
    def request(self, msg: dict) -> dict:
        with self._lock:
            self._prepare(msg)
            spin = self._local.spin() if self._local is not None else 0.0
            lane = self._lane
            if lane is not None and msg["op"] in _lane.LANE_OPS and lane.polling():
                payload = pack(msg)
                if len(payload) <= _lane.REQUEST_BYTES:
                    reply = self._lane_request(lane, payload, spin)
                    if "err" in reply:
                        raise P.error_from_record(reply["err"])
                    return reply
            self._conn.send(msg)
            reply = self._untagged_reply(msg, spin)
        if "err" in reply:
            raise P.error_from_record(reply["err"])
        return reply

    def send_tagged(self, msg: dict, *, carry: bool = True) -> int:
        """Send ``msg`` as a pipelined request and return its tag at once; :meth:`tagged_reply` collects
        the reply. Lets a caller keep several requests in flight, so the worker handles one while the
        caller prepares the next (requests still run in the order sent). ``carry=False``: deferred lease
        releases and aborts do not ride along (they would delay this reply; a later message takes them)."""
        with self._lock:
            self._prepare(msg, carry=carry)
            self._tag += 1
            msg["tag"] = tag = self._tag
            self._conn.send(msg)
            return tag

    def tagged_reply(self, tag: int, wait: float | None = 0) -> dict:
        """The reply to the pipelined request ``tag`` (raising its error), reading the connection as far
        as needed; ``wait``: the seconds that request asked the worker to wait (None: no limit)."""
        with self._lock:
            spin = self._local.spin() if self._local is not None else 0.0
            while tag not in self._stash:
                if self._broken:
                    raise ConnectionLost(f"connection to the worker at {self.address} was lost ({self._broken})")
                reply = self._read_reply({"op": "pipelined request", "timeout": wait}, spin)
                got = reply.get("tag")
                if got is None:
                    self._broken = "an unexpected reply"
                    self._conn.close()
                    raise ProtocolError(f"worker sent a reply nobody asked for while {tag} was awaited")
                self._stash[got] = reply
            reply = self._stash.pop(tag)
        if "err" in reply:
            raise P.error_from_record(reply["err"])
        return reply

    def _prepare(self, msg: dict, *, carry: bool = True) -> None:
        """Checks before a request is sent, and what rides along with it (call under the lock)."""
        if self._closed:
            raise ClosedError("client is closed")
        if self._broken:
            raise ConnectionLost(f"connection to the worker at {self.address} was lost ({self._broken}); reconnect")
        if self._pid != os.getpid():
            raise ClosedError("this client was connected in the parent process; connect again after fork()")
        if self._local is not None and len(self._local):
            self._deferred.extend(self._local.stale())
        if not carry:
            return
        if self._deferred:
            rel = self._drain_deferred()
            if rel:
                msg["rel"] = rel
        if self._deferred_aborts:
            msg["abort_keys"] = [self._deferred_aborts.popleft() for _ in range(len(self._deferred_aborts))]

    def _untagged_reply(self, msg: dict, spin: float) -> dict:
        """The reply to the ordinary request ``msg`` just sent (call under the lock). Replies of pipelined
        requests sent before it come first: they are kept for their senders."""
        while True:
            reply = self._read_reply(msg, spin)
            tag = reply.get("tag")
            if tag is None:
                return reply
            self._stash[tag] = reply

    def _read_reply(self, msg: dict, spin: float) -> dict:
        """The next reply on the connection, its new segments mapped (call under the lock)."""
        try:
            wait = msg.get("timeout", 0)  # None: the worker waits until the key exists, and so do we
            reply, fds = self._conn.recv(timeout=None if wait is None else self.request_timeout + wait, spin=spin)
        except Timeout:
            # The reply may still come and would answer the next request: this connection is done.
            self._broken = "the worker stopped answering"
            self._conn.close()
            raise ConnectionLost(
                f"worker at {self.address} did not answer {msg.get('op')!r} within {self.request_timeout} s"
            ) from None
        if fds or "segs" in reply:
            self._absorb_segments(reply.pop("segs", []), fds)
        return reply

    def _lane_request(self, lane: _lane.Lane, payload: bytes, spin: float) -> dict:
        """One request through the lane (under the lock): poll for the answer while the worker polls, else
        tell the worker over the socket and wait for its word there (see :mod:`kvstrata.server.lane`)."""
        seq = lane.submit(payload)
        clock, yield_cpu = time.perf_counter, os.sched_yield
        end = clock() + max(spin, _LANE_MIN_POLL)
        while not lane.answered(seq):
            if clock() >= end or not lane.polling():
                self._conn.send({"op": "lane", "seq": seq})
                reply = self._untagged_reply({"op": "lane"}, 0.0)
                if "err" in reply:
                    raise P.error_from_record(reply["err"])
                if not lane.answered(seq):
                    raise ProtocolError(f"worker answered lane request {seq} with {reply.get('seq')!r}")
                break
            yield_cpu()
        return unpack(lane.reply())

    def _drain_deferred(self) -> list[int]:
        """Deferred releases that are due (call under the lock): shared leases only when their last holder lets go."""
        out = []
        while self._deferred:
            out.append(self._deferred.popleft())
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
                self._segments[index] = SharedSegment.attach(fd, nbytes)

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

    def release(self, ids: list[int]) -> None:
        with self._lock:
            if self._closed or self._conn.closed:
                return  # the worker released them when the connection ended
            self._deferred.extend(ids)
            ids = self._drain_deferred()
            if ids:
                self._conn.send({"op": "release", "ids": ids})

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

    # calls ---------------------------------------------------------------------------------------
    def put(self, key: str, data: memoryview, opts: dict) -> None:
        msg = {"op": "put", "key": key, "v": data}
        if opts["ttl"] is not None or opts["nx"] or opts["mode"] != "memory":  # the worker's defaults go unsaid
            msg.update(opts)
        self.request(msg)

    def mput(self, items: list[tuple[str, memoryview]], opts: dict) -> list[Any]:
        reply = self.request({"op": "mput", "items": items, **opts})
        return [self._item(i) for i in reply["items"]]

    def create(self, key: str, size: int, opts: dict) -> Loc:
        return self._loc(self.request({"op": "create", "key": key, "size": size, **opts})["loc"])

    def mcreate(self, items: list[tuple[str, int]], opts: dict) -> list[Any]:
        return self.mcreate_finish(self.mcreate_start(items, opts))

    def mcreate_start(self, items: list[tuple[str, int]], opts: dict) -> Any:
        """:meth:`mcreate`, sent and not waited for (pipelined); :meth:`mcreate_finish` takes its result."""
        msg = {"op": "mcreate", "items": items}
        if opts["ttl"] is not None or opts["nx"] or opts["mode"] != "memory":  # the worker's defaults go unsaid
            msg.update(opts)
        return self.send_tagged(msg)

    def mcreate_finish(self, token: Any) -> list[Any]:
        reply = self.tagged_reply(token)
        flat = reply["locs"]
        out: list[Any] = list(_locs(flat))
        for i, name, message in reply.get("errs", ()):
            out[i] = P.error_from_record((name, message))
        return out

    def finish(self, action: str, key: str) -> None:
        self.request({"op": action, "key": key})

    def mseal(self, keys: list[str]) -> list[Any]:
        return self.mseal_finish(self.mseal_start(keys))

    def mseal_start(self, keys: list[str]) -> Any:
        """:meth:`mseal`, sent and not waited for (pipelined); :meth:`mseal_finish` takes its result."""
        return self.send_tagged({"op": "mseal", "keys": keys}), len(keys)

    def mseal_finish(self, token: Any) -> list[Any]:
        tag, n = token
        out: list[Any] = [None] * n
        for i, name, message in self.tagged_reply(tag).get("errs", ()):
            out[i] = P.error_from_record((name, message))
        return out

    def reserve_start(self, nbytes: int) -> Any:
        """Ask for a write reservation of ``nbytes`` (``kvstrata.store.reservations``), not waited for;
        :meth:`reserve_finish` takes the granted extent."""
        return self.send_tagged({"op": "reserve", "size": nbytes}, carry=False)

    def reserve_finish(self, token: Any) -> Loc:
        return self._loc(self.tagged_reply(token)["loc"])

    def commit_start(self, items: list[tuple[str, int, int]], opts: dict) -> Any:
        """Commit ``(key, size, offset)`` s carved from this client's reservation, not waited for;
        :meth:`commit_finish` gives ``(per-item results, the reservation's head after it or None)``."""
        msg = {"op": "commit", "items": items}
        if opts["ttl"] is not None or opts["nx"] or opts["mode"] != "memory":  # the worker's defaults go unsaid
            msg.update(opts)
        return self.send_tagged(msg), len(items)

    def commit_finish(self, token: Any) -> tuple[list[Any], int | None]:
        tag, n = token
        reply = self.tagged_reply(tag)
        out: list[Any] = [None] * n
        for i, name, message in reply.get("errs", ()):
            out[i] = P.error_from_record((name, message))
        return out, reply.get("head")

    def get(self, key: str, timeout: float) -> bytes:
        local = self._local
        if local is None:
            return self._value(self.request({"op": "get", "key": key, "timeout": timeout}))
        generation = local.generation()  # read before the request: see kvstrata.server.validity
        with self._lock:
            if not self._closed and self._pid == os.getpid():
                loc = local.lookup(key)
                # Still current, and the worker still there (a dead one makes its socket readable at EOF):
                # straight out of shared memory, no round trip.
                if loc is not None and not select.select([self._conn.fileno()], [], [], 0)[0]:
                    return bytes(self._segments[loc.segment].buffer[loc.offset : loc.offset + loc.size])
        reply = self.request({"op": "get", "key": key, "timeout": timeout, "cache": True})
        if not reply.get("cache"):
            return self._value(reply)
        loc = self._loc(reply["loc"])
        data = bytes(self.view(loc))
        with self._lock:
            lease_id = reply["lease"]
            drop = [lease_id] if self._closed else self._cache_add(key, lease_id, loc, generation, reply.get("slot", 0))
        if drop:
            self.release(drop)
        return data

    def _cache_add(self, key: str, lease_id: int, loc: Loc, generation: int, slot: int) -> list[int]:
        """Offer a lease to the local-read cache (under the lock); returns leases the cache let go of."""
        drop = self._local.add(key, lease_id, loc, generation, slot)
        if lease_id not in drop:
            self._hold(lease_id)  # the cache's hold
        return drop

    def mget(self, keys: list[str], timeout: float) -> list[Any]:
        items = self.request({"op": "mget", "keys": keys, "timeout": timeout})["items"]
        return [r if isinstance(r, BaseException) else self._value(r) for r in map(self._item, items)]

    def _value(self, item: dict) -> bytes:
        if "v" in item:
            return item["v"]
        try:
            return bytes(self.view(self._loc(item["loc"])))  # the one copy, straight out of shared memory
        finally:
            self.release([item["lease"]])

    def acquire(self, keys: list[str], timeout: float, *, cache: bool | str = False) -> list[Any]:
        """Leases for zero-copy views. A key the local-read cache holds current needs no round trip:
        the view shares the cache's lease (see ``_holders``), so its bytes stay pinned until released.
        ``cache``: also keep the leases of cacheable objects fetched now, for later calls (``"fit"``:
        only where they fit beside the entries already kept, pushing none out)."""
        return self.acquire_finish(self.acquire_start(keys, timeout, cache=cache))

    def acquire_start(self, keys: list[str], timeout: float, *, cache: bool | str = False, carry: bool = True) -> Any:
        """:meth:`acquire`: the local-read cache's leases now, the worker's requested and not waited for
        (pipelined, ``carry`` as in :meth:`send_tagged`); :meth:`acquire_finish` completes it,
        :meth:`acquire_ready` says whether that needs the worker's answer still."""
        local = self._local
        out: list[Any] = [None] * len(keys)
        generation = 0
        if local is not None:
            generation = local.generation()  # read before the request: see kvstrata.server.validity
            with self._lock:
                usable = len(local) and not self._closed and self._pid == os.getpid()
                if usable and not select.select([self._conn.fileno()], [], [], 0)[0]:  # a dead worker reads EOF
                    holders = self._holders
                    for i, entry in enumerate(local.entries(keys)):
                        if entry is not None:
                            lease_id = entry[0]
                            holders[lease_id] = holders.get(lease_id, 0) + 1  # the view's hold
                            out[i] = Lease(lease_id, entry[1], False)
        if None not in out:
            return keys, out, None, None, generation, cache
        missing = [i for i, lease in enumerate(out) if lease is None]
        msg = {"op": "acquire", "keys": [keys[i] for i in missing], "timeout": timeout}
        if cache and local is not None:
            msg["cache"] = True
        return keys, out, missing, (self.send_tagged(msg, carry=carry), timeout), generation, cache

    @staticmethod
    def acquire_ready(token: Any) -> bool:
        """Whether an :meth:`acquire_start` was served by the local-read cache alone (nothing to wait for)."""
        return token[3] is None

    def acquire_finish(self, token: Any) -> list[Any]:
        keys, out, missing, sent, generation, cache = token
        if sent is None:
            return out
        local = self._local
        reply = self.tagged_reply(*sent)
        ids, flat, flags = reply["ids"], reply["locs"], reply["flags"]
        leases = map(_new, repeat(Lease), zip(ids, _locs(flat), map(_ONE.__eq__, flags)))
        if len(missing) == len(out):
            out[:] = leases
        else:
            for i, lease in zip(missing, leases):
                out[i] = lease
        # 2 + the key's slot: a lease the local-read cache may keep
        offered = [(i, flag - 2) for i, flag in zip(missing, flags) if flag >= 2]
        for j, name, message in reply.get("errs", ()):
            out[missing[j]] = P.error_from_record((name, message))
        drop: list[int] = []
        if offered and local is not None:
            with self._lock:
                if not self._closed:
                    batch = [(keys[i], out[i][0], out[i][1], slot) for i, slot in offered]
                    drop = local.add_many(batch, generation, evict=cache != "fit")
                    # A lease the cache kept has two holders (the cache, the view); one it refused or already
                    # pushed out again is the view's alone (it is released directly, as an unheld lease).
                    kept = {item[1] for item in batch}
                    refused = kept.intersection(drop)
                    if refused:
                        kept -= refused
                        drop = [d for d in drop if d not in refused]
                    holders = self._holders
                    if holders.keys().isdisjoint(kept):  # new leases, as the worker's ids always are
                        holders.update(dict.fromkeys(kept, 2))
                    else:
                        for lease_id in kept:
                            holders[lease_id] = holders.get(lease_id, 0) + 2
        if drop:
            self.release(drop)
        return out

    def read(self, key: str, offset: int, size: int) -> bytes:
        return self.request({"op": "read", "key": key, "offset": offset, "size": size})["v"]

    def keys_op(self, op: str, keys: list[str], **kw: Any) -> list[Any]:
        return self.request({"op": op, "keys": keys, **kw})["r"]

    def refcount(self, key: str) -> int:
        return self.request({"op": "refcount", "key": key})["r"]

    def stats(self) -> dict:
        return self.request({"op": "stats"})["stats"]

    def flush(self) -> None:
        self.request({"op": "flush"})

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._conn.closed and self._pid == os.getpid():
                try:
                    self._conn.send({"op": "bye"})
                except KvstrataError:
                    pass
            self._conn.close()  # the worker releases our leases and aborts our unfinished writes
        self._tensors.clear()
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        if self._local is not None:
            self._local.close()
        for seg in self._segments.values():
            _close_segment(seg)
        self._segments.clear()


def _close_segment(seg: Any) -> None:
    try:
        seg.close()
    except BufferError:
        # A view the user still holds pins the mapping; it goes when the last view does.
        log.debug("segment still viewed by the application; unmapped when the last view goes")
