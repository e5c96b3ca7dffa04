"""The broadcast receiver's side of device objects: one step of the chain per receiver.

Every receiver exports its destination buffers and a progress counter to its successor at once,
opens its predecessor's buffers, and copies chunk by chunk behind the predecessor's counter
(:func:`kvstrata.devobj.chain.pump`), advancing its own as each chunk lands. Chunks from another GPU
are pushed by that GPU's copy engines, so no work of this process waits on the receiving GPU while
another process (the next receiver on that GPU) copies there. :class:`BroadcastReceiver` is a part of
:class:`~kvstrata.devobj.api.DeviceObjects` (it uses its streams, events, broker link and pool).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata import errors
from kvstrata.devobj._core import LOCAL_EXPORTS as _LOCAL
from kvstrata.devobj._core import Want as _Want
from kvstrata.devobj._core import settle as _settle
from kvstrata.devobj.chain import plan_chunks, pump
from kvstrata.devobj.debug import trace, wait_event
from kvstrata.devobj.ipc import copy_into, export_tensor, flat_bytes
from kvstrata.devobj.progress import Progress, gpu_ops_available, gpu_wait, gpu_write

log = logging.getLogger(__name__)


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
    """A broadcast receiver's export to its successor: its buffers (``_LOCAL`` token) and progress counter."""

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


class BroadcastReceiver:
    """The broadcast methods of :class:`~kvstrata.devobj.api.DeviceObjects`."""

    # -- broadcast receiver -----------------------------------------------------------------------
    def _start_bcast_step(self, t: dict[str, Any], want: _Want, pred: dict[str, Any]) -> None:
        """Run this receiver's chain step on a thread of its own: it waits on its predecessor's progress
        for the whole broadcast, so on the copy pool it would hold back this client's other copies.
        (No cycle can form between steps: a successor learns of its predecessor only once that one's
        step runs, and the first position's source is complete.)"""

        def run() -> None:
            try:
                self._thread_init()
                self._bcast_step(t, want, pred)
            except BaseException as exc:  # report, never leave the broker or the caller waiting
                self._fail_transfer(t, want, exc)

        threading.Thread(target=run, name=f"kvstrata-bcast-{t['tid']}", daemon=True).start()

    def _bcast_step(self, t: dict[str, Any], want: _Want, pred: dict[str, Any]) -> None:
        """Copy chunk by chunk from the predecessor ``pred`` while exporting to the successor at once."""
        rec = t["record"]
        pos, last = t["position"], t["position"] == t["receivers"] - 1
        what = f"broadcast of {rec['key']!r} at position {pos} of {t['receivers']}"
        plan = plan_chunks(rec["tensors"], int(rec.get("chunk_bytes") or self.config.chunk_bytes))
        link = ChainLink()
        started = time.perf_counter()
        gpu_waits = self._cuda and self.config.broadcast_wait == "stream"
        if gpu_waits and not gpu_ops_available():
            log.warning("devobj: broadcast_wait='stream' needs cuda-bindings; %s waits on the host", what)
            gpu_waits = False
        wait_ptr = None
        try:
            if want.future.done():  # aborted before it started
                raise _aborted(want, what)
            trace(f"{what}: step starts")
            # Export first: the successor opens our buffers while we open our predecessor's (the
            # opens of large buffers take ~1 ms each and ran one after another down the chain). Our
            # counter is 0 until our first chunk lands, so an early export exposes nothing unfinished.
            if not last:
                link.progress = Progress.create()
                link.token = uuid.uuid4().hex
                _LOCAL[link.token] = (want.tensors, [])
                export = {
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
                self._call("chain_ready", {"tid": t["tid"], "export": export})
                trace(f"{what}: exported to the successor")
            try:
                src, _ = self._sources(pred, pred["client"])
            except (RuntimeError, OSError) as exc:  # e.g. CUDA "invalid resource handle": its exporter died
                raise errors.ServerError(
                    f"{what}: could not open the predecessor's buffers ({type(exc).__name__}: {exc}); "
                    "it probably went away"
                ) from exc
            trace(f"{what}: source opened")
            if pred.get("progress"):  # a receiver; the sender's data is complete at publish
                try:
                    link.pred_progress = Progress.open(pred["progress"])
                except FileNotFoundError:
                    raise errors.ServerError(
                        f"{what}: the predecessor's progress counter is gone (it failed or went away)"
                    ) from None
            pred_p, mine_p = link.pred_progress, link.progress
            # "stream": the GPU waits for the predecessor's count and advances ours; the host only
            # queues the chunks (all at once) and watches for their end, an abort or a stall.
            wait_ptr = pred_p.device_ptr() if gpu_waits and pred_p is not None else None
            write_ptr = mine_p.device_ptr() if gpu_waits and mine_p is not None else None
            enqueue, recycle = self._chunk_copier(want, src, plan, wait_ptr=wait_ptr, write_ptr=write_ptr)
            pump(
                len(plan),
                enqueue,
                available=pred_p.value if pred_p is not None and wait_ptr is None else lambda: len(plan),
                publish=mine_p.advance if mine_p is not None and write_ptr is None else None,
                aborted=lambda: _aborted(want, what) if want.future.done() else None,
                recycle=recycle,
                timeout=self.config.copy_timeout,
                what=what,
            )
        except BaseException:
            if link.progress is not None:
                link.progress.fail()  # the successor stops now, before the broker's abort reaches it
            if wait_ptr is not None:
                link.pred_progress.release_waiters()  # our stream's pending GPU waits end (the copies are moot)
            if self._drain(want, what) or not gpu_waits:
                link.release()
            else:
                link.abandon()
            raise
        copied = time.perf_counter()
        trace(f"{what}: all chunks copied")
        with self._lock:
            self._bcast_log.append(
                {
                    "key": rec["key"],
                    "position": pos,
                    "device": str(self.device),
                    "chunks": len(plan),
                    "started": started,
                    "copied": copied,
                }
            )
            settled = want.future.done()
            if not settled:  # released by _bcast_done once every receiver has it (the successor reads ours)
                want.chain = link
        if settled:
            link.release()
        log.debug("devobj: %s copied %d chunks in %.2f ms", what, len(plan), (copied - started) * 1e3)
        try:
            self._complete(t, want)
        except BaseException:  # the caller (_start_bcast_step) fails the transfer; the export goes now
            with self._lock:
                link, want.chain = want.chain, None
            if link is not None:
                link.release()
            raise

    def _chunk_copier(
        self,
        want: _Want,
        src: list[torch.Tensor],
        plan: list[tuple[int, int, int]],
        *,
        wait_ptr: int | None = None,
        write_ptr: int | None = None,
    ):
        """``(enqueue(c) -> event | None, recycle(event))`` for chunk copies from ``src`` into ``want.tensors``.

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
        pending: list[Any] = []  # events handed out and not yet seen complete (see _drain)
        want.chain_events = pending
        event_device: dict[int, int] = {}
        ready_streams: set[int] = set()

        def copy_stream(src_dev: int) -> torch.cuda.Stream:
            # A chunk from another GPU is pushed by that GPU's copy engine, on this client's stream
            # there, with no work at all queued on our GPU: another process's copies into our GPU
            # (the next receiver of the chain) would otherwise wait out our context's time slices
            # (on the H200 pair a same-GPU successor's first chunk waited 10 ms behind our stream waits).
            cs = self._streams.get(src_dev)
            if src_dev not in ready_streams:
                ready_streams.add(src_dev)
                cs.wait_event(want.after)
            return cs

        def enqueue(c: int) -> Any:
            j, off, n = plan[c]
            src_dev = src[j].device.index
            cs = copy_stream(src_dev)
            if wait_ptr is not None:  # GPU-side: the copy waits for the predecessor's count
                gpu_wait(cs, wait_ptr, c + 1)
            d, x = dst_b[j][off : off + n], src_b[j][off : off + n]
            if src_dev == dev:
                with torch.cuda.stream(cs):
                    _copy_bytes(d, x, kernel=kernel)
            else:
                copy_into([d], [x], self._streams, src_dev)
            if write_ptr is not None:  # after the copy's end (the write orders it before the count)
                gpu_write(cs, write_ptr, c + 1)
            ev = self._events.get(src_dev)
            ev.record(cs)
            event_device[id(ev)] = src_dev
            pending.append(ev)
            return ev

        def recycle(ev: Any) -> None:
            pending.remove(ev)  # the oldest: O(1) in practice
            self._events.put([ev], event_device.pop(id(ev), dev))

        return enqueue, recycle

    def _drain(self, want: _Want, what: str) -> bool:
        """A failed step: let its queued chunk copies end before the caller gets its buffers back
        (bounded); False when they did not."""
        pending = want.chain_events
        if not pending:
            return True
        try:  # queued chunks take milliseconds; a copy stuck for longer is not waited for again
            wait_event(pending[-1], min(self.config.copy_timeout, 2.0), f"{what}: draining queued copies")
        except Exception as exc:
            log.warning("devobj: %s", exc)
            return False
        self._events.put(list(pending), self.device.index)
        pending.clear()
        return True

    def _bcast_done(self, want: _Want, exc: BaseException | None) -> None:
        _settle(want.future, exc)
        with self._lock:  # after settling: a step that finishes now sees the future done and releases itself
            link, want.chain = want.chain, None
        if link is not None:
            link.release()

    def broadcast_log(self) -> list[dict[str, Any]]:
        """This client's recent broadcast receives: key, chain position, chunks, and ``time.perf_counter()``
        when its step started and when its last chunk landed (for benchmarks; the last 64)."""
        with self._lock:
            return list(self._bcast_log)


__all__ = ["BroadcastReceiver", "ChainLink"]
