"""The device-object broker: where publishers, owners and readers of GPU tensors meet.

The broker holds metadata only (shapes, dtypes, exported handles); the bytes never leave GPU memory.
It lives in the worker process (one per node) and is pure Python, thread-safe and deterministic.
This module holds the registry (clients, objects, their lifecycles, the generation page); the rest is in
parts mixed into :class:`DeviceBroker`: :mod:`~kvstrata.devobj.broker_match` (readers' requests,
waiters, matching, transfers), :mod:`~kvstrata.devobj.broker_offers` (publishes whose direct offer a
receive may have taken), :mod:`~kvstrata.devobj.broker_events` (event queues, long and parked
polls, the timer) and :mod:`~kvstrata.devobj.bcast_plan` (broadcast chains). Every request's arguments are
checked whole before it acts (:mod:`~kvstrata.devobj.broker_args`).

Why cycles cannot form
----------------------
Nothing in the broker blocks except :meth:`DeviceBroker.wait_events`, a long poll on the caller's
*own* event queue, taken without holding anything another client needs (a worker parks it instead,
:meth:`DeviceBroker.park_poll`, and the thread that pushes an event answers it). Every other operation
returns at once: a subscriber that comes first registers a *waiter* and later receives a
``matched`` event; a publisher only registers a record. Data then moves by *pull*: the receiver
copies from memory the publisher exported, and reports completion. The publisher never waits on a
subscriber to start, so many pairs in both directions between the same processes cannot deadlock.
(The NCCL path needs the source to post a send; the broker asks for it with a ``send`` event, and
each (source, destination) pair has its own communicator and stream, so sends of A->B and B->A never
queue behind each other.)

Lifecycles
----------
* one-shot (``publish``): ``ready`` -> ``claimed`` by one subscriber -> forgotten when that subscriber
  reports success (``complete(ok=True)``); the publisher then gets ``released`` and drops its tensors.
  A receive that fails (``ok=False``) or whose subscriber dies returns the object to ``ready`` for the
  next subscriber: a half-received object is never done and never lost.
* registered (``mset``): ``ready`` for any number of ``mget`` reads; ``delete`` by the owner stops new
  reads and ``released`` is sent once in-flight reads complete.
* broadcast: like one-shot, for exactly ``receivers`` subscribers, with one copying process per GPU
  (planned in :mod:`kvstrata.devobj.bcast_plan`): per GPU a leader pulls chunk by chunk from its predecessor
  and copies each chunk on to the other receivers of its GPU, which export their buffers and a
  progress counter to it (``member_ready``); a leader that another pulls from exports likewise to
  it (``chain_ready``; see :mod:`kvstrata.devobj.chain`). The plan is made once all receivers have
  subscribed; the broadcast completes for everyone once every position reported ``complete``, and
  any failure or departure aborts every position.
* an owner that goes away (:meth:`owner_gone`) makes its keys vanish; receivers with a transfer in
  flight from it get an ``error`` event (``OwnerGone``), never a hang.

Records and events are plain msgpack-able dicts keyed by client id, so a cluster mode can carry the
same meeting through a metadata service.

Generation page (reads with no round trip)
------------------------------------------
The broker keeps one 64-bit **generation** in a shared page (a memfd the worker hands to clients in
the handshake). It is bumped, under the broker's lock and *before* the reply, whenever a registered
(``mset``) object stops being readable: ``delete`` of it, and its owner going away. A reader that
learned a record while the page said G may copy from it again without asking the broker, as long as
the page still says G *after* its copy has finished (a seqlock, see
``kvstrata.devobj.request.Requester._receive``). This is safe because an owner only writes or frees
registered memory after ``delete`` has answered (write-once objects), i.e. after the bump; a copy
that overlapped such a write or free therefore reads a different generation when it ends, and is
redone through the broker, which answers the truth. An owner that *dies* frees its memory before
the broker knows: the reader also checks, after its copy, that the owner's process still lives.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import operator
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import Any

from kvstrata.devobj._broker_types import (  # noqa: F401 (the error codes are this module's API)
    E_ABORTED,
    E_BAD_REQUEST,
    E_EXISTS,
    E_MISMATCH,
    E_NOT_FOUND,
    E_NOT_OWNER,
    E_OWNER_GONE,
    E_TIMEOUT,
    MODES,
    _err,
    _Object,
    _Waiter,
)
from kvstrata.devobj.bcast_plan import BroadcastPlanner
from kvstrata.devobj.broker_args import check_args
from kvstrata.devobj.broker_events import EventQueues, _deliver
from kvstrata.devobj.broker_match import Matcher
from kvstrata.devobj.broker_offers import OfferReconciler, offered_to
from kvstrata.devobj.offers import TABLE_BYTES, OfferTable, export_id
from kvstrata.errors import InvalidValue

#: record fields shared by every object of one client and mode: sent once per reply, not once per key
#: (see :meth:`DeviceBroker._wire`)
SHARED_FIELDS = ("owner", "mode", "pid", "node_id", "device", "transport")
#: record fields a lean reply leaves out: the result's key, and the tensors' specs the receiver sent (a match
#: means they are equal)
_LEAN_DROP = (*SHARED_FIELDS, "key", "tensors")
_shared_values = operator.itemgetter(*SHARED_FIELDS)
#: what the broker counts (only up): accepted publishes, registrations (``dev_mset``) and broadcasts; objects
#: received (a one-shot by its receive, a broadcast by all); reads of registered objects done; receives timed
#: out; receives that failed or were handed back; offers whose publish came when their receive no longer waited,
#: by whether it had taken them (its client said so: kvstrata.devobj.broker_offers)
COUNTERS = (
    "published",
    "registered",
    "broadcasts",
    "received",
    "reads",
    "timeouts",
    "receives_failed",
    "offer_fates_taken",
    "offer_fates_not_taken",
)


class DeviceBroker(Matcher, OfferReconciler, EventQueues, BroadcastPlanner):
    """Registry of device objects and the meeting point of their readers (thread-safe).

    The worker calls :meth:`handle` for every ``dev.*`` request and :meth:`owner_gone` when a client's
    connection drops. ``wait_events`` blocks (up to its timeout) and should run on a thread of its own;
    a host that can answer a request later parks it instead (:meth:`park_poll`).

    Example::

        broker = DeviceBroker()
        broker.handle("a", "publish", {"items": [record]})
        broker.handle("b", "subscribe", {"keys": ["k"], "timeout": 1.0})  # -> matched at once
    """

    def __init__(self, *, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._objects: dict[str, _Object] = {}
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # see COUNTERS; under the lock
        #: side objects by object id: publishes whose offer a receive may have taken while their key had
        #: another object (see _ask_offer_fate)
        self._side: dict[int, _Object] = {}
        #: offerable receives timed out here, whose waiter may have taken an offer all the same (then it was no
        #: timeout: the count is undone when the offer's fate says so); the latest TIMED_OUT_KEEP only
        self._timed_out: OrderedDict[int, None] = OrderedDict()
        #: deleted objects by object id whose reads in flight have not all completed: out of ``_objects``, so the key
        #: is free for a new registration at once; released to their owner when the last read completes
        self._deleting: dict[int, _Object] = {}
        #: exports taken by receives of clients that left before their publish came (see taken), oldest first
        self._taken_exports: dict[tuple, bool] = {}
        self._waiters: dict[str, deque[_Waiter]] = {}
        self._waiter_by_id: dict[int, _Waiter] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._events: dict[str, deque[dict[str, Any]]] = {}
        self._clients: dict[str, dict[str, Any]] = {}
        self._transfers: dict[int, dict[str, Any]] = {}
        self._pairs: dict[tuple[str, str], dict[str, Any]] = {}
        self._peers: dict[str, set[str]] = {}  # client -> clients it exchanged data with
        self._ids = itertools.count(1)
        # Parked long polls (see park_poll): client -> (deliver, deadline); clients with events to deliver.
        self._parked: dict[str, tuple[Any, float | None]] = {}
        self._due: set[str] = set()
        self._timer: threading.Thread | None = None
        self._timer_cond = threading.Condition(self._lock)
        self._timer_wake: float | None = None  # when the timer thread plans to wake (None: not sleeping)
        # (client, mode) -> (values, dict) of its objects' SHARED_FIELDS (the dict shared by all of them)
        self._shared: dict[tuple[str, str], tuple[tuple, dict[str, Any]]] = {}
        self._paths: dict[tuple[int, str], tuple[dict[str, Any], str]] = {}  # see _start_transfer
        self._gen_fd, self._gen_map, self._gen = _generation_page()
        #: hints of waiting subscribers for publishers' direct offers (kvstrata.devobj.offers), after the page
        self._offers = OfferTable(memoryview(self._gen_map)[mmap.PAGESIZE :])
        weakref.finalize(self, os.close, self._gen_fd)

    @property
    def generation_fd(self) -> int:
        """The memfd of the generation page (8 bytes at offset 0) and the offer table (from the second page on),
        for the worker to hand to clients."""
        return self._gen_fd

    @property
    def generation_counter(self) -> ctypes.c_uint64:
        """The generation itself, for clients in this process (``.value``; one aligned 8-byte load)."""
        return self._gen

    def _bump_locked(self) -> None:
        self._gen.value += 1

    # -- dispatch ---------------------------------------------------------------------------------
    def handle(self, client: str, op: str, args: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Run one request ``op`` from ``client``; the seam the worker and the in-process link use."""
        fn = getattr(self, f"op_{op}", None)
        if fn is None and op != "goodbye":
            raise InvalidValue(f"op: unknown device-object operation {op!r}")
        check_args(op, args)  # whole, before anything changes here
        if op in ("wait_events", "goodbye"):
            self.completed(client, args.get("done"))
        if op == "goodbye" and args.get("taken"):
            self.taken(client, args["taken"])
        if op == "wait_events":
            return fn(client, args, timeout)
        if op == "goodbye":
            self.owner_gone(client)
            return {"ok": True}
        with self._lock:
            self._expire_locked()
            self._completed_locked(client, args.get("done"))
            r = fn(client, args)
            out = self._take_due_locked()
        _deliver(out)  # before the caller replies: a subscriber's match goes out ahead of the publisher's answer
        return r

    def completed(self, client: str, items: list[dict[str, Any]] | None) -> None:
        """Receives ``client`` finished (``complete`` items, ``{"tid", "ok": True}``), carried by any of its
        requests ahead of the request itself; a transfer completed before is skipped (clients repeat
        items until a reply shows they were read)."""
        if not items:
            return
        with self._lock:
            self._completed_locked(client, items)
            out = self._take_due_locked()
        _deliver(out)

    def _completed_locked(self, client: str, items: list[dict[str, Any]] | None) -> None:
        for item in items or ():
            if isinstance(item, dict) and item.get("ok") and item.get("tid") in self._transfers:
                self.op_complete(client, item)

    # -- client lifetime --------------------------------------------------------------------------
    def op_hello(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        self._clients[client] = dict(args.get("info") or {})
        self._paths.clear()
        self._events.setdefault(client, deque())
        return {"ok": True}

    def owner_gone(self, client: str) -> dict[str, int]:
        """Forget ``client`` (its connection dropped or it died): its keys vanish, its peers get errors. Returns
        what went with it, for the log: ``keys`` it owned, ``copies`` failed (from it or into it), ``waits``
        of its receives dropped."""
        with self._lock:
            known = self._clients.pop(client, None) is not None
            keys = sum(1 for o in self._objects.values() if o.record["owner"] == client)
            copies = 0
            for t in self._transfers.values() if known else ():
                src = self._object_of(t)
                copies += t["dst"] == client or (src is not None and src.record["owner"] == client)
            waits = sum(1 for w in self._waiter_by_id.values() if w.client == client)
            self._offers_client_gone_locked(client)
            if any(o.record["owner"] == client and o.record["mode"] == "mset" for o in self._objects.values()):
                self._bump_locked()  # cached readers of its keys stop trusting them (see the module doc)
            for key, obj in list(self._objects.items()):
                if obj.record["owner"] != client:
                    continue
                for tid in list(obj.transfers):
                    t = self._transfers.pop(tid, None)
                    if t is not None:
                        self._push(t["dst"], self._error_event(t, E_OWNER_GONE, f"owner of {key!r} went away"))
                for c, wid in obj.pending:
                    w = self._waiter_by_id.get(wid)
                    if w is not None:  # its receive ends with this error: no timeout to run for it any more
                        self._drop_waiter(w)
                    self._push(
                        c,
                        {
                            "type": "error",
                            "wid": wid,
                            "key": key,
                            "error": E_OWNER_GONE,
                            "message": f"broadcaster of {key!r} went away",
                        },
                    )
                del self._objects[key]
                self._hint(key)
            for oid, obj in list(self._deleting.items()):  # deleted, still read: those reads fail too
                if obj.record["owner"] == client:
                    for tid in obj.transfers:
                        t = self._transfers.pop(tid, None)
                        if t is not None:
                            message = f"owner of {t['key']!r} went away"
                            self._push(t["dst"], self._error_event(t, E_OWNER_GONE, message))
                    del self._deleting[oid]
            for tid, t in list(self._transfers.items()):
                # (one failed link fails its whole broadcast: a later transfer of the list may be gone already)
                if t["dst"] == client and self._transfers.pop(tid, None) is not None:
                    self._receiver_failed_locked(t, f"receiver {client!r} went away")
            for obj in self._objects.values():
                obj.readers.discard(client)
                kept = [(c, w) for c, w in obj.pending if c != client]
                obj.pending[:] = kept
            for w in list(self._waiter_by_id.values()):
                if w.client == client:
                    self._drop_waiter(w)
            for pair in [p for p in self._pairs if client in p]:
                del self._pairs[pair]
            # Peers drop what they imported from it (IPC mappings, NCCL communicators).
            for other in sorted(self._peers.pop(client, set())):
                self._peers.get(other, set()).discard(client)
                self._push(other, {"type": "peer_gone", "client": client})
            for k in [k for k in self._shared if k[0] == client]:
                del self._shared[k]
            self._paths.clear()
            self._events.pop(client, None)
            self._due.discard(client)
            parked = self._parked.pop(client, None)
            out = self._take_due_locked()
            self._cond.notify_all()
        if parked is not None:
            out.append((parked[0], {"events": [], "closed": True}))
        _deliver(out)
        return {"keys": keys, "copies": copies, "waits": waits}

    # -- writers ----------------------------------------------------------------------------------
    def op_publish(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        results = [self._register(client, item, "oneshot") for item in args["items"]]
        self.counts["published"] += sum(1 for r in results if r.get("ok"))
        return {"results": results}

    def op_mset(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        results = [self._register(client, item, "mset") for item in args["items"]]
        self.counts["registered"] += sum(1 for r in results if r.get("ok"))
        return {"results": results}

    def _register(self, client: str, item: dict[str, Any], mode: str) -> dict[str, Any]:
        key = item["key"]
        offered = offered_to(item) if mode == "oneshot" else None
        if key in self._objects and offered is None:
            return _err(E_EXISTS, f"device object {key!r} already exists")
        record = dict(item, owner=client, mode=mode, obj=next(self._ids))
        record.pop("offered", None)
        if "node_id" not in record:
            record["node_id"] = self._clients.get(client, {}).get("node_id")
        try:
            values = _shared_values(record)  # one C call; the dict is built only when the values change
        except KeyError:  # a field missing (a test's record): the slow way
            values = tuple(record.get(f) for f in SHARED_FIELDS)
        known = self._shared.get((client, mode))
        if known is not None and known[0] == values:  # the common case: all of a client's objects share one
            shared = known[1]
        else:
            shared = dict(zip(SHARED_FIELDS, values))
            self._shared[(client, mode)] = (values, shared)
        lean = record.copy()
        for f in _LEAN_DROP:
            lean.pop(f, None)
        if "events" in lean and not lean["events"]:  # none (always, today): nothing to send
            del lean["events"]
        obj = _Object(record, lean, shared)
        if offered is not None and self._taken_exports.pop(export_id(record), None):
            # Taken by a receive whose client left before the broker asked (see taken): received already.
            self.counts["received"] += 1
            self._push(client, {"type": "released", "key": key, "obj": record["obj"], "reason": "received"})
            return {"ok": True, "obj": record["obj"]}
        if offered is not None and (key in self._objects or not self._offer_waits(offered, key)):
            # Its offer went to a receive that no longer waits here (timed out, matched with another object,
            # cancelled), or waits behind the key's other object: that receive may have taken the offer
            # already. Its client decides (op_offer_fate).
            asked = self._ask_offer_fate(key, obj, offered)
            if asked is not None:
                return asked
        if key in self._objects:
            return _err(E_EXISTS, f"device object {key!r} already exists")
        self._objects[key] = obj
        if key in self._waiters:
            # No hint once the key has an object (its publisher read the hint before this). Here too because
            # a broadcast's receivers leave the queue without _drop_waiter, which would clear it.
            self._offers.clear(key)
            self._match_locked(key)
        return {"ok": True, "obj": record["obj"]}

    def op_delete(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        results = []
        for key in args["keys"]:
            obj = self._objects.get(key)
            if obj is None or obj.state == "deleting":
                results.append(_err(E_NOT_FOUND, f"device object {key!r} not found"))
                continue
            if obj.record["owner"] != client:
                results.append(_err(E_NOT_OWNER, f"device object {key!r} belongs to another client"))
                continue
            if obj.record["mode"] == "mset":
                self._bump_locked()  # before the owner hears back, so before it may reuse the memory
            if obj.transfers:  # released once the reads in flight complete; the key is free now
                obj.state = "deleting"
                del self._objects[key]
                self._deleting[obj.record["obj"]] = obj
                self._hint(key)
                results.append({"ok": True, "obj": obj.record["obj"], "pending": True})
            else:  # the owner learns it from this answer, not from an event
                self._forget_locked(key, obj, reason="deleted", notify_owner=False)
                results.append({"ok": True, "obj": obj.record["obj"], "pending": False})
        return {"results": results}

    def op_local_delete(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """This client stops caching imports of ``keys``; the broker stops sending it invalidations."""
        for key in args["keys"]:
            obj = self._objects.get(key)
            if obj is not None:
                obj.readers.discard(client)
        return {"ok": True}

    # -- transfers ending, NCCL pairs, status -----------------------------------------------------
    def op_complete(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """The receiver of transfer ``tid`` reports it finished (``ok``) or failed (``error``)."""
        t = self._transfers.get(args["tid"])
        if t is None or t["dst"] != client:
            return _err(E_NOT_FOUND, f"transfer {args['tid']} is not in flight")
        obj = self._object_of(t)
        if not args.get("ok"):
            self._transfers.pop(t["tid"])
            self._receiver_failed_locked(t, args.get("error") or "receive failed")
            return {"ok": True}
        if t["kind"] == "bcast":
            obj.done.add(t["position"])
            if len(obj.done) == obj.record["receivers"]:
                for tid in list(obj.transfers):
                    tt = self._transfers.pop(tid)
                    self._push(tt["dst"], {"type": "transfer_done", "tid": tid, "key": t["key"], "ok": True})
                obj.transfers.clear()
                self._forget_locked(t["key"], obj, reason="received")
            return {"ok": True, "pending": True}
        self._transfers.pop(t["tid"])
        obj.transfers.discard(t["tid"])
        if t["kind"] == "get":
            self.counts["reads"] += 1
        if t["kind"] == "sub":
            self._forget_locked(t["key"], obj, reason="received")
        elif obj.state == "deleting" and not obj.transfers:
            self._forget_locked(t["key"], obj, reason="deleted")
        return {"ok": True}

    def op_complete_many(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """:meth:`op_complete` for several transfers in one request (one result each)."""
        return {"results": [self.op_complete(client, item) for item in args["items"]]}

    def _link_peers_locked(self, a: str, b: str) -> None:
        """``a`` and ``b`` import each other's memory: each hears ``peer_gone`` when the other goes."""
        if a != b:
            self._peers.setdefault(a, set()).add(b)
            self._peers.setdefault(b, set()).add(a)

    def op_pair_uid(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """The destination of an NCCL pair posts the communicator's unique id; queued sends go out."""
        pair = self._pairs.get((args["src"], client))
        if pair is None:
            return _err(E_NOT_FOUND, "no such NCCL pair")
        pair["uid"] = args["uid"]
        for t in pair.pop("queued", []):
            self._push(t["src"], {"type": "send", "transfer": t, "uid": pair["uid"]})
        return {"ok": True}

    def stats(self) -> dict[str, Any]:
        """What the broker holds now and has counted (:data:`COUNTERS`), for the worker's stats and metrics."""
        with self._lock:
            return {
                "objects": len(self._objects),
                "waiters": len(self._waiter_by_id),
                "transfers": len(self._transfers),
                "clients": len(self._clients),
                "offer_hints": self._offers.hinted,
                "side_objects": len(self._side),
                "deleted_still_read": len(self._deleting),
                **self.counts,
            }

    def snapshot(self) -> dict[str, Any]:
        """Registry contents for status pages and tests (msgpack-able)."""
        with self._lock:
            return {
                "objects": {
                    k: {
                        "state": o.state,
                        "mode": o.record["mode"],
                        "owner": o.record["owner"],
                        "transfers": len(o.transfers),
                    }
                    for k, o in self._objects.items()
                },
                "waiters": sum(len(q) for q in self._waiters.values()),
                "offer_hints": self._offers.hinted,
                "side_objects": len(self._side),
                "transfers": len(self._transfers),
                "clients": sorted(self._clients),
            }

    # -- internals (lock held) --------------------------------------------------------------------
    def _error_event(self, t: dict[str, Any], code: str, message: str) -> dict[str, Any]:
        return {"type": "error", "wid": t["wid"], "tid": t["tid"], "key": t["key"], "error": code, "message": message}

    def _object_of(self, t: dict[str, Any]) -> _Object | None:
        """The object transfer ``t`` reads: its key's, or a deleted one still read (the key may have a new one)."""
        oid = t["record"]["obj"]
        obj = self._objects.get(t["key"])
        return obj if obj is not None and obj.record["obj"] == oid else self._deleting.get(oid)

    def _drop_locked(self, key: str, obj: _Object) -> None:
        """Take ``obj`` out of the registry: from under its key, or from the deleted objects still read."""
        if self._objects.get(key) is obj:
            del self._objects[key]
        else:
            self._deleting.pop(obj.record["obj"], None)

    def _forget_locked(self, key: str, obj: _Object, *, reason: str, notify_owner: bool = True) -> None:
        self._drop_locked(key, obj)
        if reason == "received":
            self.counts["received"] += 1
        self._hint(key)  # a subscriber still waiting for the key can be offered the next object
        if notify_owner:
            released = {"type": "released", "key": key, "obj": obj.record["obj"], "reason": reason}
            self._push(obj.record["owner"], released)
        for reader in obj.readers:
            self._push(reader, {"type": "invalidate", "key": key, "obj": obj.record["obj"]})
        for client, wid in obj.pending:  # broadcast receivers still waiting for the others
            w = self._waiter_by_id.get(wid)
            if w is not None:
                self._drop_waiter(w)
            self._push(
                client,
                {
                    "type": "error",
                    "wid": wid,
                    "key": key,
                    "error": E_NOT_FOUND,
                    "message": f"device object {key!r} was {reason} before all receivers joined",
                },
            )
        obj.pending.clear()

    def op_nccl_failed(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """Either end of NCCL transfer ``tid`` could not take part (the sender's object was released first): it
        fails, and its pair is reset (see :meth:`_reset_pair_locked`)."""
        t = self._transfers.get(args["tid"])
        if t is None or t.get("path") != "nccl" or client not in (t["src"], t["dst"]):
            return _err(E_NOT_FOUND, f"NCCL transfer {args['tid']} is not in flight")
        self._transfers.pop(t["tid"])
        self._receiver_failed_locked(t, args.get("error") or "NCCL transfer failed")
        return {"ok": True}

    def _reset_pair_locked(self, src: str, dst: str, message: str) -> None:
        """An NCCL transfer between ``src`` and ``dst`` failed: its sequence number will never run at one end,
        and both ends run a pair's transfers strictly in order, so the pair is done for. Its other transfers fail
        (their objects go back to be received again) and both ends drop their channel (``pair_reset``, which
        breaks a send or receive left waiting); the pair's next transfer starts a new one, with a new unique id."""
        if self._pairs.pop((src, dst), None) is None:
            return
        pair = [t for t in self._transfers.values() if t.get("path") == "nccl" and (t["src"], t["dst"]) == (src, dst)]
        for t in pair:
            self._transfers.pop(t["tid"])
            self._receiver_failed_locked(t, f"an earlier transfer between the same processes failed: {message}")
        for c in (src, dst):
            self._push(c, {"type": "pair_reset", "src": src, "dst": dst})

    def _receiver_failed_locked(self, t: dict[str, Any], message: str) -> None:
        self.counts["receives_failed"] += 1
        obj = self._object_of(t)
        self._push(t["dst"], self._error_event(t, E_ABORTED, message))
        if t.get("path") == "nccl":
            self._reset_pair_locked(t["src"], t["dst"], message)
        if obj is None:
            return
        obj.transfers.discard(t["tid"])
        if t["kind"] == "sub" and obj.state == "deleting":
            self._forget_locked(t["key"], obj, reason="deleted")
        elif t["kind"] == "sub":
            obj.state = "ready"  # never half-done: the next subscriber gets it whole
            self._match_locked(t["key"])
        elif t["kind"] == "bcast":
            # One broken link breaks the chain after it: abort all, tell the broadcaster.
            for tid in list(obj.transfers):
                tt = self._transfers.pop(tid)
                self._push(tt["dst"], self._error_event(tt, E_ABORTED, f"broadcast of {t['key']!r} failed: {message}"))
            self._drop_locked(t["key"], obj)
            self._push(
                obj.record["owner"], {"type": "failed", "key": t["key"], "obj": obj.record["obj"], "message": message}
            )
        elif obj.state == "deleting" and not obj.transfers:
            self._forget_locked(t["key"], obj, reason="deleted")


def _generation_page() -> tuple[int, mmap.mmap, ctypes.c_uint64]:
    """A memfd holding the generation (8 bytes at offset 0; starts at 1, 0 never means "valid") in its first
    page, and the offer table (:class:`~kvstrata.devobj.offers.OfferTable`) from its second page on."""
    fd = os.memfd_create("kvstrata-devobj-generation", os.MFD_CLOEXEC)
    size = mmap.PAGESIZE + TABLE_BYTES
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    gen = ctypes.c_uint64.from_buffer(mm)  # one aligned 8-byte store/load: never torn
    gen.value = 1
    return fd, mm, gen


__all__ = ["MODES", "DeviceBroker"]
