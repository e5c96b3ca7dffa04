"""The device-object broker's side of direct offers (:mod:`kvstrata.devobj.offers`): publishes whose offer a
receive may have taken without the broker.

A publish says whom its offer went to (``offered``: a client and receive id). Where that receive still waits first
in line and the key has no object, the broker matches the two as usual (the match confirms what the receive
took). Otherwise the receive may have taken the offer already, and only its client knows:
:meth:`OfferReconciler._ask_offer_fate` holds the object (under its key in state ``offered``, or aside as a *side
object* where the key has another object) and asks; :meth:`OfferReconciler.op_offer_fate` settles it (received, or
back for the next receive); a client that leaves settles what it took (:meth:`OfferReconciler.taken`, from its
goodbye) and is taken to have taken nothing else.

:class:`OfferReconciler` is part of :class:`~kvstrata.devobj.broker.DeviceBroker` (whose lock and tables it uses;
every method but :meth:`~OfferReconciler.taken` runs under the lock).
"""

from __future__ import annotations

from typing import Any

from kvstrata.devobj._broker_types import E_BAD_REQUEST, E_NOT_OWNER, _err, _Object
from kvstrata.devobj.broker_events import _deliver
from kvstrata.devobj.offers import export_id

#: exports the broker keeps as taken by receives of clients that left, for publishes yet to come
TAKEN_KEEP = 4096


class OfferReconciler:
    """The offer methods of :class:`~kvstrata.devobj.broker.DeviceBroker`."""

    def taken(self, client: str, items: list[Any]) -> None:
        """Receives of ``client`` that took offers whose match it has not confirmed (it is leaving): each
        ``[wid, key, [owner, pid, local]]``. The object each took is received, whatever state it is in here, or,
        not published here yet, will be as soon as its publish comes."""
        with self._lock:
            for item in items if isinstance(items, list) else ():
                if isinstance(item, list) and len(item) == 3 and isinstance(item[2], list):
                    self._taken_locked(client, item[0], item[1], tuple(item[2]))
            out = self._take_due_locked()
        _deliver(out)

    def _taken_locked(self, client: str, wid: Any, key: Any, export: tuple) -> None:
        obj = self._objects.get(key) if isinstance(key, str) else None
        if obj is not None and export_id(obj.record) == export and obj.record["mode"] == "oneshot":
            if obj.state == "offered" and obj.offered_to is not None and obj.offered_to[0] == client:
                self._settle_offer_locked(obj, True, False)
                return
            for tid in list(obj.transfers):
                t = self._transfers.get(tid)
                if t is not None and t["dst"] == client and t["kind"] == "sub":
                    self.op_complete(client, {"tid": tid, "ok": True})
                    return
            if obj.state == "ready":  # its receive timed out here before the match: received all the same
                self._forget_locked(key, obj, reason="received")
                return
        for side in list(self._side.values()):
            if side.offered_to == (client, wid) and export_id(side.record) == export:
                self._settle_offer_locked(side, True, True)
                return
        w = self._waiter_by_id.get(wid)
        if w is not None and w.client == client:
            self._drop_waiter(w)
        # Its publish is not here yet: received as soon as it comes (bounded: the oldest go first).
        self._taken_exports[export] = True
        while len(self._taken_exports) > TAKEN_KEEP:
            del self._taken_exports[next(iter(self._taken_exports))]

    def _offers_client_gone_locked(self, client: str) -> None:
        """``client`` went away: what it published aside or was remembered as taken goes; what was offered to it
        was not taken."""
        for export in [e for e in self._taken_exports if e[0] == client]:
            del self._taken_exports[export]
        for oid, obj in list(self._side.items()):
            if obj.record["owner"] == client:
                del self._side[oid]
            elif obj.offered_to is not None and obj.offered_to[0] == client:
                self._settle_offer_locked(obj, False, True)
        for obj in list(self._objects.values()):
            if obj.state == "offered" and obj.offered_to[0] == client and obj.record["owner"] != client:
                self._settle_offer_locked(obj, False, False)

    def _offer_waits(self, offered: tuple[str, int], key: str) -> bool:
        w = self._waiter_by_id.get(offered[1])
        return w is not None and w.client == offered[0] and w.key == key

    def _ask_offer_fate(self, key: str, obj: _Object, offered: tuple[str, int]) -> dict[str, Any] | None:
        """Hold ``obj`` (one-shot, its offer went to receive ``offered``) until that receive's client says
        whether it took the offer: under its key in state ``offered`` (no one else is matched with it
        meanwhile), or, where the key has an object already, aside (a side object, whose publisher hears
        ``released`` when it was taken, else ``KeyExists``). None: that client is gone (nobody took it)."""
        rec = obj.record
        if offered[0] not in self._clients:
            return None
        obj.offered_to = offered
        if key in self._objects:
            self._side[rec["obj"]] = obj
        else:
            obj.state = "offered"
            self._objects[key] = obj
            self._hint(key)  # the key has an object now: no more offers for it
        self._push(
            offered[0],
            {
                "type": "offer_fate",
                "wid": offered[1],
                "key": key,
                "obj": rec["obj"],
                "export": list(export_id(rec)),
            },
        )
        return {"ok": True, "obj": rec["obj"]}

    def op_offer_fate(self, client: str, args: dict[str, Any]) -> dict[str, Any]:
        """The client a publish's offer went to says whether its receive took it (``took``): the object is then
        received (its publisher gets ``released``) and that receive stops waiting; else the object is there for
        the next receive (a side object: its publisher gets ``KeyExists``, the key having another object)."""
        oid, took = args.get("obj"), args.get("took")
        if not isinstance(oid, int) or not isinstance(took, bool):
            return _err(E_BAD_REQUEST, "offer_fate: expected obj (int) and took (bool)")
        obj = self._side.get(oid)
        side = obj is not None
        if obj is None:
            obj = self._objects.get(args.get("key")) if isinstance(args.get("key"), str) else None
            if obj is None or obj.record["obj"] != oid or obj.state != "offered":
                return {"ok": True, "stale": True}
        if obj.offered_to is None or obj.offered_to[0] != client:
            return _err(E_NOT_OWNER, f"offer_fate: object {oid} was not offered to this client")
        self._settle_offer_locked(obj, took, side)
        return {"ok": True}

    def _settle_offer_locked(self, obj: _Object, took: bool, side: bool) -> None:
        rec = obj.record
        key, wid = rec["key"], obj.offered_to[1]
        obj.offered_to = None
        self.counts["offer_fates_taken" if took else "offer_fates_not_taken"] += 1
        if took:
            w = self._waiter_by_id.get(wid)
            if w is not None and w.key == key:  # still queued (behind the key's other object): it has its bytes
                self._drop_waiter(w)
            elif self._timed_out.pop(wid, 0) is None:  # timed out here, but its receive had the offer: no timeout
                self.counts["timeouts"] -= 1
        if side:  # never under its key: its publisher hears the outcome
            del self._side[rec["obj"]]
            self.counts["received"] += 1 if took else 0
            reason = "received" if took else "exists"
            self._push(rec["owner"], {"type": "released", "key": key, "obj": rec["obj"], "reason": reason})
        elif took:
            self._forget_locked(key, obj, reason="received")
        else:
            obj.state = "ready"
            self._match_locked(key)


def offered_to(item: dict[str, Any]) -> tuple[str, int] | None:
    """The ``(client, wid)`` a publish item says its offer went to (``offered``), or None (none, or malformed)."""
    o = item.get("offered")
    if isinstance(o, (list, tuple)) and len(o) == 2 and isinstance(o[0], str) and isinstance(o[1], int):
        return o[0], o[1]
    return None


__all__ = ["TAKEN_KEEP", "OfferReconciler", "offered_to"]
