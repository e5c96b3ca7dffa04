"""This client's ends of the NCCL data path: a receive matched to a ``nccl`` transfer, and the ``send``
events the broker hands the owner once the receiver posted the pair's unique id.

:class:`NcclEnds` is part of :class:`~kvstrata.devobj.api.DeviceObjects` (whose state it uses: the broker
link, lock, owned-object table). The pairs' communicators, threads and ordering live in
:mod:`kvstrata.devobj.nccl`, imported on first use.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstrata import errors
from kvstrata.devobj._core import Want as _Want
from kvstrata.errors import InvalidValue

log = logging.getLogger(__name__)


class NcclEnds:
    """The NCCL methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    def _channels(self):
        with self._lock:
            if self._nccl is None:
                from kvstrata.devobj.nccl import Channels

                self._nccl = Channels()
            return self._nccl

    def _start_nccl_recv(self, t: dict[str, Any], want: _Want) -> None:
        """Queue the receive of NCCL transfer ``t`` on its pair's channel; a failure before that fails the
        transfer (the broker then resets the pair: its later transfers would wait for this one forever)."""
        try:
            if not self._cuda:
                raise InvalidValue("tensor_lists: the NCCL path needs CUDA tensors")
            ch = self._channels().get(t["src"], t["dst"], rank=1, device=self.device.index)
            if t["nccl"]["create_uid"]:
                from kvstrata.devobj.nccl import new_unique_id

                uid = new_unique_id()
                ch.set_uid(uid)
                self._call("pair_uid", {"src": t["src"], "uid": uid})
        except BaseException as exc:
            self._fail_transfer(t, want, exc)
            return

        def op() -> None:
            try:
                ch.recv(want.tensors, want.after)
                self._complete(t, want)
            except BaseException as exc:
                self._fail_transfer(t, want, exc)

        ch.submit(t["nccl"]["seq"], op, lambda msg: self._fail_transfer(t, want, errors.ServerError(msg)))

    def _nccl_send(self, ev: dict[str, Any]) -> None:
        t = ev["transfer"]
        with self._lock:
            owned = self._owned.get(t["record"]["obj"])
        ch = self._channels().get(t["src"], t["dst"], rank=0, device=self.device.index)
        ch.set_uid(ev["uid"])
        if owned is None:  # released meanwhile: the transfer fails, and the broker resets the pair
            log.warning("devobj: NCCL send for released object %r", t["key"])
            try:
                self._call("nccl_failed", {"tid": t["tid"], "error": f"the sender of {t['key']!r} released it"})
            except Exception as exc:
                log.debug("devobj nccl_failed: %s", exc)
            return

        def op() -> None:
            try:
                ch.send(owned.tensors, owned.events[0] if owned.events else None)
            except Exception as exc:  # the receiver reports the failure to the broker
                log.warning("devobj: NCCL send of %r failed: %s", t["key"], exc)

        ch.submit(t["nccl"]["seq"], op, lambda msg: log.warning("devobj: %s", msg))


__all__ = ["NcclEnds"]
