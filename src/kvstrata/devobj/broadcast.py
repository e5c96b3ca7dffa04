"""The broadcast receiver's side of device objects: one copying process per GPU.

The broker groups a broadcast's receivers by GPU (:meth:`~kvstrata.devobj.broker.DeviceBroker._plan_broadcast`).
A group's *leader* pulls the object chunk by chunk from its predecessor (the sender, or the previous
GPU's leader) on its own GPU's stream, so the receiving GPU's copy engines do the work, and copies
every chunk on to its group's *members* on a second stream, behind that chunk's pull
(:class:`~kvstrata.devobj.chain.FanOut`). Members only export their buffers and a progress counter
to their leader (``member_ready``) and watch the counter; they issue no copies. So on every GPU one
CUDA context copies: several contexts copying on one GPU share it by time slices (on the H200 pair
each got about half its copy rate, and a context blocked in a stream wait kept its slice).

A leader that another leader pulls from exports its buffers and its own counter to it first
(``chain_ready``), as it starts. A member's counter advances only once the leader's copies into it
completed; a failing leader drains its queued copies and then writes ``FAILED`` into its members'
counters, and a member that is aborted waits (bounded) for that, or for its leader to be gone, before
its caller gets the buffers back. :class:`BroadcastReceiver` is a part of
:class:`~kvstrata.devobj.api.DeviceObjects` (it uses its streams, events, broker link and pool).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstrata import errors
from kvstrata._proc import pid_alive
from kvstrata.devobj._core import LOCAL_EXPORTS as _LOCAL
from kvstrata.devobj._core import Want as _Want
from kvstrata.devobj._core import settle as _settle
from kvstrata.devobj.chain import FanOut, Member, chunk_size, plan_chunks, pump, spans
from kvstrata.devobj.debug import trace, wait_event
from kvstrata.devobj.ipc import copy_into, export_tensor, flat_bytes
from kvstrata.devobj.progress import FAILED, Progress, gpu_ops_available, gpu_wait, gpu_write
from kvstrata.errors import InvalidValue

log = logging.getLogger(__name__)

#: longest wait of an aborted member for its leader to stop writing into its buffers
MEMBER_STOP_WAIT = 2.0


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor, *, kernel: bool) -> None:
    """Copy one byte range: a copy-engine memcpy, or (``kernel``, 8-byte aligned) an elementwise kernel."""
    if kernel and dst.numel() % 8 == 0 and dst.storage_offset() % 8 == 0 and src.storage_offset() % 8 == 0:
        torch.mul(src.view(torch.int64), 1, out=dst.view(torch.int64))
    else:
        dst.copy_(src, non_blocking=True)


def _aborted(want: _Want, what: str) -> BaseException:
    """A fresh error for a broadcast step whose future was settled under it (the broker aborted it)."""
    exc = want.future.exception() if not want.future.cancelled() else None
    return errors.ServerError(f"{what}: aborted ({type(exc).__name__}: {exc})" if exc else f"{what}: aborted")


@dataclass
class ChainLink:
    """A broadcast receiver's export (to its successor or its leader): its buffers (``_LOCAL`` token)
    and progress counter, and the predecessor's counter it reads."""

    token: str | None = None
    progress: Progress | None = None
    pred_progress: Progress | None = None

    def release(self) -> None:
        if self.token:
            _LOCAL.pop(self.token, None)
            self.token = None
        for p in (self.progress, self.pred_progress):
            if p is not None:
                p.close()
        self.progress = self.pred_progress = None

    def abandon(self) -> None:
        """Like :meth:`release`, but the counters stay mapped and registered for good: a stream that
        did not drain may still wait on or write them (unmapping would fault the GPU)."""
        for p in (self.progress, self.pred_progress):
            if p is not None:
                p.unlink()
                _ABANDONED.append(p)
        self.progress = self.pred_progress = None
        self.release()


# Counters of broadcast steps whose GPU work never drained (see ChainLink.abandon): one page each.
_ABANDONED: list[Progress] = []


@dataclass(eq=False)
class _Step:
    """One receiver's part in a broadcast, from its match to the end of its step thread."""

    role: str  # leader | member
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # leader: members' exports
    running: bool = False  # its thread writes into (member: watches) the buffers: an abort is handed to it
    abort: BaseException | None = None


class BroadcastReceiver:
    """The broadcast methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    # -- dispatch ---------------------------------------------------------------------------------
    def _bcast_steps(self) -> dict[int, _Step]:
        steps = self.__dict__.get("_bcast_step_map")
        if steps is None:
            with self._lock:
                steps = self.__dict__.setdefault("_bcast_step_map", {})
        return steps

    def _start_bcast(self, t: dict[str, Any], want: _Want) -> None:
        """A broadcast matched: a member exports to its leader; a leader whose source is the sender
        starts now, one that pulls from another leader when that one's export arrives (``chain_pred``)."""
        role = t.get("role", "leader")
        with self._lock:  # a member's export may have reached a leader's inbox already (_on_chain_event)
            step = self._bcast_steps().setdefault(t["tid"], _Step(role))
            step.role, step.running = role, role == "member"
        if role == "member":
            self._spawn_step(t, want, self._member_step, step)
        elif t.get("pred", "sender" if t["position"] == 0 else "chain") == "sender":
            rec = t["record"]
            self._start_bcast_step(t, want, dict(rec, client=rec["owner"]))

    def _on_chain_event(self, want: _Want, ev: dict[str, Any]) -> None:
        """``chain_pred`` (our predecessor's export: start) or ``member_ready`` (a member's export)."""
        if ev["type"] == "chain_pred":
            self._start_bcast_step(want.transfer, want, ev["pred"])
        elif ev["type"] == "member_ready" and not want.future.done():
            with self._lock:  # may come before _start_bcast registered the step (the poller runs meanwhile)
                step = self._bcast_steps().setdefault(want.tid, _Step("leader"))
            step.inbox.put(ev["member"])

    def _start_bcast_step(self, t: dict[str, Any], want: _Want, pred: dict[str, Any]) -> None:
        """Run this leader's step on a thread of its own: it waits on its predecessor and its members for
        the whole broadcast, so on the copy pool it would hold back this client's other copies. (No cycle
        can form between steps: a leader learns of its predecessor only once that one's step runs, the
        first leaders' source is complete, and members wait on nobody.)"""
        self._spawn_step(t, want, self._bcast_step, pred)

    def _spawn_step(self, t: dict[str, Any], want: _Want, fn, arg: Any) -> None:
        def run() -> None:
            try:
                self._thread_init()
                fn(t, want, arg)
            except BaseException as exc:  # report, never leave the broker or the caller waiting
                self._fail_transfer(t, want, exc)
            finally:
                with self._lock:
                    self._bcast_steps().pop(t["tid"], None)

        threading.Thread(target=run, name=f"kvstrata-bcast-{t['tid']}", daemon=True).start()

    def _plan(self, rec: dict[str, Any]) -> list[tuple[int, int, int]]:
        requested = int(rec.get("chunk_bytes") or self.config.chunk_bytes)  # the sender always sends it
        return plan_chunks(rec["tensors"], chunk_size(rec["tensors"], requested))

    def _my_export(self, rec: dict[str, Any], want: _Want, link: ChainLink) -> dict[str, Any]:
        """Export ``want``'s buffers and a new progress counter (0: nothing in them yet) into ``link``."""
        link.progress = Progress.create()
        link.token = uuid.uuid4().hex
        _LOCAL[link.token] = (want.tensors, [])
        return {
            "key": rec["key"],
            "tensors": rec["tensors"],
            "device": self._device_info(),
            "node_id": self.config.node_id,
            "pid": os.getpid(),
            "local": link.token,
            "handles": [export_tensor(x) for x in want.tensors] if self._cuda else [],
            "events": [],
            "progress": link.progress.name,
        }

    # -- leader -----------------------------------------------------------------------------------
    def _bcast_step(self, t: dict[str, Any], want: _Want, pred: dict[str, Any]) -> None:
        """Pull chunk by chunk from ``pred`` and copy each chunk on to this group's members."""
        rec = t["record"]
        pos, n_recv = t["position"], t["receivers"]
        what = f"broadcast of {rec['key']!r} at position {pos} of {n_recv}"
        plan = self._plan(rec)
        link = ChainLink()
        with self._lock:
            step = self._bcast_steps().get(t["tid"])
            if step is None:  # forgotten: the broadcast was aborted (its future is settled)
                step = _Step("leader")
            elif not want.future.done():
                # Copying into our buffers from now on: an abort is handed to this thread (_bcast_done), which
                # settles the future once nothing writes into them any more.
                step.running = True
        started = time.perf_counter()
        gpu_waits = self._cuda and self.config.broadcast_wait == "stream"
        if gpu_waits and not gpu_ops_available():
            log.warning("devobj: broadcast_wait='stream' needs cuda-bindings; %s waits on the host", what)
            gpu_waits = False
        wait_ptr = None
        pulls: list[Any] = []  # pull end events handed out and not yet seen complete
        fan: FanOut | None = None
        try:
            if want.future.done():  # aborted before it started
                raise _aborted(want, what)
            trace(f"{what}: step starts")
            # Export first: the next leader opens our buffers while we open our predecessor's. Our
            # counter is 0 until our first chunk lands, so an early export exposes nothing unfinished.
            if t.get("successor", "group" not in t and pos < n_recv - 1):
                self._call("chain_ready", {"tid": t["tid"], "export": self._my_export(rec, want, link)})
                trace(f"{what}: exported to the successor")
            try:
                src, _ = self._sources(pred, pred["client"])
            except (RuntimeError, OSError) as exc:  # e.g. CUDA "invalid resource handle": its exporter died
                raise errors.ServerError(
                    f"{what}: could not open the predecessor's buffers ({type(exc).__name__}: {exc}); "
                    "it probably went away"
                ) from exc
            trace(f"{what}: source opened")
            if pred.get("progress"):  # a leader; the sender's data is complete at publish
                try:
                    link.pred_progress = Progress.open(pred["progress"])
                except FileNotFoundError:
                    raise errors.ServerError(
                        f"{what}: the predecessor's progress counter is gone (it failed or went away)"
                    ) from None
            pred_p, mine_p = link.pred_progress, link.progress
            # "stream": the GPU waits for the predecessor's count and advances ours; the host only
            # queues the chunks and watches for their end, an abort or a stall.
            wait_ptr = pred_p.device_ptr() if gpu_waits and pred_p is not None else None
            write_ptr = mine_p.device_ptr() if gpu_waits and mine_p is not None else None
            enqueue, recycle = self._puller(want, src, plan, pulls, wait_ptr=wait_ptr, write_ptr=write_ptr)
            copy, recycle_fan = self._fan_copier(want, plan)
            fan = FanOut(
                int(t.get("members", 0)),
                attach=lambda: self._attach_members(step, rec, what),
                copy=copy,
                recycle=recycle_fan,
            )
            pump(
                len(plan),
                enqueue,
                available=pred_p.value if pred_p is not None and wait_ptr is None else lambda: len(plan),
                publish=mine_p.advance if mine_p is not None and write_ptr is None else None,
                aborted=lambda: step.abort or (_aborted(want, what) if want.future.done() else None),
                recycle=recycle,
                fanout=fan,
                timeout=self.config.copy_timeout,
                what=what,
            )
        except BaseException as exc:
            if link.progress is not None:
                link.progress.fail()  # the next leader stops now, before the broker's abort reaches it
            if wait_ptr is not None:
                link.pred_progress.release_waiters()  # our stream's pending GPU waits end (the copies are moot)
            drained = self._drain([pulls, fan.events() if fan is not None else []], what)
            if fan is not None:
                if fan.members:  # the broker first, so that everyone's error names this failure
                    self._report_failed(t, exc)
                fan.stop()  # after the drain: the members' buffers are theirs again
                fan.close()
            self._refuse_members(step)
            if drained or not gpu_waits:
                link.release()
            else:
                link.abandon()
            with self._lock:
                step.running = False
                abort = step.abort
            if abort is not None and abort is not exc:
                raise abort from exc  # the broker's reason, now that our buffers are the caller's again
            raise
        fan.close()
        with self._lock:
            step.running = False  # every chunk landed: an abort from now on settles the future at once
            abort = step.abort
        if abort is not None:
            link.release()
            raise abort
        copied = time.perf_counter()
        trace(f"{what}: all chunks copied ({len(fan.members)} members)")
        self._log_receive(rec, pos, len(plan), started, copied, role="leader")
        with self._lock:
            settled = want.future.done()
            if not settled:  # released by _bcast_done once every receiver has it (the successor reads ours)
                want.chain = link
        if settled:
            link.release()
        log.debug("devobj: %s copied %d chunks in %.2f ms", what, len(plan), (copied - started) * 1e3)
        try:
            self._complete(t, want)
        except BaseException:  # the caller (_spawn_step) fails the transfer; the export goes now
            with self._lock:
                link, want.chain = want.chain, None
            if link is not None:
                link.release()
            raise

    def _report_failed(self, t: dict[str, Any], exc: BaseException) -> None:
        """Tell the broker this step failed (it aborts the broadcast); the later report finds it done."""
        try:
            self._call("complete", {"tid": t["tid"], "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc2:
            log.debug("devobj complete(ok=False): %s", exc2)

    def _puller(
        self,
        want: _Want,
        src: list[torch.Tensor],
        plan: list[tuple[int, int, int]],
        pending: list[Any],
        *,
        wait_ptr: int | None = None,
        write_ptr: int | None = None,
    ):
        """``(enqueue(c) -> event | None, recycle(event))``: chunk ``c`` from ``src`` into ``want.tensors``.

        On this client's stream of its own GPU: a chunk on another GPU is read over the link by our copy
        engines (pull; on the H200 pair as fast as a push), so no other GPU sees work of this process.
        ``wait_ptr`` / ``write_ptr``: GPU-side progress (broadcast_wait="stream"): each chunk's copy
        waits on the stream for the predecessor's count to pass it, then advances ours.
        """
        dst_b = [flat_bytes(x) for x in want.tensors]
        src_b = [flat_bytes(x) for x in src]
        if not self._cuda:

            def copy_now(c: int) -> None:
                j, off, n = plan[c]
                dst_b[j][off : off + n].copy_(src_b[j][off : off + n])

            return copy_now, None
        dev = self.device.index
        kernel = self.config.same_gpu_copy == "kernel"
        stream = self._streams.get(dev)
        started = []

        def enqueue(c: int) -> Any:
            if not started:
                started.append(True)
                if want.after is not None:
                    stream.wait_event(want.after)  # our buffers are free once the caller's stream got here
            j, off, n = plan[c]
            if wait_ptr is not None:  # GPU-side: the copy waits for the predecessor's count
                gpu_wait(stream, wait_ptr, c + 1)
            d, x = dst_b[j][off : off + n], src_b[j][off : off + n]
            if x.device.index == dev:
                with torch.cuda.stream(stream):
                    _copy_bytes(d, x, kernel=kernel)
            else:
                copy_into([d], [x], self._streams, dev)
            if write_ptr is not None:  # after the copy's end (the write orders it before the count)
                gpu_write(stream, write_ptr, c + 1)
            ev = self._events.get(dev)
            ev.record(stream)
            pending.append(ev)
            return ev

        def recycle(ev: Any) -> None:
            pending.remove(ev)  # the oldest: O(1) in practice
            self._events.put([ev], dev)

        return enqueue, recycle

    def _fan_stream(self) -> torch.cuda.Stream:
        """This client's second stream on its GPU: the copies to group members, beside the pulls."""
        s = self.__dict__.get("_bcast_fan_stream")
        if s is None:
            with self._lock:
                s = self.__dict__.get("_bcast_fan_stream")
                if s is None:
                    s = self._bcast_fan_stream = torch.cuda.Stream(self.device)
        return s

    def _fan_copier(self, want: _Want, plan: list[tuple[int, int, int]]):
        """``(copy, recycle)`` for :class:`FanOut`: chunks of ``want.tensors`` into members' buffers."""
        mine = [flat_bytes(x) for x in want.tensors]

        def ranges(start: int, stop: int):
            return [(j, slice(off, off + n)) for j, off, n in spans(plan, start, stop)]

        if not self._cuda:

            def copy_now(members: list[Member], start: int, stop: int, after: Any) -> None:
                for j, s in ranges(start, stop):
                    for m in members:
                        m.target[j][s].copy_(mine[j][s])

            return copy_now, None
        dev = self.device.index
        kernel = self.config.same_gpu_copy == "kernel"
        fs = self._fan_stream()

        def copy(members: list[Member], start: int, stop: int, after: Any) -> Any:
            if after is not None:
                fs.wait_event(after)  # those chunks' pulls (in stream order: all of them) are complete
            with torch.cuda.stream(fs):
                for j, s in ranges(start, stop):
                    for m in members:
                        _copy_bytes(m.target[j][s], mine[j][s], kernel=kernel)
            ev = self._events.get(dev)
            ev.record(fs)
            return ev

        return copy, lambda ev: self._events.put([ev], dev)

    def _attach_members(self, step: _Step, rec: dict[str, Any], what: str) -> list[Member]:
        """Members whose exports arrived: their counters opened first (a member that gave up first took
        its name back, see :meth:`Progress.claim`, so we never write into buffers it reclaimed)."""
        out: list[Member] = []
        try:
            while True:
                try:
                    exp = step.inbox.get_nowait()
                except queue.Empty:
                    return out
                where = f"{what}: the member at position {exp.get('position')}"
                try:
                    prog = Progress.open(exp["progress"])
                except FileNotFoundError:
                    raise errors.ServerError(f"{where} gave up before its buffers arrived") from None
                try:
                    dst, _ = self._sources(exp, exp["client"])
                    sizes = [x.numel() * x.element_size() for x in dst]
                    if sizes != [int(sp["nbytes"]) for sp in rec["tensors"]]:
                        raise InvalidValue(f"tensor_lists: sizes {sizes} differ from the source's")
                except BaseException as exc:
                    prog.fail()
                    prog.close()
                    raise errors.ServerError(f"{where}: its buffers could not be opened ({exc})") from exc
                out.append(Member(exp["position"], [flat_bytes(x) for x in dst], prog.advance, prog.fail, prog.close))
        except BaseException:
            for m in out:
                m.fail()
                m.close()
            raise

    def _refuse_members(self, step: _Step) -> None:
        """A failed leader: members whose exports arrived but were never attached stop waiting at once."""
        while True:
            try:
                exp = step.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                p = Progress.open(exp["progress"])
            except (FileNotFoundError, ValueError, KeyError):
                continue
            p.fail()
            p.close()

    def _drain(self, event_lists: list[list[Any]], what: str) -> bool:
        """A failed step: let its queued copies end before the buffers are handed back (bounded); False
        when they did not."""
        if not self._cuda:
            return True
        lasts = [evs[-1] for evs in event_lists if evs]
        try:  # queued chunks take milliseconds; a copy stuck for longer is not waited for again
            for ev in lasts:
                wait_event(ev, min(self.config.copy_timeout, 2.0), f"{what}: draining queued copies")
        except Exception as exc:
            log.warning("devobj: %s", exc)
            return False
        for evs in event_lists:
            self._events.put(list(evs), self.device.index)
            evs.clear()
        return True

    # -- member -----------------------------------------------------------------------------------
    def _member_step(self, t: dict[str, Any], want: _Want, step: _Step) -> None:
        """Export our buffers to the group's leader and wait for our counter to say they are complete."""
        rec = t["record"]
        pos = t["position"]
        what = f"broadcast of {rec['key']!r} at position {pos} of {t['receivers']} (member of {t['leader']})"
        n = len(self._plan(rec))
        link = ChainLink()
        leader_pid = None
        refused = False
        started = time.perf_counter()
        try:
            if want.future.done():
                raise _aborted(want, what)
            trace(f"{what}: step starts")
            if self._cuda and want.after is not None:  # the leader writes our buffers: not before this
                wait_event(want.after, self.config.copy_timeout, f"{what}: the caller's stream reaching the call")
            r = self._call("member_ready", {"tid": t["tid"], "export": self._my_export(rec, want, link)})
            if not r.get("ok", True):  # the broadcast was aborted meanwhile
                refused = True
                raise errors.ServerError(f"{what}: {r.get('message')}")
            leader_pid = r.get("leader_pid")
            trace(f"{what}: exported to the leader")
            mine = link.progress
            pump(
                n,
                lambda c: None,
                available=mine.value,
                publish=None,
                aborted=lambda: step.abort or (_aborted(want, what) if want.future.done() else None),
                timeout=self.config.copy_timeout,
                what=what,
            )
        except BaseException as exc:
            if self._member_stopped(link, n, leader_pid, what) or refused:
                # The broker knows the cause already (a failed leader tells it before its members): its
                # abort, naming the cause, is on its way.
                deadline = time.monotonic() + 0.5
                while step.abort is None and time.monotonic() < deadline:
                    time.sleep(1e-3)
            with self._lock:
                step.running = False
                err = step.abort or exc
            link.release()
            self._fail_transfer(t, want, err)
            return
        copied = time.perf_counter()
        with self._lock:
            step.running = False
            err = step.abort
        link.release()  # the leader is done with our buffers and counter
        trace(f"{what}: all chunks landed")
        self._log_receive(rec, pos, n, started, copied, role="member")
        if err is not None:
            self._fail_transfer(t, want, err)
            return
        self._complete(t, want)

    def _member_stopped(self, link: ChainLink, n: int, leader_pid: int | None, what: str) -> bool:
        """An aborted member: return once the leader writes no more into our buffers (bounded); True when
        the leader said it failed."""
        p = link.progress
        if p is None or p.claim():
            return False  # the leader never opened our counter, and now cannot: it never copies into us
        deadline = time.monotonic() + MEMBER_STOP_WAIT
        while time.monotonic() < deadline:
            v = p.value()
            if v == FAILED or v >= n or (leader_pid is not None and not pid_alive(leader_pid)):
                return v == FAILED
            time.sleep(1e-3)
        log.warning("devobj: %s: the leader did not confirm it stopped within %g s", what, MEMBER_STOP_WAIT)
        return False

    # -- both -------------------------------------------------------------------------------------
    def _log_receive(self, rec: dict[str, Any], pos: int, chunks: int, started: float, copied: float, **kw) -> None:
        with self._lock:
            self._bcast_log.append(
                {
                    "key": rec["key"],
                    "position": pos,
                    "device": str(self.device),
                    "chunks": chunks,
                    "started": started,
                    "copied": copied,
                    **kw,
                }
            )

    def _bcast_done(self, want: _Want, exc: BaseException | None) -> None:
        with self._lock:
            step = self._bcast_steps().get(want.tid) if want.tid is not None else None
            if exc is not None and step is not None and step.running:
                step.abort = exc  # its step thread settles it once nothing writes into its buffers any more
                return
            if step is not None and want.tid is not None:  # a leader's thread keeps its own reference
                self._bcast_steps().pop(want.tid, None)
        _settle(want.future, exc)
        with self._lock:  # after settling: a step that finishes now sees the future done and releases itself
            link, want.chain = want.chain, None
        if link is not None:
            link.release()

    def broadcast_log(self) -> list[dict[str, Any]]:
        """This client's recent broadcast receives: key, chain position, role (``leader`` copies, ``member``
        is copied into), chunks, and ``time.perf_counter()`` when its step started and when its last
        chunk landed (for benchmarks; the last 64)."""
        with self._lock:
            return list(self._bcast_log)


__all__ = ["MEMBER_STOP_WAIT", "BroadcastReceiver", "ChainLink"]
