"""Where device objects plug into the worker and the client SDK.

Worker side (three lines in :mod:`kvstrata.server.worker`): the ``dev`` request is routed to
:func:`handle`, and :func:`session_closed` runs when a connection ends, so a client that dies makes
its keys vanish and its peers get errors. Each worker hosts one :class:`DeviceBroker`.

Client side: :class:`WorkerBrokerLink` speaks ``{"op": "dev", "dop": op, "cid": id, "a": args}`` to the
worker over two connections of its own (requests, and the long poll of events, so a poll never delays
a request). The worker parks a poll in the broker instead of blocking a thread on it: the thread that
pushes the client's next event (e.g. the publisher's request thread, for a match) sends it at once,
before its own reply, so no worker thread wakes up to carry an event; it never waits on the client's
socket for that (:mod:`kvstrata.devobj.outbox`: a client that stops reading stalls no other client's
thread). ``"ow": true`` marks a one-way request (no reply; finished receives sent by a client's copy
threads). :class:`DeviceObjectsMixin` gives :class:`kvstrata.client.Client` its ``dev_*`` methods,
started on first use (embedded clients share one in-process broker).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvstrata import errors
from kvstrata._proc import PID
from kvstrata.devobj.broker import DeviceBroker
from kvstrata.devobj.broker_args import check_args, check_seconds
from kvstrata.devobj.debug import trace
from kvstrata.devobj.futures import spin_seconds
from kvstrata.devobj.offers import TABLE_BYTES, OfferTable
from kvstrata.devobj.outbox import Outbox
from kvstrata.errors import ClosedError, InvalidType, InvalidValue

if TYPE_CHECKING:  # the worker imports this module; torch loads only when a client uses devices
    from kvstrata.devobj.api import DeviceObjects
    from kvstrata.devobj.link import DeviceObjectConfig

log = logging.getLogger(__name__)
_lock = threading.Lock()  # brokers of this process (never held while calling out)
_client_lock = threading.Lock()  # starting a client's DeviceObjects (may call into an in-process worker)
_embedded: DeviceBroker | None = None


# -- worker side ----------------------------------------------------------------------------------
def broker_of(worker: Any) -> DeviceBroker:
    """The worker's broker (created on first use)."""
    with _lock:
        broker = getattr(worker, "devobj_broker", None)
        if broker is None:
            broker = worker.devobj_broker = DeviceBroker()
        return broker


#: what :func:`handle` returns when the worker must not reply now: a parked poll (answered later by
#: the thread that pushes the client's next event) or a one-way request (``"ow": true``, no reply at all)
DEFERRED: dict = {}


def handle(session: Any, msg: dict) -> dict:
    """Worker handler for ``{"op": "dev", "dop": op, "cid": client id, "a": args, "t": timeout, "ow": one-way}``.

    ``wait_events`` is parked in the broker (the session's thread goes back to reading its connection;
    see :meth:`DeviceBroker.park_poll`); a one-way request gets no reply, its errors are logged.
    """
    if msg.get("ow"):
        try:
            _handle(session, msg)
        except Exception as exc:  # nobody waits for an answer: a reply would desynchronize the client
            log.warning("device objects: one-way %r request failed: %s: %s", msg.get("dop"), type(exc).__name__, exc)
        return DEFERRED
    if msg.get("dop") == "wait_events" and isinstance(msg.get("cid"), str):
        cids = session.__dict__.setdefault("devobj_clients", set())
        cids.add(msg["cid"])
        tag = msg.get("tag")  # a parked poll's answer carries its request's tag too, as every reply does
        outbox = session.__dict__.get("devobj_outbox")
        if outbox is None:
            outbox = session.devobj_outbox = Outbox(session.conn, getattr(session, "name", msg["cid"]))

        def deliver(r: dict) -> None:
            # Often on another client's thread (the publisher's, the timer's): never blocks on this client's socket
            try:
                outbox.send({"r": r} if tag is None else {"r": r, "tag": tag})
            except Exception as exc:  # the client went away meanwhile: its session cleanup forgets it
                log.debug("device objects: event delivery to %s failed: %s", msg["cid"], exc)

        broker = broker_of(session.worker)
        args = msg.get("a")
        if args is not None:
            check_args("wait_events", args)
        wait = check_seconds(msg.get("t"), "t")  # FOREVER_S or more: None (no deadline past the clock's range)
        if args is not None and args.get("done"):
            broker.completed(msg["cid"], args["done"])
        r = broker.park_poll(msg["cid"], wait, deliver)
        if r is not None and outbox.busy:  # earlier answers still wait to go out: this one goes after them
            deliver(r)
            return DEFERRED
        return DEFERRED if r is None else {"r": r}
    return _handle(session, msg)


def _handle(session: Any, msg: dict) -> dict:
    cid, op = msg.get("cid"), msg.get("dop")
    if not isinstance(cid, str) or not cid:
        raise InvalidValue("cid: a device-object client id (str) is required")
    if not isinstance(op, str):
        raise InvalidValue("dop: a device-object operation name (str) is required")
    cids = session.__dict__.setdefault("devobj_clients", set())
    if cid not in cids:
        cids.add(cid)
    args = msg.get("a") or {}
    if not isinstance(args, dict):
        raise InvalidType("a: the operation's arguments must be a map")
    trace(f"worker: {op} read")
    r = broker_of(session.worker).handle(cid, op, args, msg.get("t"))
    if op != "wait_events" and log.isEnabledFor(logging.DEBUG):
        log.debug("broker: %s %s -> %.300r", cid, op, r)
    return {"r": r}


def session_closed(session: Any) -> list[str]:
    """A connection ended: every device-object client that used it is gone. Returns what went with them, for the
    worker's log line (empty when nothing did)."""
    cids = session.__dict__.get("devobj_clients")
    if not cids:
        return []
    broker = broker_of(session.worker)
    gone = {"keys": 0, "copies": 0, "waits": 0}
    for cid in list(cids):
        for what, n in broker.owner_gone(cid).items():
            gone[what] += n
    cids.clear()
    said = {  # what: (one, many)
        "keys": ("device-object key vanished", "device-object keys vanished"),
        "copies": ("device-object copy failed", "device-object copies failed"),
        "waits": ("receive dropped", "receives dropped"),
    }
    return [f"{n} {said[what][n != 1]}" for what, n in gone.items() if n]


# -- client side ----------------------------------------------------------------------------------
#: CPUs this process may run on at or above which a request polls for its reply before sleeping
SPIN_MIN_CPUS = 8
#: how long it polls (microseconds): a thread woken from a blocking read on an idle many-core host costs
#: tens of microseconds, a device-object round trip ~100; KVSTRATA_DEVOBJ_SPIN_US overrides (0: never)
SPIN_US = 200.0


def reply_spin_seconds() -> float:
    """Seconds a request of this process polls for its reply (see :data:`SPIN_US`).

    Only where the CPUs are many: a polling thread holds a core, and, between its polls (each one a
    system call that lets the GIL go), the GIL other threads of the process may need; on a small or
    shared machine (this one's peer, the worker, may need that core) the reply is waited for asleep.
    """
    return spin_seconds("KVSTRATA_DEVOBJ_SPIN_US", SPIN_US, min_cpus=SPIN_MIN_CPUS)


def event_spin_seconds() -> float:
    """Seconds the event thread's long poll busy-polls for the worker's answer before sleeping:
    ``KVSTRATA_DEVOBJ_EVENT_SPIN_US`` (default 0: it sleeps at once).

    An experiment knob for the hand-off latency: a subscriber's event thread asleep in its poll wakes
    ~20-40 us after the worker pushed the match (H200 host traces). Spinning holds a core and, between
    polls, competes for the GIL with the process's other threads (in the worker, polling four connections
    made the 4 KiB hand-off slower, see ``Worker._update_spin``), hence off unless asked for.
    """
    return spin_seconds("KVSTRATA_DEVOBJ_EVENT_SPIN_US", 0.0, min_cpus=None)


class WorkerBrokerLink:
    """A :class:`~kvstrata.devobj.api.BrokerLink` to a worker's broker."""

    def __init__(self, address: str, *, timeout: float = 10.0, client_id: str | None = None) -> None:
        from kvstrata.transport import connect

        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # (a link's connections count with their process's client, not as clients of their own: Session.devobj_link)
        hello = {"shm": False, "name": f"devobj {self.client_id}", "devobj_link": True}
        self._conns = [connect(address, timeout=timeout, hello=dict(hello, devobj_generation=i == 0)) for i in range(2)]
        self._locks = [threading.Lock(), threading.Lock()]
        #: seconds a request (never the long poll of events) polls for its reply before sleeping
        self.spin = reply_spin_seconds()
        #: seconds the long poll of events polls for its answer before sleeping (see event_spin_seconds)
        self.event_spin = event_spin_seconds()
        #: called after a long poll of events was sent, before waiting for its answer (set by the client: it
        #: lets the threads its event thread just woke take the GIL while this one waits without it)
        self.on_poll_sent: Any = None
        #: the broker's generation (``.value``), mapped from the page the worker sent; None where it sent none
        self.generation_counter: ctypes.c_uint64 | None = None
        #: the broker's hints of waiting subscribers (kvstrata.devobj.offers); None where the worker sent none
        self.offer_table: OfferTable | None = None
        self._page: mmap.mmap | None = None
        self._table_map: mmap.mmap | None = None
        conn = self._conns[0]
        at = conn.peer_info.get("devobj_generation")
        fds = list(getattr(conn, "handshake_fds", ()) or ())
        if isinstance(at, int) and 0 <= at < len(fds):
            try:
                # Unmapped by close() once nothing reads it (mmap.close() refuses while a view exports it).
                self._page = mmap.mmap(fds[at], mmap.PAGESIZE, flags=mmap.MAP_SHARED)
                self.generation_counter = ctypes.c_uint64.from_buffer(self._page)
            except (OSError, ValueError) as exc:
                log.info("device objects: no generation page (%s); every read asks the worker", exc)
            try:
                if os.fstat(fds[at]).st_size >= mmap.PAGESIZE + TABLE_BYTES:  # read-only here: the broker writes
                    self._table_map = mmap.mmap(
                        fds[at], TABLE_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=mmap.PAGESIZE
                    )
                    self.offer_table = OfferTable(self._table_map)
            except (OSError, ValueError) as exc:
                log.info("device objects: no offer table (%s); publishers send no offers", exc)
        for fd in fds:
            os.close(fd)

    def notify(self, op: str, args: dict[str, Any]) -> None:
        """A one-way request (no reply, no wait): after every request sent before it, before every later
        one (one connection, one worker thread, in order). Errors are the worker's to log."""
        msg = {"op": "dev", "dop": op, "cid": self.client_id, "a": args, "ow": True}
        self._conns[0].send(msg)  # frames are whole (the connection's send lock); a reply-less frame may
        # go out while another thread waits for its reply on this connection

    def call(self, op: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Request ``op`` and wait for its reply."""
        i = 1 if op == "wait_events" else 0
        msg = {"op": "dev", "dop": op, "cid": self.client_id, "a": args}
        if op == "wait_events":
            msg["t"] = args.get("timeout")
        with self._locks[i]:
            conn = self._conns[i]
            conn.send(msg)
            if i == 1 and self.on_poll_sent is not None:
                try:
                    self.on_poll_sent()
                except Exception:  # a hook's failure must not lose the poll's answer
                    log.exception("device objects: on_poll_sent hook failed")
            try:
                reply, _ = conn.recv(timeout, spin=self.spin if i == 0 else self.event_spin)
            except errors.Timeout:
                # The late reply would answer the next call: this connection is out of step for good.
                conn.close()
                raise errors.ConnectionLost(f"device objects: no reply to {op!r} within {timeout:.3g} s") from None
            except BaseException:  # interrupted (Ctrl-C, a signal handler's exception): out of step the same way
                conn.close()
                raise
        if "err" in reply:
            from kvstrata.server import protocol as P

            raise P.error_from_record(reply["err"])
        return reply["r"]

    # The event connection read by whichever thread of the client holds its poll role (leader/follower,
    # kvstrata.devobj.lead): one poll out at a time, each answered by exactly one frame.
    def poll_fileno(self) -> int | None:
        """The event connection's descriptor, to wait on; None where it has none (the client then polls
        through :meth:`call`)."""
        from kvstrata.transport.stream import StreamConnection

        conn = self._conns[1]
        return conn.fileno() if isinstance(conn, StreamConnection) else None

    def poll_buffered(self) -> bool:
        """Whether the event connection holds bytes read from its socket already (a read cut short)."""
        buffered = getattr(self._conns[1], "buffered", None)
        return bool(buffered()) if buffered is not None else False

    def send_poll(self, args: dict[str, Any]) -> None:
        """Send a long poll of events (``args["timeout"]`` seconds); its answer comes through :meth:`recv_poll`."""
        self._conns[1].send({"op": "dev", "dop": "wait_events", "cid": self.client_id, "a": args, "t": args["timeout"]})

    def recv_poll(self) -> dict[str, Any]:
        """The answer to the poll sent (call once the descriptor is readable: it blocks until it is whole)."""
        reply, _ = self._conns[1].recv(None)
        if "err" in reply:
            from kvstrata.server import protocol as P

            raise P.error_from_record(reply["err"])
        return reply["r"]

    def close(self) -> None:
        """Close the connections and unmap the generation page and offer table (closing their descriptors).

        A map that a reader still holds a view of (a client not closed yet: its ``generation_counter`` or
        ``offer_table``) stays mapped until that view goes: ``mmap.close()`` refuses (BufferError) while the
        buffer is exported, so nothing is unmapped under a reader.
        """
        for conn in self._conns:
            conn.close()
        self.generation_counter = None
        self.offer_table = None
        for name in ("_page", "_table_map"):
            m = getattr(self, name)
            if m is None:
                continue
            try:
                m.close()
            except BufferError:  # still exported by a reader: freed with it
                continue
            setattr(self, name, None)


def embedded_broker() -> DeviceBroker:
    """The broker shared by embedded clients of this process."""
    global _embedded
    with _lock:
        if _embedded is None:
            _embedded = DeviceBroker()
        return _embedded


class DeviceObjectsMixin:
    """``dev_*`` methods for :class:`kvstrata.client.Client` (needs ``self._backend`` with ``address``)."""

    _devobj: DeviceObjects | None = None
    _devobj_link: Any = None

    def device_objects(self, *, device: Any = None, config: DeviceObjectConfig | None = None) -> DeviceObjects:
        """The client's :class:`DeviceObjects` (started on first call; ``device``/``config`` apply then)."""
        from kvstrata.devobj.api import DeviceObjects
        from kvstrata.devobj.link import InprocBrokerLink

        with _client_lock:
            if getattr(self, "_closed", False):
                raise ClosedError("client is closed: device objects need an open one")
            if getattr(self, "_pid", PID[0]) != PID[0]:
                raise ClosedError("this client was connected before fork(): connect again in this process")
            if self._devobj is None:
                backend = self._backend  # type: ignore[attr-defined]
                if getattr(backend, "address", "embedded") == "embedded":
                    link: Any = InprocBrokerLink(embedded_broker())
                else:
                    link = WorkerBrokerLink(backend.address)
                try:
                    self._devobj = DeviceObjects(link, device=device, config=config)
                except BaseException:
                    if hasattr(link, "close"):
                        link.close()
                    raise
                self._devobj_link = link
            elif (config is not None and config != self._devobj.config) or (
                device is not None and self._devobj._pick_device(device) != self._devobj.device
            ):
                raise InvalidValue("device/config: this client's device objects already started with other settings")
            return self._devobj

    def _devobjs(self) -> DeviceObjects:
        """The started :class:`DeviceObjects`, without the lock once it is there (the 4 KiB hand-off's path)."""
        devobj = self._devobj
        return devobj if devobj is not None else self.device_objects()

    def dev_publish(self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]]) -> list[Future]:
        """See :meth:`DeviceObjects.dev_publish`."""
        return self._devobjs().dev_publish(keys, tensor_lists)

    def dev_subscribe(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], timeout: float | None = None
    ) -> list[Future]:
        """See :meth:`DeviceObjects.dev_subscribe`."""
        return self._devobjs().dev_subscribe(keys, tensor_lists, timeout)

    def dev_mset(self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]]) -> list[Exception | None]:
        """See :meth:`DeviceObjects.dev_mset`."""
        return self._devobjs().dev_mset(keys, tensor_lists)

    def dev_mget(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], timeout: float | None = None
    ) -> list[Future]:
        """See :meth:`DeviceObjects.dev_mget`."""
        return self._devobjs().dev_mget(keys, tensor_lists, timeout)

    def dev_broadcast(
        self, key: str, tensor_list: Sequence[Any], receivers: int, chunk_bytes: int | None = None
    ) -> Future:
        """See :meth:`DeviceObjects.dev_broadcast`."""
        return self._devobjs().dev_broadcast(key, tensor_list, receivers, chunk_bytes)

    def dev_delete(self, keys: Sequence[str]) -> list[Exception | None]:
        """See :meth:`DeviceObjects.dev_delete`."""
        return self._devobjs().dev_delete(keys)

    def dev_local_delete(self, keys: Sequence[str]) -> None:
        """See :meth:`DeviceObjects.dev_local_delete`."""
        return self._devobjs().dev_local_delete(keys)

    def _close_device_objects(self) -> None:
        devobj, link = self._devobj, self._devobj_link
        self._devobj = self._devobj_link = None
        if devobj is not None:
            devobj.close()
        if link is not None and hasattr(link, "close"):
            link.close()


__all__ = ["DeviceObjectsMixin", "WorkerBrokerLink", "broker_of", "embedded_broker", "handle", "session_closed"]
