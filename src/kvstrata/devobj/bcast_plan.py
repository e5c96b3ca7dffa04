"""Broadcast planning in the device-object broker: one copying process per GPU.

:class:`BroadcastPlanner` is part of :class:`~kvstrata.devobj.broker.DeviceBroker` (whose state and lock it
uses): it registers a broadcast, and once all its receivers have subscribed plans the chain (leaders
and members per GPU, see :meth:`BroadcastPlanner._plan_broadcast`); it then passes the exports a
leader needs from its predecessor (``chain_ready``) and from its members (``member_ready``). The
copying itself is the receivers' (:mod:`kvstrata.devobj.broadcast`).
"""

from __future__ import annotations

from typing import Any

from kvstrata.devobj._broker_types import E_BAD_REQUEST, E_NOT_FOUND, _err, _Object, _Waiter


class BroadcastPlanner:
    """The broadcast operations of :class:`~kvstrata.devobj.broker.DeviceBroker`, run under its lock; they
    use its tables (``_objects``, ``_transfers``, ``_clients``, waiters) and helpers (``_register``,
    ``_start_transfer``, ``_push``, ``_link_peers_locked``)."""

    def op_broadcast(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        item = args["item"]
        receivers = item.get("receivers")
        if not isinstance(receivers, int) or receivers < 1:
            return {"results": [_err(E_BAD_REQUEST, "receivers must be a positive int")]}
        result = self._register(client, item, "broadcast")
        self.counts["broadcasts"] += 1 if result.get("ok") else 0
        return {"results": [result]}

    def op_chain_ready(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """A broadcast group's leader exported its buffers and progress counter (as it starts copying):
        pass them to the next group's leader, which pulls from it (see :meth:`_plan_broadcast`)."""
        t = self._transfers.get(args["tid"])
        if t is None or t["dst"] != client or t.get("kind") != "bcast":
            return _err(E_NOT_FOUND, f"transfer {args['tid']} is not in flight")
        nxt = self._bcast_peer_locked(t, lambda x: x.get("role") == "leader" and x["group"] == t["group"] + 1)
        if nxt is not None and nxt.get("pred") == "chain":
            self._link_peers_locked(client, nxt["dst"])
            pred = dict(args["export"], client=client)
            self._push(nxt["dst"], {"type": "chain_pred", "tid": nxt["tid"], "key": t["key"], "pred": pred})
        return {"ok": True}

    def op_member_ready(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """A broadcast group's member exported its buffers and progress counter: pass them to its leader,
        which copies every chunk into them. The answer names the leader's pid (a member that is aborted
        waits for its leader to stop writing, or to be gone)."""
        t = self._transfers.get(args["tid"])
        if t is None or t["dst"] != client or t.get("role") != "member":
            return _err(E_NOT_FOUND, f"transfer {args['tid']} is not in flight")
        lead = self._bcast_peer_locked(t, lambda x: x["position"] == t["leader"])
        if lead is None:
            return _err(E_NOT_FOUND, f"the leader of transfer {args['tid']} is gone")
        self._link_peers_locked(client, lead["dst"])
        member = dict(args["export"], client=client, position=t["position"])
        self._push(lead["dst"], {"type": "member_ready", "tid": lead["tid"], "key": t["key"], "member": member})
        return {"ok": True, "leader_pid": self._clients.get(lead["dst"], {}).get("pid")}

    def _bcast_peer_locked(self, t: dict[str, Any], pick) -> dict[str, Any] | None:
        """The transfer of ``t``'s broadcast that ``pick`` selects (None: none, or the object is gone)."""
        obj = self._object_of(t)
        if obj is None:
            return None
        return next((x for x in map(self._transfers.get, obj.transfers) if x is not None and pick(x)), None)

    def _plan_broadcast(self, key: str, obj: _Object, only: int | None) -> dict[str, Any] | None:
        """All receivers are in: one copying process per GPU.

        Receivers are grouped by GPU, the sender's GPU first, then by GPU uuid; by client id within a
        group, not by arrival: the same receivers get the same roles broadcast after broadcast, so a
        leader finds its members' buffers (and its source) already mapped from the last time. (Mapping
        another process's 8 GiB buffer costs tens of milliseconds on first use, three times the copy:
        when arrival order swapped two receivers on the H200 pair, an 8 GiB broadcast took 4.7x one
        peer copy instead of 1.15x.) A group's first receiver is its *leader* (``role``), the others
        its *members*. The leader
        pulls the object chunk by chunk with its own GPU's copy engines and copies each chunk on to its
        members (``members``: how many exports it waits for, see :meth:`op_member_ready`); members
        issue no copies. A leader's source (``pred``) is the sender (``"sender"``) when it is the first
        group's, or when the group before it is on the sender's GPU (the same bytes over the same link,
        and no wait for that leader's export); else the previous group's leader (``"chain"``: it gets
        ``chain_pred``), which then exports to it (``successor``). ``position`` numbers receivers in
        that order.
        """
        rec = obj.record
        src_uuid = (rec.get("device") or {}).get("uuid")
        arrivals = list(obj.pending)
        obj.pending.clear()
        for _, wid in arrivals:
            w = self._waiter_by_id.pop(wid, None)
            if w is not None:
                self._drop_waiter(w)

        by_gpu: dict[str, list[tuple[str, int]]] = {}
        for client, wid in arrivals:
            uuid = (self._clients.get(client, {}).get("device") or {}).get("uuid") or ""
            by_gpu.setdefault(uuid, []).append((client, wid))
        gpus = sorted(by_gpu, key=lambda u: (u != src_uuid, u))
        preds = ["sender" if g == 0 or (g == 1 and gpus[0] == src_uuid) else "chain" for g in range(len(gpus))]
        obj.state = "claimed"
        answer = None
        pos = 0
        for g, uuid in enumerate(gpus):
            group = sorted(by_gpu[uuid], key=lambda cw: cw[0])
            leader = pos
            for i, (client, wid) in enumerate(group):
                extra: dict[str, Any] = {"group": g, "groups": len(gpus), "leader": leader}
                if i == 0:
                    successor = g + 1 < len(gpus) and preds[g + 1] == "chain"
                    extra.update(role="leader", members=len(group) - 1, pred=preds[g], successor=successor)
                else:
                    extra.update(role="member")
                w = _Waiter(wid, client, key, "sub", None, None)
                t = self._start_transfer(obj, w, position=pos, receivers=len(arrivals), **extra)
                pos += 1
                result = {"status": "matched", "wid": wid, "key": key, "transfer": t}
                if wid == only:
                    answer = result
                else:
                    self._push(client, dict(result, type="matched"))
        return answer


__all__ = ["BroadcastPlanner"]
