"""Between-nodes data path: NCCL send/recv over one 2-rank communicator per (source, destination) pair.

Selected by the broker when the two sides are on different nodes (their ``node_id`` differ) or when
the source forced ``transport="nccl"`` (so it can be tested on one node). The destination creates
the communicator's unique id when the pair first meets and posts it through the broker (the
``pair_uid`` request); the broker then sends the source its queued ``send`` events.

Deadlock freedom: a pair is directional (source is rank 0, destination rank 1), so A->B and B->A use
two communicators, each with its own thread and stream; sends and receives of one pair run strictly
in the broker-assigned sequence order on both sides, so they always match up.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # pragma: no cover - depends on the GPU image
        raise RuntimeError("the NCCL device-object path needs CuPy with NCCL (pip install cupy-cuda12x)") from exc
    return nccl


def new_unique_id() -> list[int]:
    """A fresh NCCL unique id as a msgpack-able list of ints."""
    return list(_nccl().get_unique_id())


def _communicator(nccl: Any, uid: list[int], rank: int) -> Any:
    """A 2-rank communicator from a unique id that crossed msgpack as a list of ints.

    CuPy 14 takes the id as ``bytes`` (what its ``get_unique_id`` returns), older CuPy as a tuple
    of (signed) chars; the list carries either form's values, so try bytes first.
    """
    try:
        return nccl.NcclCommunicator(2, bytes(x & 0xFF for x in uid), rank)
    except TypeError:
        return nccl.NcclCommunicator(2, tuple(uid), rank)


class Channel:
    """One side of one (source -> destination) pair: a communicator, a stream and an ordered op queue."""

    def __init__(self, *, rank: int, device: int, name: str) -> None:
        self.rank = rank
        self.device = device
        self._comm = None
        self._uid: list[int] | None = None
        self._heap: list[tuple[int, int, Callable[[], None], Callable[[str], None]]] = []
        self._next = 0
        self._tie = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._stream: torch.cuda.Stream | None = None
        self._thread = threading.Thread(target=self._run, name=f"kvstrata-nccl-{name}", daemon=True)
        self._thread.start()

    def set_uid(self, uid: list[int]) -> None:
        with self._cond:
            if self._uid is None:
                self._uid = list(uid)

    def submit(self, seq: int, op: Callable[[], None], fail: Callable[[str], None]) -> None:
        """Run ``op`` on the channel thread once every op with a smaller ``seq`` ran (``fail`` if aborted)."""
        with self._cond:
            if self._closed:
                fail("NCCL channel closed (peer went away)")
                return
            heapq.heappush(self._heap, (seq, next(self._tie), op, fail))
            self._cond.notify_all()

    def _run(self) -> None:
        torch.cuda.set_device(self.device)  # a new thread starts on GPU 0
        while True:
            with self._cond:
                while not self._closed and not (self._heap and self._heap[0][0] <= self._next):
                    self._cond.wait()
                if self._closed:
                    return
                _, _, op, fail = heapq.heappop(self._heap)
                self._next += 1
            try:
                op()
            except Exception as exc:  # the op reports its own failures; this keeps the channel alive
                log.exception("NCCL channel op failed")
                fail(f"NCCL op failed: {type(exc).__name__}: {exc}")

    def _ensure(self):
        if self._comm is None:
            nccl = _nccl()
            import cupy

            if self._uid is None:
                raise RuntimeError("NCCL pair has no unique id yet")
            with cupy.cuda.Device(self.device):
                self._comm = _communicator(nccl, self._uid, self.rank)
            self._stream = torch.cuda.Stream(self.device)
        return self._comm

    def send(self, tensors: list[torch.Tensor], ready: torch.cuda.Event | None) -> None:
        """Send ``tensors`` to rank 1 (channel thread only); returns when the send completed."""
        self._xfer(tensors, ready, send=True)

    def recv(self, tensors: list[torch.Tensor], ready: torch.cuda.Event | None) -> None:
        """Receive into ``tensors`` from rank 0 (channel thread only); returns when complete."""
        self._xfer(tensors, ready, send=False)

    def _xfer(self, tensors: list[torch.Tensor], ready: torch.cuda.Event | None, *, send: bool) -> None:
        nccl = _nccl()
        comm = self._ensure()
        s = self._stream
        if ready is not None:
            s.wait_event(ready)
        nccl.groupStart()
        try:
            for t in tensors:
                n = t.numel() * t.element_size()
                if send:
                    comm.send(t.data_ptr(), n, nccl.NCCL_UINT8, 1 - self.rank, s.cuda_stream)
                else:
                    comm.recv(t.data_ptr(), n, nccl.NCCL_UINT8, 1 - self.rank, s.cuda_stream)
        finally:
            nccl.groupEnd()
        s.synchronize()

    def abort(self) -> None:
        """Break the communicator (the peer went away) so a blocked send/recv returns with an error."""
        with self._cond:
            self._closed = True
            queued, self._heap = self._heap, []
            self._cond.notify_all()
        for _, _, _, fail in queued:
            fail("NCCL channel aborted (the peer went away, or a transfer of the pair failed)")
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception as exc:  # already broken: nothing more to release
                log.debug("NCCL abort: %s", exc)


class Channels:
    """All NCCL channels of one client, keyed by (source client, destination client)."""

    def __init__(self) -> None:
        self._channels: dict[tuple[str, str], Channel] = {}
        self._lock = threading.Lock()

    def get(self, src: str, dst: str, *, rank: int, device: int) -> Channel:
        with self._lock:
            ch = self._channels.get((src, dst))
            if ch is None:
                ch = self._channels[(src, dst)] = Channel(rank=rank, device=device, name=f"{src}->{dst}")
            return ch

    def reset(self, src: str, dst: str) -> None:
        """The broker reset this pair (one of its transfers failed): break its channel; the next transfer
        between the two makes a new one."""
        with self._lock:
            ch = self._channels.pop((src, dst), None)
        if ch is not None:
            ch.abort()

    def peer_gone(self, peer: str) -> None:
        with self._lock:
            gone = [k for k in self._channels if peer in k]
            chans = [self._channels.pop(k) for k in gone]
        for ch in chans:
            ch.abort()

    def close(self) -> None:
        with self._lock:
            chans = list(self._channels.values())
            self._channels.clear()
        for ch in chans:
            ch.abort()


def describe(t: dict[str, Any]) -> str:
    return f"{t['src']}->{t['dst']} seq {t['nccl']['seq']}"


__all__ = ["Channel", "Channels", "new_unique_id"]
