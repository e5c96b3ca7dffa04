"""The copy path of a device-object receive: a matched transfer's bytes copied into the caller's tensors,
checked, settled and reported to the broker.

:class:`CopyReceiver` is part of :class:`~kvstrata.devobj.api.DeviceObjects` (whose state it uses: the
import cache, transfer streams, event pool, in-flight table, broker link). The copies of one call go
as one batch (:meth:`CopyReceiver._enqueue_batch`: one ``cudaMemcpyBatchAsync`` per source GPU, pushed
by that GPU's copy engine); a future settles once its bytes are in and its owner is still alive, and
the broker hears of it off the caller's path (carried by the event thread's next poll, or one-way).
Small copies run on the thread reading events (the event thread, or a waiter leading: the 4 KiB
latency path), others on the copy pool.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvstrata import errors
from kvstrata._proc import PID
from kvstrata.devobj import broker as B
from kvstrata.devobj._core import LOCAL_EXPORTS as _LOCAL
from kvstrata.devobj._core import Want as _Want
from kvstrata.devobj._core import settle as _settle
from kvstrata.devobj._core import specs_of
from kvstrata.devobj.broker_match import _mismatch
from kvstrata.devobj.debug import CopyRates, trace, wait_event
from kvstrata.devobj.futures import HANDOFF_S
from kvstrata.devobj.ipc import copy_into
from kvstrata.devobj.link import error_from
from kvstrata.devobj.offers import export_id
from kvstrata.errors import InvalidValue

log = logging.getLogger(__name__)

#: transfers up to this size are copied on the event thread itself instead of the copy pool
INLINE_COPY_BYTES = 1 << 20
#: batches up to this many bytes are pulled on this client's own stream instead of pushed by the sources' GPUs
PULL_MAX_BYTES = 256 << 10
#: receives that took an offer, kept for the broker's question of their fate (oldest dropped beyond this)
TAKEN_KEEP = 4096
#: copy rates seen per path in this process: how long to sleep before polling a copy's end
_RATES = CopyRates()


def _nbytes(t: dict[str, Any]) -> int:
    return sum(int(x["nbytes"]) for x in t["record"]["tensors"])


def _handoff(futures) -> None:
    """Let the threads waiting on just-settled ``futures`` take the GIL before this one goes on (bounded in
    all: :data:`~kvstrata.devobj.futures.HANDOFF_S`); see :meth:`~kvstrata.devobj.futures.SpinFuture.handoff`."""
    end = None
    for f in futures:
        if getattr(f, "_inside", 0):
            now = time.monotonic()
            end = end or now + HANDOFF_S
            if now >= end or not f.handoff(end - now):
                return


def _what(queued: list[tuple[dict[str, Any], Any]]) -> str:
    """``queued``: (record, want) pairs."""
    keys = ", ".join(repr(r["key"]) for r, _ in queued[:4]) + (
        f" and {len(queued) - 4} more" if len(queued) > 4 else ""
    )
    return f"copy of {keys} from {queued[0][0]['owner']}"


class CopyReceiver:
    """The receive-side copy methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    def _inline_ok(self, items: list[tuple[Any, _Want]]) -> bool:
        """Whether to copy on this thread: small, and the caller's stream already reached the call."""
        if sum(t.numel() * t.element_size() for _, w in items for t in w.tensors) > INLINE_COPY_BYTES:
            return False
        after = items[0][1].after
        return after is None or after.query()

    def _read_cached(self, items: list[tuple[dict[str, Any], _Want]], gen: int, timeout: float | None) -> None:
        if self._inline_ok(items):
            self._copy_cached(items, gen, timeout)
        else:
            self._run_in_pool(self._copy_cached, items, gen, timeout)

    def _copy_cached(self, items: list[tuple[dict[str, Any], _Want]], gen: int, timeout: float | None) -> None:
        """Copy keys from kept records; settle those still valid after the copy, re-read the others."""
        redo: list[_Want] = []
        try:
            failed: list[_Want] = []
            queued, done = self._enqueue_batch(items, lambda rec, want, exc: failed.append(want))
            redo += failed
            if done is not None:
                self._wait_copies(done[0], queued)
                self._events.put([done[0]], done[1])
            trace("cached read: copies done")
            counter = self._gen  # None once this client closed: then every key is re-read (and fails, closed)
            still = counter is not None and counter.value == gen
            lost = self._lost_owners([rec for rec, _ in queued])
            settled = []
            for rec, want in queued:
                if still and rec["owner"] not in lost:
                    _settle(want.future)
                    settled.append(want.future)
                else:
                    redo.append(want)
            self._after_settle(settled, notify=False)
            self.cached_reads += len(queued) - len(redo) + len(failed)
        except BaseException as exc:  # e.g. a stuck copy: let the broker path decide each key
            log.debug("devobj: cached read failed (%s: %s); asking the broker", type(exc).__name__, exc)
            redo = [w for _, w in items if not w.future.done()]
        if redo:
            with self._lock:
                for w in redo:
                    self._records.pop(w.key, None)
            try:
                self._request("mget", redo, timeout)
            except BaseException as exc:
                for w in redo:
                    _settle(w.future, exc)

    def _start(self, t: dict[str, Any], want: _Want) -> None:
        if want.offer is not None:
            if want.future.done():  # its receive took a publisher's offer: this match only confirms it (or not)
                self._match_of_taken(t, want)
                return
            self._end_offer(want)  # an offered copy that failed: waited out, then the match is copied as usual
        if not (want.future.running() or want.future.set_running_or_notify_cancel()):
            # Cancelled just as it matched: hand the object back untouched (a broadcast aborts).
            try:
                self._call("complete", {"tid": t["tid"], "ok": False, "error": "receive cancelled"})
            except Exception as exc:
                log.debug("devobj decline: %s", exc)
            return
        trace(f"matched {t['key']!r}")
        want.tid = t["tid"]
        want.transfer = t
        with self._lock:
            self._inflight[t["tid"]] = want
            early = self._take_early(("tid", t["tid"]))
        if t["path"] == "nccl":
            self._start_nccl_recv(t, want)
        elif t["kind"] == "bcast":
            self._start_bcast(t, want)
        elif self._is_event_thread() and _nbytes(t) <= INLINE_COPY_BYTES:
            # A small copy costs less than a hand-off to the pool: do it here (the 4 KiB latency path).
            try:
                self._copy(t, want)
            except BaseException as exc:
                self._fail_transfer(t, want, exc)
        else:
            self._submit(t, want, self._copy)
        for ev in early:
            self._dispatch(ev)

    # -- offers: a publisher's record copied ahead of the broker's match (kvstrata.devobj.offers) --------
    def _take_offers(self, *, first: bool = True) -> None:
        """As the event connection's reader: copy the offers queued in this client's box (``first``: the first one
        only; the reader's next wait sees the box readable while others are queued). Never raises: whatever goes
        wrong with an offer, the broker's match copies as usual."""
        try:
            offers = self._offer_box.take(first=first)
        except Exception:
            log.exception("devobj: offer box")
            return
        trace("offers received")
        for offer in offers:
            try:
                self._on_offer(offer)
            except Exception:  # a bad offer must not stop the reader: the match copies as usual
                log.exception("devobj: offer of %r", offer.get("k"))

    def _on_offer(self, offer: dict[str, Any]) -> None:
        """Take an offered record for receive ``offer["w"]`` if it still waits for that key, matches the
        record's tensors and is small: copy it, and once the copy ended with its owner alive, the receive is
        done. Set running first: from then on the caller cannot cancel it and reuse its tensors under the copy.
        Where the copy fails or its owner died meanwhile, the receive runs on and the broker's match decides."""
        wid, key = offer["w"], offer["k"]
        with self._lock:
            want = self._wants.get(wid)
        if want is None or want.key != key or want.offer is not None or want.tid is not None:
            return  # matched, timed out or cancelled already, or not this client's receive: the broker decides
        rec = offer["r"]  # the box's own dict for this offer
        rec["key"], rec["mode"] = key, "oneshot"
        specs = specs_of(want.tensors)
        if (rec.get("tensors") != specs and _mismatch(rec.get("tensors") or [], specs)) or not self._inline_ok(
            [(rec, want)]
        ):
            return
        if not (want.future.running() or want.future.set_running_or_notify_cancel()):
            return  # cancelled: the broker hears of it from the cancel
        trace(f"offer of {key!r}: receive running")
        failed: list[BaseException] = []
        queued, done = self._enqueue_batch([(rec, want)], lambda r, w, exc: failed.append(exc), end_event=False)
        if not queued:
            log.debug("devobj: offer of %r not copied: %s", key, failed[0] if failed else "?")
            return
        want.offer = (rec, done)
        self.offers_taken += 1
        if done is not None:
            try:
                wait_event(done[0], self.config.copy_timeout, _what(queued))  # an event, or the stream itself
            except BaseException as exc:  # stuck: the match waits this copy out (_end_offer), then copies again
                log.warning("devobj: offered copy of %r: %s", key, exc)
                return
            if done[1] is not None:
                self._events.put([done[0]], done[1])
        trace(f"offer of {key!r}: copies done")
        if self._lost_owners([rec]):  # its memory may have gone mid-copy: never report it done
            want.offer = None
            return
        # Taken: the receive is done. The broker hears of it from this receive's match, or, where the receive no
        # longer waits there (or waits behind another object), by asking (offer_fate, answered from _taken).
        want.offer = (rec, None)
        with self._lock:
            self._taken[wid] = (key, export_id(rec))
            while len(self._taken) > TAKEN_KEEP:
                self._taken.popitem(last=False)
        self.offers_used += 1
        _settle(want.future)
        trace("offer taken: settled")
        self._after_settle([want.future], notify=False)

    def _match_of_taken(self, t: dict[str, Any], want: _Want) -> None:
        """The broker's match of a receive that took an offer: complete it where it names the offered export
        (the normal case), else hand that other object back (``ok=False``: the broker keeps it for the next
        receive, whole)."""
        rec, want.offer = want.offer[0], None
        if t["kind"] == "sub" and export_id(t.get("record") or {}) == export_id(rec):
            with self._lock:
                self._taken.pop(t["wid"], None)
            self._report_done([t["tid"]])
            return
        try:
            self._call("complete", {"tid": t["tid"], "ok": False, "error": "the receive took a publisher's offer"})
        except Exception as exc:  # the broker gets it back when this client goes
            log.warning("devobj: could not hand back %r (transfer %s): %s", t["key"], t["tid"], exc)

    def _offer_fate(self, ev: dict[str, Any]) -> None:
        """The broker asks whether receive ``ev["wid"]`` took the offer of ``ev["export"]`` (that publish came
        when the receive no longer waited there, or waited behind another object). Offers sent before that
        publish are in the box by now: they are decided first."""
        self._take_offers(first=False)
        wid = ev["wid"]
        with self._lock:
            entry = self._taken.get(wid)
            took = entry is not None and entry[1] == tuple(ev.get("export") or ())
            if took:
                del self._taken[wid]
                self._wants.pop(wid, None)  # done here; the broker drops it there (no event comes for it)
        args = {"obj": ev["obj"], "key": ev["key"], "took": took}
        notify = getattr(self.link, "notify", None)
        try:
            notify("offer_fate", args) if notify is not None else self._call("offer_fate", args)
        except Exception as exc:  # the broker settles it when this client goes
            log.warning("devobj: could not answer the fate of the offer of %r: %s", ev["key"], exc)

    def _end_offer(self, want: _Want) -> None:
        """Drop a receive's offer copy, once it ended (no copy may write into the caller's tensors after)."""
        offer, want.offer = want.offer, None
        if offer is None or offer[1] is None:
            return
        done = offer[1]
        try:
            wait_event(done[0], self.config.copy_timeout, "an offered copy")
            if done[1] is not None:  # an event of the pool (else the stream itself)
                self._events.put([done[0]], done[1])
        except BaseException as exc:  # stuck: the receive fails anyway; its event is not reused
            log.warning("devobj: offered copy of %r did not end: %s", want.key, exc)

    def _submit(self, t: dict[str, Any], want: _Want, fn, *args: Any) -> None:
        def run() -> None:
            try:
                fn(t, want, *args)
            except BaseException as exc:  # report, never leave the broker or the caller waiting
                self._fail_transfer(t, want, exc)

        self._run_in_pool(run)

    def _run_in_pool(self, fn, *args: Any) -> None:
        """Run ``fn`` on the copy pool; an error that escapes it is logged, never lost silently."""

        def report(f) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.error("devobj: copy job %s failed", getattr(fn, "__name__", fn), exc_info=f.exception())

        self._pool.submit(fn, *args).add_done_callback(report)

    def _fail_transfer(self, t: dict[str, Any], want: _Want, exc: BaseException) -> None:
        log.warning("devobj: receive of %r (transfer %s) failed: %s: %s", t["key"], t["tid"], type(exc).__name__, exc)
        with self._lock:
            self._inflight.pop(t["tid"], None)
        try:
            self._call("complete", {"tid": t["tid"], "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc2:
            log.debug("devobj complete(ok=False): %s", exc2)
        _settle(want.future, exc)

    def _sources(self, src: dict[str, Any], peer: str, reuse: bool = False) -> tuple[list[torch.Tensor], list[Any]]:
        """The source tensors and readiness events of an export (a record or a chain link)."""
        if src.get("pid") == PID[0] and src.get("node_id") == self.config.node_id:
            local = _LOCAL.get(src["local"])
            if local is None:
                raise errors.ServerError(f"source of {src.get('key')!r} was released in this process")
            return local[0], local[1]
        if not self._cuda:
            raise InvalidValue("tensor_lists: CPU tensors can only move between clients of one process")
        # Exports are complete when registered (see _ready_event): nothing to wait for on the device.
        return self._imports.tensors(peer, src, reuse=reuse), []

    def _enqueue_batch(
        self, items: list[tuple[dict[str, Any], _Want]], fail, *, end_event: bool = True
    ) -> tuple[list, Any]:
        """Queue the copies of ``(record, want)`` items as one batch on this client's transfer streams,
        after the callers' streams reached their calls; returns the queued items and ``(end event, its
        device)`` (None on CPU, copied already), the event from :attr:`_events`, to go back to it on that
        device. ``end_event=False``: for a batch pulled on this client's own stream, ``(that stream, None)``
        instead, to wait for the stream itself (one CUDA call less: the small offer's path). An item that
        cannot be queued goes to ``fail(record, want, exc)``."""
        queued, dsts, srcs = [], [], []
        for rec, want in items:
            try:
                src, _ = self._sources(rec, rec["owner"], reuse=True) if rec["mode"] == "mset" else (None, None)
                if src is None:
                    src, _ = self._sources(rec, rec["owner"])
                if len(src) != len(want.tensors) or any(d.nbytes != x.nbytes for d, x in zip(want.tensors, src)):
                    raise InvalidValue(f"tensor_lists: sizes of {rec['key']!r} differ from the source's")
                if rec["mode"] == "mset":
                    with self._lock:
                        self._read[rec["obj"]] = (rec["owner"], rec["handles"], rec["key"])
            except BaseException as exc:
                fail(rec, want, exc)
                continue
            queued.append((rec, want))
            dsts += want.tensors
            srcs += src
        if not queued:
            return queued, None
        trace("sources ready")
        if not self._cuda:
            for d, x in zip(dsts, srcs):
                d.copy_(x)
            return queued, None
        afters = list({id(w.after): w.after for _, w in queued if w.after is not None}.values())
        by_src: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]]
        if sum(d.nbytes for d in dsts) <= PULL_MAX_BYTES:
            # Small: pulled by our own GPU on our own transfer stream, the thread's current device (no device
            # switch, no cross-device wait); at these sizes the time is the host's, not the link's.
            by_src = {self.device.index: (dsts, srcs)}
        else:
            # Push: each source GPU's copy engine writes into ours (NVLink writes beat reads: a pull of
            # 2 x 1 GiB ran at 328 GB/s on the H200 pair where torch's push copy ran at 392).
            by_src = {}
            for d, x in zip(dsts, srcs):
                group = by_src.setdefault(x.device.index, ([], []))
                group[0].append(d)
                group[1].append(x)
        ends = []
        pulled = len(by_src) == 1 and self.device.index in by_src
        for src_dev, (group_dst, group_src) in by_src.items():
            ss = self._streams.get(src_dev)
            for ev in afters:
                ss.wait_event(ev)
            trace("copy streams wait for the callers'")
            copy_into(group_dst, group_src, self._streams, src_dev)
            trace("copies handed to the copy engine")
            if pulled and not end_event:
                return queued, (ss, None)
            # The end is recorded where the copies ran: the host waits for it, nothing on our own stream
            # needs to (no extra event per call and no cross-device stream wait).
            end = self._events.get(src_dev)
            end.record(ss)
            ends.append((end, src_dev))
        if len(ends) > 1:  # sources on several GPUs (rare): one end on our stream after all of them
            sd = self._streams.get(self.device.index)
            for end, _ in ends:
                sd.wait_event(end)
            done = self._events.get(self.device.index)
            done.record(sd)
            for end, dev in ends:  # free to re-record: a stream wait takes the record before it (CUDA semantics)
                self._events.put([end], dev)
            ends = [(done, self.device.index)]
        trace(f"copies queued ({len(queued)} keys)")
        return queued, ends[0]

    def _wait_copies(self, done: Any, queued: list[tuple[dict[str, Any], _Want]]) -> None:
        """Wait (bounded) for the batch's end event ``done``, sleeping through most of the time the copy
        should take on its path as seen so far (:class:`~kvstrata.devobj.debug.CopyRates`)."""
        nbytes = sum(t.numel() * t.element_size() for _, w in queued for t in w.tensors)
        path = (tuple(sorted({(rec.get("device") or {}).get("uuid") or "" for rec, _ in queued})), self.device.index)
        start = time.perf_counter()
        wait_event(done, self.config.copy_timeout, _what(queued), expected=_RATES.expected(path, nbytes))
        _RATES.observe(path, nbytes, time.perf_counter() - start)

    def _lost_owners(self, records: list[dict[str, Any]]) -> set[str]:
        """Owners (client ids) among ``records`` whose memory may be gone: their process died, or (in
        this process) their client released the object; checked once each, after a copy ended."""
        lost: set[str] = set()
        checked: set[str] = set()
        me = PID[0]
        for rec in records:
            owner = rec["owner"]
            if rec.get("pid") == me and rec.get("node_id") == self.config.node_id:
                if rec.get("local") not in _LOCAL:
                    lost.add(owner)
            elif owner not in checked:
                checked.add(owner)
                if rec.get("pid") is not None and not self._pids.alive(int(rec["pid"])):
                    lost.add(owner)
        return lost

    def _copy(self, t: dict[str, Any], want: _Want) -> None:
        self._copy_batch([(t, want)])

    def _copy_batch(self, items: list[tuple[dict[str, Any], _Want]]) -> None:
        """Matched keys of one call: one batched copy, one wait; each future settles once its bytes are in
        and its source stayed valid (no broker round trip first); the broker hears of it off this path."""
        self._finish_batch(*self._queue_batch(items))

    def _queue_batch(self, items: list[tuple[dict[str, Any], _Want]]) -> tuple[list, Any, dict[int, Any]]:
        """First half of :meth:`_copy_batch`: the copies queued (asynchronous), or failed and reported."""
        trace(f"copy batch of {len(items)}: start")
        by_rec = {id(t["record"]): t for t, _ in items}
        try:
            queued, done = self._enqueue_batch(
                [(t["record"], w) for t, w in items],
                lambda rec, want, exc: self._fail_transfer(by_rec[id(rec)], want, exc),
            )
        except BaseException as exc:  # e.g. a CUDA error queueing the copies: never leave a caller's future hanging
            for t, want in items:
                if not want.future.done():
                    self._fail_transfer(t, want, exc)
            return [], None, by_rec
        return queued, done, by_rec

    def _finish_batch(self, queued: list, done: Any, by_rec: dict[int, Any]) -> None:
        """Second half of :meth:`_copy_batch`: wait for the copies, check the sources, settle, report."""
        if not queued:
            return
        try:
            if done is not None:
                self._wait_copies(done[0], queued)
                self._events.put([done[0]], done[1])
            trace("copy batch: copies done")
            lost = self._lost_owners([rec for rec, _ in queued])
        except BaseException as exc:  # never leave a caller's future hanging
            for rec, want in queued:
                self._fail_transfer(by_rec[id(rec)], want, exc)
            return
        log.debug("devobj: copied %d keys (%r, ...)", len(queued), queued[0][0]["key"])
        good = []
        for rec, want in queued:
            t = by_rec[id(rec)]
            if rec["owner"] in lost:  # its memory may have gone mid-copy: never report it done
                self._fail_transfer(t, want, error_from(B.E_OWNER_GONE, f"owner of {rec['key']!r} went away"))
                continue
            good.append((t["tid"], want))
        self._settle_received(good)

    def _settle_received(self, good: list[tuple[int, _Want]]) -> None:
        """``(tid, want)`` whose bytes are in and whose owners outlived the copies: done, here and at the broker."""
        with self._lock:
            for tid, _ in good:
                self._inflight.pop(tid, None)
        # Queued before any future settles (a callback that closes this client still reports them), sent
        # after (the callers wake first): by the event thread's next poll, or one-way from any other thread.
        self._report_done([tid for tid, _ in good], notify=False)
        for _, want in good:
            _settle(want.future)
        trace("copy batch: settled")
        self._after_settle([want.future for _, want in good])

    def _after_settle(self, futures: list, *, notify: bool = True) -> None:
        """Just settled ``futures``: report the completions (``notify``, see :meth:`_notify_done`), then let
        threads waiting on them take the GIL before this one goes on (:func:`_handoff`). The event thread
        does the latter right after sending its next poll (:meth:`_poll_sent`), so that poll, which carries
        the completions, never waits behind a woken waiter's own work."""
        if self._is_event_thread():
            if any(getattr(f, "_inside", 0) for f in futures):
                if len(self._handoffs) > 256:  # a link that never calls _poll_sent (a test's): stay bounded
                    self._handoffs.clear()
                self._handoffs.extend(futures)
            return
        if notify:
            self._notify_done()
        _handoff(futures)

    def _poll_sent(self) -> None:
        """The event thread sent its poll (GIL-free wait ahead): now hand the GIL to the receivers it settled."""
        if self._handoffs:
            futures, self._handoffs = self._handoffs, []
            _handoff(futures)

    def _report_done(self, tids: list[int], *, notify: bool = True) -> None:
        """Queue ``complete`` for finished transfers. The event thread sends them with its next poll (no
        message of their own); any other thread sends them at once, one-way (:meth:`_flush_done`).
        ``notify=False``: the caller calls :meth:`_notify_done` once it settled its futures (their
        waiters wake first)."""
        if not tids:
            return
        with self._lock:
            self._done_items.extend({"tid": tid, "ok": True} for tid in tids)
        if notify:
            self._notify_done()

    def _notify_done(self) -> None:
        if self._is_event_thread():  # the event thread's next poll carries them
            return
        if getattr(self._helper, "on", False):  # a copy thread: nothing waits on it
            self._flush_done()
            return
        # The caller's own thread (a small receive copied inline): its futures are settled, and the send
        # (pack, system call: ~50 us on the 4 KiB path) would hold up the call's return. The thread reading
        # events sends them (woken through its role's pipe: one write here, where handing the send to a copy
        # thread cost the caller ~20-50 us), else a copy thread; a request of this client made meanwhile
        # carries them itself (see _call), so the broker still learns of each before any later request.
        role = self._role
        if role is not None and not self._poll_over and role.holder is not None:
            role.wake()
            return
        try:
            self._run_in_pool(self._flush_done)
        except RuntimeError:  # the pool is shut down (closing): send them here
            self._flush_done()

    def _take_done(self) -> list[dict[str, Any]]:
        """Queued completions and those the broker may not have read yet, for a request to carry: the broker
        completes each transfer once and ignores repeats, so every request after a receive sees it done."""
        with self._lock:
            items, self._done_items = self._done_items, []
            for it in items:
                self._unacked[it["tid"]] = it
            return list(self._unacked.values()) if self._unacked else []

    def _acked(self, items: list[dict[str, Any]]) -> None:
        """The broker answered a request that carried ``items``: it has read them."""
        if items:
            with self._lock:
                for it in items:
                    self._unacked.pop(it["tid"], None)

    def _flush_done(self) -> None:
        """Send the queued completions, on this thread: one-way (nothing waits for an answer) where the
        link offers it, on the request connection, so the broker learns each before any later request
        of this client (:meth:`_call` waits for a send in progress). Each of those receives was settled
        already: its bytes were in and its source stayed valid to the end."""
        with self._flush_lock:
            with self._lock:
                items, self._done_items = self._done_items, []
            if not items:
                return
            notify = getattr(self.link, "notify", None)
            try:
                if notify is not None:
                    notify("complete_many", {"items": items})
                    return
                results = self.link.call("complete_many", {"items": items})["results"]
            except Exception as exc:
                log.warning("devobj: could not report %d finished receives to the broker: %s", len(items), exc)
                return
            for item, r in zip(items, results):
                if not r.get("ok", True):
                    log.info("devobj: broker on finished transfer %s: %s", item["tid"], r.get("message"))

    def _complete(self, t: dict[str, Any], want: _Want) -> None:
        r = self._call("complete", {"tid": t["tid"], "ok": True})
        trace(f"completed {t['key']!r} at the broker")
        log.debug("devobj: complete %r (transfer %s) -> %s", t["key"], t["tid"], r)
        if t["kind"] == "bcast":
            return  # settled by transfer_done, once every receiver has it
        self._settle_completed(t, want, r)

    def _settle_completed(self, t: dict[str, Any], want: _Want, r: dict[str, Any]) -> None:
        with self._lock:
            self._inflight.pop(t["tid"], None)
        if r.get("ok", True):
            _settle(want.future)
        else:  # e.g. the owner vanished mid-copy: never report a half-received object as done
            _settle(want.future, error_from(r.get("error"), r.get("message", "")))


__all__ = ["INLINE_COPY_BYTES", "PULL_MAX_BYTES", "CopyReceiver"]
