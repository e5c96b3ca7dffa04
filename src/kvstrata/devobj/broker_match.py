"""The device-object broker's meetings: readers' requests (subscribe, mget) matched with objects, the
waiters of keys not there yet and their deadlines, and the transfers a match starts (and their path).

:class:`Matcher` is part of :class:`~kvstrata.devobj.broker.DeviceBroker` (whose lock and tables it uses;
every method runs under the lock). The common reads answer at once without queueing a waiter
(:meth:`Matcher._read_now`, :meth:`Matcher._claim_now`); a waiter is matched when its object is
registered (:meth:`Matcher._match_locked`), a broadcast's once all its receivers joined
(:mod:`kvstrata.devobj.bcast_plan`). Replies travel lean (:meth:`Matcher._wire`).
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from typing import Any

from kvstrata.devobj._broker_types import E_BAD_REQUEST, E_MISMATCH, E_TIMEOUT, _Object, _Waiter
from kvstrata.devobj.offers import OFFER_MAX_KEYS
from kvstrata.server.protocol import FOREVER_S

log = logging.getLogger(__name__)

#: timed-out receives remembered in case an offer turns out to have reached them (Broker._timed_out)
TIMED_OUT_KEEP = 4096


class Matcher:
    """The meeting methods of :class:`~kvstrata.devobj.broker.DeviceBroker` (run under its lock)."""

    def op_subscribe(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        return self._wire(self._add_waiters(client, args, "sub"), args, "sub")

    def op_mget(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        return self._wire(self._add_waiters(client, args, "get"), args, "get")

    def _wire(self, results: list[dict[str, Any]], args: dict[str, Any], kind: str) -> dict[str, Any]:
        """The reply to a subscribe (``kind`` ``sub``) or mget (``get``). With ``lean`` asked for, each matched
        one-shot or registered transfer travels as ``{"tid", "s", "record" or "obj"}``: its record less
        :data:`SHARED_FIELDS`, which come once per reply in ``shared[s]`` with the path in ``paths[s]``
        (encoding and decoding records was most of a many-key call's cost). The receiver puts back the
        transfer's ``kind`` (its request's), ``path``, ``wid``/``key`` (the result's), ``src``
        (``shared[s]["owner"]``) and ``dst`` (itself), the record its ``key``, ``tensors`` (the specs it
        sent, equal to the record's: it matched) and shared fields; see :func:`kvstrata.devobj.request.widen`."""
        if not args.get("lean") or not args.get("specs"):
            return {"results": results}
        shared: list[dict[str, Any]] = []
        paths: list[str] = []
        index: dict[int, int] = {}
        for r, spec in zip(results, args["specs"]):
            t = r.get("transfer")
            if t is None or t["kind"] != kind or "nccl" in t or spec is None:  # no specs: the record says them
                continue
            obj = self._objects.get(r["key"])
            if obj is None or obj.record["obj"] != (t["obj"] if "obj" in t else t["record"]["obj"]):
                continue
            i = index.get(id(obj.shared))
            if i is None:
                i = index[id(obj.shared)] = len(shared)
                shared.append(obj.shared)
                paths.append(t["path"])
            elif paths[i] != t["path"]:  # one path per (shared fields, receiver): never, but stay whole then
                continue
            if "obj" in t:  # the reader holds the record already (mget "known")
                r["transfer"] = {"tid": t["tid"], "s": i, "obj": t["obj"]}
            else:
                r["transfer"] = {"tid": t["tid"], "s": i, "record": obj.lean}
        return {"results": results, "shared": shared, "paths": paths}

    def _add_waiters(self, client: str, args: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        timeout = args.get("timeout")
        specs = args.get("specs") or [None] * len(args["keys"])
        known = args.get("known") or ()  # per key: the object id whose record the reader already holds
        # Publishers offer only small publishes: a subscribe of many keys is not hinted (it would cost every
        # waiter a table write and its publisher the lookups, for copies that the broker's batch does better).
        offerable = kind == "sub" and len(args["keys"]) <= OFFER_MAX_KEYS
        # (before the loop: nothing here may fail once a key is claimed)
        deadline = None if timeout is None or timeout >= FOREVER_S else self._clock() + max(0.0, float(timeout))
        out = []
        for i, (key, spec) in enumerate(zip(args["keys"], specs, strict=True)):
            obj = self._objects.get(key)
            if obj is not None and obj.state == "ready" and not self._waiters.get(key):
                mode = obj.record["mode"]
                if kind == "get" and mode == "mset":
                    # The common read: no waiter to queue (nothing else can be waiting for a ready mset key).
                    out.append(self._read_now(client, key, obj, spec, known[i] if i < len(known) else None))
                    continue
                if kind == "sub" and mode == "oneshot":
                    # Publisher first, nobody queued ahead: claim it now (no waiter, deadline or timer to undo).
                    out.append(self._claim_now(client, key, obj, spec))
                    continue
            w = _Waiter(next(self._ids), client, key, kind, spec, deadline, offerable)
            self._waiters.setdefault(key, deque()).append(w)
            self._waiter_by_id[w.wid] = w
            if deadline is not None:
                if len(self._deadlines) > 2 * len(self._waiter_by_id) + 64:
                    # Mostly waiters matched or withdrawn before their deadline: keep the heap to the live ones
                    # (amortized: rebuilt once the dead entries outnumber the live ones)
                    live = self._waiter_by_id
                    self._deadlines = [d for d in self._deadlines if d[1] in live]
                    heapq.heapify(self._deadlines)
                heapq.heappush(self._deadlines, (deadline, w.wid))
                if self._parked:
                    self._plan_timer_locked(deadline)
            # Answer at once when the object is there: the common case costs no event round trip.
            immediate = self._match_locked(key, only=w.wid)
            if immediate is None:
                self._hint(key)
            out.append(immediate if immediate is not None else {"status": "waiting", "wid": w.wid})
        return out

    def _read_now(
        self, client: str, key: str, obj: _Object, spec: list[dict[str, Any]] | None, known: int | None
    ) -> dict[str, Any]:
        wid = next(self._ids)
        mismatch = _mismatch(obj.record["tensors"], spec) if spec != obj.record["tensors"] else None
        if mismatch:
            return {"status": "error", "wid": wid, "key": key, "error": E_MISMATCH, "message": f"{key!r}: {mismatch}"}
        t = self._start_transfer(obj, _Waiter(wid, client, key, "get", spec, None))
        if known == obj.record["obj"]:  # the reader holds this record: send only what it lacks
            t = {k: v for k, v in t.items() if k != "record"}
            t["obj"] = obj.record["obj"]
        return {"status": "matched", "wid": wid, "key": key, "transfer": t}

    def _claim_now(self, client: str, key: str, obj: _Object, spec: list[dict[str, Any]] | None) -> dict[str, Any]:
        """A subscribe of a ready one-shot object with no one queued for it: what :meth:`_match_locked` answers
        for a waiter that matched at once, without queueing one."""
        wid = next(self._ids)
        mismatch = _mismatch(obj.record["tensors"], spec) if spec != obj.record["tensors"] else None
        if mismatch:
            return {"status": "error", "wid": wid, "key": key, "error": E_MISMATCH, "message": f"{key!r}: {mismatch}"}
        t = self._start_transfer(obj, _Waiter(wid, client, key, "sub", spec, None))
        obj.state = "claimed"
        return {"status": "matched", "wid": wid, "key": key, "transfer": t}

    def op_cancel(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """Withdraw ``client``'s waiting receives ``wids``; ``withdrawn`` lists those that were still waiting
        (no event will come for them; any other one was matched or timed out, its event on its way)."""
        withdrawn = []
        for wid in args["wids"]:
            w = self._waiter_by_id.get(wid)
            if w is not None and w.client == client:
                self._drop_waiter(w)
                self._leave_broadcast(w)
                withdrawn.append(wid)
        return {"ok": True, "withdrawn": withdrawn}

    def _leave_broadcast(self, w: _Waiter) -> None:
        """A receiver that joined a broadcast's chain (left the queue, counted in ``pending``) and is withdrawn or
        timed out before the chain is planned: the broadcast waits for another one instead."""
        obj = self._objects.get(w.key)
        if obj is not None and obj.record["mode"] == "broadcast":
            obj.pending[:] = [(c, x) for c, x in obj.pending if x != w.wid]

    def _drop_waiter(self, w: _Waiter) -> None:
        self._waiter_by_id.pop(w.wid, None)
        q = self._waiters.get(w.key)
        if q is not None:
            try:
                q.remove(w)
            except ValueError:
                pass
            if not q:
                del self._waiters[w.key]
        self._hint(w.key)

    def _hint(self, key: str) -> None:
        """Keep the offer table's hint for ``key`` true (see :mod:`kvstrata.devobj.offers`): the first waiter's
        receive while it is a subscribe and the key has no object yet, else none."""
        q = self._waiters.get(key)
        head = q[0] if q else None
        if head is not None and head.offerable and key not in self._objects:
            self._offers.put(key, head.wid, head.client)
        else:
            self._offers.clear(key)

    def _expire_locked(self) -> None:
        now = self._clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, wid = heapq.heappop(self._deadlines)
            w = self._waiter_by_id.get(wid)
            if w is None:
                continue
            self._drop_waiter(w)
            self.counts["timeouts"] += 1
            if w.offerable:
                self._timed_out[wid] = None
                if len(self._timed_out) > TIMED_OUT_KEEP:
                    self._timed_out.popitem(last=False)
            self._leave_broadcast(w)
            self._push(
                w.client,
                {
                    "type": "timeout",
                    "wid": wid,
                    "key": w.key,
                    "error": E_TIMEOUT,
                    "message": _timeout_message(w, self._objects.get(w.key)),
                },
            )

    def _match_locked(self, key: str, only: int | None = None) -> dict[str, Any] | None:
        """Pair waiters of ``key`` with its object; return the result for waiter ``only`` if it matched."""
        obj = self._objects.get(key)
        q = self._waiters.get(key)
        if obj is None or not q or obj.state != "ready":
            return None
        mode = obj.record["mode"]
        answer = None
        for w in list(q):
            if obj.state != "ready":
                break
            if (mode == "mset") != (w.kind == "get"):
                continue  # subscribe waits for publish/broadcast, mget for mset
            mismatch = _mismatch(obj.record["tensors"], w.specs)
            if mode == "broadcast" and not mismatch:
                q.remove(w)  # joins the chain; stays known by wid so its timeout still runs
                obj.pending.append((w.client, w.wid))
                if len(obj.pending) < obj.record["receivers"]:
                    continue
                answer = self._plan_broadcast(key, obj, only) or answer
                continue
            self._drop_waiter(w)
            if mismatch:
                message = f"{key!r}: {mismatch}"
                result = {"status": "error", "wid": w.wid, "key": key, "error": E_MISMATCH, "message": message}
            else:
                try:
                    t = self._start_transfer(obj, w)
                except Exception as exc:
                    # A backstop (hello's info is checked, _start_transfer changes nothing before its last step
                    # that can fail): this waiter's receive fails, the object stays for the next one, and the
                    # request that registered it (another client's publish) goes on.
                    log.exception("device objects: matching %r with a receive of %s failed", key, w.client)
                    message = f"{key!r}: the broker could not start this receive ({type(exc).__name__}: {exc})"
                    result = {"status": "error", "wid": w.wid, "key": key, "error": E_BAD_REQUEST, "message": message}
                else:
                    if mode == "oneshot":
                        obj.state = "claimed"
                    result = {"status": "matched", "wid": w.wid, "key": key, "transfer": t}
            if w.wid == only:
                answer = result
            else:
                self._push(w.client, dict(result, type=result["status"]))
        return answer

    def _start_transfer(self, obj: _Object, w: _Waiter, **extra: Any) -> dict[str, Any]:
        rec = obj.record
        # The path first: it reads the clients' infos, the one step here that could fail; nothing has changed yet.
        # It follows from the record's shared fields and the two clients' infos: worked out once per (shared
        # fields, receiver); cleared when a client says hello or goes.
        memo = self._paths.get((id(obj.shared), w.client))
        if memo is None or memo[0] is not obj.shared:
            memo = self._paths[(id(obj.shared), w.client)] = (obj.shared, self._path(rec, w.client))
        t = {
            "tid": next(self._ids),
            "wid": w.wid,
            "key": w.key,
            "kind": "sub" if w.kind == "sub" else "get",
            "src": rec["owner"],
            "dst": w.client,
            "record": rec,
            **extra,
        }
        if rec["mode"] == "broadcast":
            t["kind"] = "bcast"
        obj.transfers.add(t["tid"])
        if w.kind == "get":
            obj.readers.add(w.client)
        self._transfers[t["tid"]] = t
        self._peers.setdefault(rec["owner"], set()).add(w.client)
        self._peers.setdefault(w.client, set()).add(rec["owner"])
        t["path"] = memo[1]
        if t["path"] == "nccl":
            pair = self._pairs.setdefault((rec["owner"], w.client), {"uid": None, "seq": 0, "queued": []})
            t["nccl"] = {"seq": pair["seq"], "create_uid": pair["seq"] == 0}
            pair["seq"] += 1
            if pair["uid"] is None:
                pair.setdefault("queued", []).append(t)
            else:
                self._push(rec["owner"], {"type": "send", "transfer": t, "uid": pair["uid"]})
        return t

    def _path(self, rec: dict[str, Any], dst: str) -> str:
        """How the bytes move: ``local`` (same process), ``nccl`` (forced or across nodes) or ``ipc``."""
        info = self._clients.get(dst, {})
        src = self._clients.get(rec["owner"], {})
        same_node = rec.get("node_id") == info.get("node_id")
        if same_node and src.get("pid") is not None and src.get("pid") == info.get("pid"):
            return "local"  # one process: never through its own IPC handles or an NCCL pair with itself
        visible = info.get("visible")  # GPUs the destination can open IPC memory of (CUDA_VISIBLE_DEVICES)
        hidden = visible is not None and (rec.get("device") or {}).get("uuid") not in visible
        if rec["mode"] != "broadcast" and (rec.get("transport") == "nccl" or not same_node or hidden):
            return "nccl"
        return "ipc"


def _timeout_message(w: _Waiter, obj: _Object | None) -> str:
    """Why a receive timed out, in the caller's terms: nothing came, or what came is read by the other call."""
    if obj is not None and (obj.record["mode"] == "mset") != (w.kind == "get"):
        if w.kind == "get" and obj.record["mode"] == "broadcast":
            return f"device object {w.key!r} is being broadcast: its receivers call dev_subscribe, not dev_mget"
        if w.kind == "get":
            return f"device object {w.key!r} is published for one receiver: dev_subscribe takes it, not dev_mget"
        return f"device object {w.key!r} was registered with dev_mset: dev_mget reads it, not dev_subscribe"
    return f"no device object {w.key!r} within the timeout"


def _mismatch(tensors: list[dict[str, Any]], specs: list[dict[str, Any]] | None) -> str | None:
    if specs is None:
        return None
    if len(specs) != len(tensors):
        return f"tensor_lists: the object has {len(tensors)} tensors, the receiver passed {len(specs)}"
    for i, (have, want) in enumerate(zip(tensors, specs)):
        if list(have["shape"]) != list(want["shape"]) or have["dtype"] != want["dtype"]:
            return (
                f"tensor_lists: tensor {i} is {have['dtype']}{list(have['shape'])} on the source, "
                f"{want['dtype']}{list(want['shape'])} on the receiver"
            )
    return None


__all__ = ["Matcher"]
