"""The reader's side of device objects up to the copies: subscribe and mget requests, reads from kept
records with no broker round trip, staged many-key receives, and the withdrawal of cancelled waits.

:class:`Requester` is part of :class:`~kvstrata.devobj.api.DeviceObjects` (whose state it uses: the broker
link, lock, waiting and in-flight tables, kept records). A request's matches are copied by
:class:`~kvstrata.devobj.receive.CopyReceiver` in one batch (inline when small: the 4 KiB hand-off path);
the keys not yet published wait in the broker, and their matches come as events
(:class:`~kvstrata.devobj.events.EventThread`).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

import torch

from kvstrata.devobj._core import Want as _Want
from kvstrata.devobj._core import settle as _settle
from kvstrata.devobj._core import specs_of
from kvstrata.devobj.debug import brief, trace
from kvstrata.devobj.futures import SpinFuture
from kvstrata.devobj.ipc import dtype_name
from kvstrata.devobj.link import error_from
from kvstrata.ops import current_stream
from kvstrata.server.protocol import check_timeout

log = logging.getLogger(__name__)


#: records of keys read before, kept for reads with no broker round trip (see _receive)
MAX_CACHED_RECORDS = 1 << 16


def widen(
    t: dict[str, Any], r: dict[str, Any], reply: dict[str, Any], kind: str, me: str, specs: list[dict[str, Any]]
) -> dict[str, Any]:
    """A lean transfer of a subscribe/mget ``reply`` (see :meth:`kvstrata.devobj.broker.DeviceBroker._wire`)
    made whole again, in place: the record gets back its shared fields, key and tensor specs (``specs``,
    what the receiver sent; as a new dict: in process, the lean record is the broker's own), the transfer
    its ``kind`` (the request's: ``sub`` or ``get``), path, wid, key, src and dst."""
    i = t.pop("s")
    s = reply["shared"][i]
    rec = t.get("record")
    if rec is not None:
        t["record"] = {**rec, **s, "key": r["key"], "tensors": specs}
    t["kind"], t["path"] = kind, reply["paths"][i]
    t["wid"], t["key"], t["src"], t["dst"] = r["wid"], r["key"], s["owner"], me
    return t


def _same_specs(have: list[dict[str, Any]], tensors: list[torch.Tensor]) -> bool:
    if len(have) != len(tensors):
        return False
    return all(sp["shape"] == list(t.shape) and sp["dtype"] == dtype_name(t.dtype) for sp, t in zip(have, tensors))


class Requester:
    """The request-side methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    def _receive(self, op: str, keys: list[str], lists: list[list[torch.Tensor]], timeout: float | None):
        """Reads with no broker round trip (a seqlock on the broker's generation page).

        A key read before is copied straight from the record kept from that read when the page still
        shows the generation read *before* the request that returned the record; after the copy
        has finished, the page must still show it and the owner's process must still live, else the
        key is read again through the broker (which answers the truth: the new object, or an error).
        Safe because an owner writes or frees a registered object's memory only after ``dev_delete``
        answered, and the broker bumps the generation before answering (see
        :mod:`kvstrata.devobj.broker`): a copy overlapping such a write or free ends after the bump
        and sees it; a dead owner is seen by the pid check. A read that overlaps a delete may thus
        fail where, through the broker, it would have held up the delete instead.
        """
        timeout = check_timeout(timeout)
        trace(f"{op} {len(keys)} keys: call")
        after = None
        if self._cuda:
            stream = current_stream(self.device.index)
            # An idle stream (cudaStreamQuery) reached the call already: nothing to order the copies after,
            # so no event to create, record and wait for on the copy streams.
            if not stream.query():
                after = torch.cuda.Event()
                after.record(stream)
        wants = [_Want(k, ts, SpinFuture(), after) for k, ts in zip(keys, lists)]
        for want in wants:
            want.future._settler = self._poller
        hits: list[tuple[dict[str, Any], _Want]] = []
        rest = wants
        counter = self._gen  # once: close() lets it go (None)
        if op == "mget" and counter is not None:
            gen = counter.value
            with self._lock:
                entries = [self._records.get(k) for k in keys]
            rest = []
            for want, e in zip(wants, entries):
                if e is not None and e[0] == gen and _same_specs(e[1]["tensors"], want.tensors):
                    hits.append((e[1], want))
                else:
                    rest.append(want)
        if rest:
            stages = self._stages(rest)
            prev = None
            for i, part in enumerate(stages):
                mine = threading.Event() if len(stages) > 1 else None
                try:
                    self._request(op, part, timeout, prev_stage=prev, stage_done=mine)
                    prev = mine
                except BaseException as exc:
                    if i == 0:
                        raise
                    # Earlier stages are in flight (their futures are the caller's): the rest fail alone.
                    for want in (w for later in stages[i:] for w in later):
                        _settle(want.future, exc)
                    break
        if hits:
            for _, want in hits:
                want.running = True  # a read redone through the broker (see _copy_cached) must not set it again
                want.future.set_running_or_notify_cancel()
            self._read_cached(hits, gen, timeout)
        trace(f"{op}: returns futures")
        return [w.future for w in wants]

    def _stages(self, wants: list[_Want]) -> list[list[_Want]]:
        """``wants`` as the requests to send, in order: one, or, for a big many-key receive, stages of
        ``config.stage_bytes``, then twice that, and so on (each stage's copies are queued before the next
        request goes out, so the broker's answer for a stage overlaps the copies of the one before)."""
        first = self.config.stage_bytes
        if len(wants) < 2 or not first:
            return [wants]
        sizes = [sum(t.nbytes for t in w.tensors) for w in wants]
        if sum(sizes) < 2 * first:
            return [wants]
        stages: list[list[_Want]] = []
        cur: list[_Want] = []
        have, limit = 0, first
        for want, n in zip(wants, sizes):
            cur.append(want)
            have += n
            if have >= limit:
                stages.append(cur)
                cur, have, limit = [], 0, limit * 2
        if cur:
            stages.append(cur)
        return stages

    def _request(
        self,
        op: str,
        wants: list[_Want],
        timeout: float | None,
        *,
        prev_stage: threading.Event | None = None,
        stage_done: threading.Event | None = None,
    ) -> None:
        """Ask the broker for ``wants``; matches are copied in one batch, the others wait for events.

        A stage of a staged receive (see :meth:`_stages`) sets ``stage_done`` once its copies are waited for
        (at once if it has none to wait for); its wait starts after ``prev_stage``'s, whose copies run ahead
        of its own on the transfer stream: it then sleeps through its own copies' time only, and one thread,
        not several, polls the stream's progress.
        """
        handed = False
        try:
            handed = self._request_stage(op, wants, timeout, prev_stage, stage_done)
        finally:
            if stage_done is not None and not handed:
                stage_done.set()

    def _request_stage(
        self,
        op: str,
        wants: list[_Want],
        timeout: float | None,
        prev_stage: threading.Event | None,
        stage_done: threading.Event | None,
    ) -> bool:
        """:meth:`_request`'s body; True when a pool job took ``stage_done`` over (sets it when finished)."""
        keys = [w.key for w in wants]
        args: dict[str, Any] = {
            "keys": keys,
            "specs": [specs_of(w.tensors) for w in wants],
            "timeout": timeout,
            "lean": True,
        }
        known: list[dict[str, Any] | None] = []
        gen0 = None
        counter = self._gen  # once: close() lets it go (None)
        if op == "mget" and counter is not None:
            gen0 = counter.value  # before the request: records it returns are good while the page says this
            with self._lock:
                known = [(e[1] if e is not None else None) for e in map(self._records.get, keys)]
            args["known"] = [r["obj"] if r is not None else None for r in known]
        reply = self._call(op, args)
        results = reply["results"]
        kind = "sub" if op == "subscribe" else "get"
        me = getattr(self.link, "client_id", "")
        trace(f"{op}: broker replied")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("devobj: %s %s -> %s", op, keys[:8], [brief(r) for r in results[:8]])
        batch = []
        for i, (want, r) in enumerate(zip(wants, results)):
            status = r["status"]
            if status == "matched":
                t = r["transfer"]
                if "s" in t:
                    t = widen(t, r, reply, kind, me, args["specs"][i])
                if "record" not in t:  # the broker left out what we told it we hold
                    t["record"] = known[i]
                if t["path"] != "nccl" and t["kind"] != "bcast":
                    want.tid, want.transfer = t["tid"], t
                    if not want.running:
                        want.running = True
                        want.future.set_running_or_notify_cancel()  # from here on, cancel() is refused
                    batch.append((t, want))
                else:
                    self._start(t, want)
            elif status == "waiting":
                with self._lock:
                    self._wants[r["wid"]] = want
                    early = self._take_early(("wid", r["wid"]))
                want.future.add_done_callback(lambda f, wid=r["wid"]: self._on_cancel(f, wid))
                if self._role is not None and self.lead_waiters:  # its waiter may read the match itself (.lead)
                    want.future._lead = self._lead
                for ev in early:
                    self._dispatch(ev)
            else:
                _settle(want.future, error_from(r.get("error"), r.get("message", "")))
        if batch:
            with self._lock:  # one lock for the whole batch, not one per key
                for t, want in batch:
                    self._inflight[t["tid"]] = want
                if gen0 is not None:
                    for t, want in batch:
                        if len(self._records) >= MAX_CACHED_RECORDS:
                            self._records.pop(next(iter(self._records)))
                        self._records[want.key] = (gen0, t["record"])
            if len(batch) == 1 and self._inline_ok(batch):
                self._copy_batch(batch)
            elif self._cuda:
                # Queue the copies on this thread (asynchronous GPU work) and leave only the wait to the pool:
                # the copies start without a thread hand-off (~100 us on the H200 host before).
                with torch.cuda.device(self.device):  # the caller's thread may have another GPU current
                    queued = self._queue_batch(batch)
                if stage_done is None:
                    self._run_in_pool(self._finish_batch, *queued)
                    return False
                self._run_in_pool(self._finish_stage, queued, prev_stage, stage_done)
                return True
            else:
                self._run_in_pool(self._copy_batch, batch)
        return False

    def _finish_stage(self, queued: tuple, prev_stage: threading.Event | None, stage_done: threading.Event) -> None:
        """:meth:`_finish_batch` of one stage, after the stage before it (see :meth:`_request`)."""
        try:
            if prev_stage is not None:
                prev_stage.wait(self.config.copy_timeout)  # bounded: the wait below still has its own deadline
            self._finish_batch(*queued)
        finally:
            stage_done.set()

    def _on_cancel(self, f: Future, wid: int) -> None:
        """A waiting receive was cancelled by its caller: withdraw it from the broker."""
        if not f.cancelled():
            return
        with self._lock:
            gone = self._wants.pop(wid, None)
            if gone is not None:
                self._cancelled.add(wid)  # a match already on its way is declined (see _dispatch)
        if self._role is not None:  # a thread leading for this future stops reading events
            self._role.wake()
        if gone is not None and not self._closed:
            try:
                reply = self._call("cancel", {"wids": [wid]})
            except Exception as exc:  # the broker is gone: nothing left to withdraw
                log.debug("devobj cancel: %s", exc)
                return
            if wid in reply.get("withdrawn", ()):  # withdrawn before any match: no event will come to decline
                with self._lock:
                    self._cancelled.discard(wid)


__all__ = ["MAX_CACHED_RECORDS", "Requester", "widen"]
