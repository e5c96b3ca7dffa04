"""The owner's side of device objects: publish, mset and broadcast registrations, and what keeps each
object alive until the broker releases it.

:class:`Publisher` is part of :class:`~kvstrata.devobj.api.DeviceObjects` (whose state it uses: the broker
link, event pool, lock and owned-object table). A call waits, on the host, for the caller's stream to reach
it (:meth:`Publisher._ready_event`), exports each key's tensors (CUDA IPC handles and a same-process token,
:data:`~kvstrata.devobj._core.LOCAL_EXPORTS`) and registers them in one request; the tensors stay
referenced here until a ``released`` / ``failed`` event, a ``dev_delete``, or the client's end.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata._proc import PID
from kvstrata.devobj._core import LOCAL_EXPORTS as _LOCAL
from kvstrata.devobj._core import settle as _settle
from kvstrata.devobj._core import specs_of
from kvstrata.devobj.debug import trace, wait_event
from kvstrata.devobj.ipc import export_tensor
from kvstrata.devobj.link import error_from
from kvstrata.devobj.offers import OFFER_MAX_KEYS
from kvstrata.ops import current_stream

log = logging.getLogger(__name__)

_TOKENS = itertools.count(1)


@dataclass
class _SharedEvent:
    """The ready event of one publish/mset call, shared by its keys."""

    event: Any
    refs: int = 0


@dataclass
class _Owned:
    """A published / registered / broadcast object: kept alive until the broker releases it."""

    key: str
    mode: str
    tensors: list[torch.Tensor]
    events: list[Any]
    token: str
    future: Future | None
    shared: _SharedEvent | None = None


class Publisher:
    """The owner-side methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    def _ready_event(self) -> tuple[_SharedEvent | None, list[bytes]]:
        """One event per call, recorded on the caller's stream and waited for on the host here, so an
        object is registered only once its bytes are complete.

        Why the host waits instead of handing readers an interprocess event: on the 2xH200 machine
        (torch 2.11, driver 580, 2026-11-29) a reader's ``cudaStreamWaitEvent`` on an opened IPC
        event crashed the reader (SIGSEGV), through torch's ``Event.from_ipc_handle`` and through
        ``cudaIpcOpenEventHandle`` alike. Records therefore carry no events (``events: []``).
        """
        if not self._cuda:
            return None, []
        stream = current_stream(self.device.index)  # by raw handle: ~5 us less than torch's lookup on the H200 host
        if stream.query():  # cudaStreamQuery: all its work is complete already; no event to record or wait for
            return _SharedEvent(None), []
        ev = self._events.get(self.device.index)
        ev.record(stream)
        try:
            wait_event(ev, self.config.copy_timeout, "publish: the caller's stream reaching the publish point")
        except BaseException:
            self._events.put([ev], self.device.index)
            raise
        return _SharedEvent(ev), []

    def _export(self, key: str, tensors: list[torch.Tensor], mode: str, ready: tuple) -> tuple[dict[str, Any], _Owned]:
        """The broker's item for one key and what keeps it alive here. Every nested part of the item (specs,
        exports, device) is a cached dict shared with other items: records are read and packed, never changed."""
        shared, ev_handles = ready
        events, handles = [], []
        if shared is not None:
            shared.refs += 1
            events = [shared.event] if shared.event is not None else []
            if self.config.transport != "nccl" or mode == "broadcast":  # chains always pull over IPC
                handles = [export_tensor(t) for t in tensors]
        token = f"t{next(_TOKENS)}"  # names the export in this process only (LOCAL_EXPORTS; records carry the pid)
        _LOCAL[token] = (tensors, events)
        item = {
            "key": key,
            "tensors": specs_of(tensors),
            "handles": handles,
            "events": ev_handles,
            "device": self._device_record(),
            "node_id": self.config.node_id,
            "pid": PID[0],
            "local": token,
            "transport": self.config.transport,
        }
        return item, _Owned(key, mode, tensors, events, token, Future(), shared)

    def _register(self, op: str, keys: list[str], lists: list[list[torch.Tensor]], **extra: Any) -> list[Future]:
        trace(f"{op} {len(keys)} keys: call")
        ready = self._ready_event()
        trace(f"{op}: stream reached the publish point")
        exported = [self._export(k, ts, op, ready) for k, ts in zip(keys, lists)]
        trace(f"{op}: exported")
        try:
            if op == "publish" and self._offer_box is not None and self.send_offers and len(exported) <= OFFER_MAX_KEYS:
                # Before the request: the hints are dropped as the broker registers the keys, and an offer taken is
                # the hand-off itself (the broker's hop is then off its path).
                self._offer(exported)
            if op == "broadcast":
                item = dict(exported[0][0], **extra)
                results = self._call("broadcast", {"item": item})["results"]
            else:
                results = self._call(op, {"items": [e[0] for e in exported]})["results"]
        except BaseException:
            for _, owned in exported:
                self._free(owned)
            raise
        trace(f"{op}: broker replied")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("devobj: %s %s -> %s", op, keys[:8], results[:8])
        futures = []
        for (_, owned), r in zip(exported, results):
            if not r.get("ok"):
                self._free(owned)
                _settle(owned.future, error_from(r.get("error"), r.get("message", "")))
            else:
                # Registered: the future runs until a receiver has it (cancel() is then refused, as for any running
                # future; dev_delete withdraws the object).
                owned.future.set_running_or_notify_cancel()
                with self._lock:
                    self._owned[r["obj"]] = owned
                    early = self._take_early(("obj", r["obj"]))
                for ev in early:
                    self._dispatch(ev)
            futures.append(owned.future)
        return futures

    def _offer(self, exported: list[tuple[dict[str, Any], _Owned]]) -> None:
        """Offer each key a subscriber waits for (the broker's hints) to that subscriber directly, and note in
        the key's item whom it went to (``offered``: the broker then asks that subscriber whether it took it
        if its receive no longer waits; kvstrata.devobj.offers)."""
        me = self.link.client_id
        table = self._offer_table  # once: close() lets it go (None)
        if table is None:
            return
        for item, _ in exported:
            if item["transport"] == "nccl":
                continue
            hint = table.lookup(item["key"])
            if hint is None or hint[1] == me:
                continue
            if self._offer_box.send(hint[1], hint[0], item["key"], dict(item, owner=me)):
                item["offered"] = [hint[1], hint[0]]
                trace(f"offered {item['key']!r}")

    def _free(self, owned: _Owned) -> None:
        _LOCAL.pop(owned.token, None)
        shared, owned.shared = owned.shared, None
        if shared is not None:
            with self._lock:
                shared.refs -= 1
                last = shared.refs == 0
            if last and shared.event is not None:  # every key of its call is released: the event can serve another
                self._events.put([shared.event], self.device.index)

    def _release(self, obj: int, exc: BaseException | None = None) -> None:
        with self._lock:
            owned = self._owned.pop(obj, None)
        if owned is not None:
            self._free(owned)
            if owned.future is not None:
                _settle(owned.future, exc if owned.mode != "mset" else None)


__all__ = ["Publisher"]
