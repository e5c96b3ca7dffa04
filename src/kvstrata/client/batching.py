"""How the one-pass device calls cut their keys into copy batches, and their native passes.

A kept ``mget_h2d`` (:mod:`kvstrata.client.kept_reads`), a cold one's early copies from the placement table
(:mod:`kvstrata.client.placed_reads`) and a reserved ``mset_d2h``
(:meth:`~kvstrata.client.device_calls.DeviceCallsMixin.mset_d2h`) go through their keys once, handing the copy engine
a batch as soon as it holds a few runs, then batches twice as large (:func:`next_cut`): the first DMA starts after a
few keys' host work, and the host stays ahead of the DMA. Each batch is planned by a native pass where
:mod:`kvstrata.ops.tensor_runs` is loaded (:class:`NativePasses`: one C++ call checks the batch's tensors, lays out
its runs and queues them with the driver's batch call), else by each call's Python loop.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

from kvstrata.client import device as _device

#: A batch of a cut of ``cut`` ends once its bytes reach ``cut * RUN_BYTES`` (keys of 1 MiB: ``cut`` keys) or its runs
#: ``cut``. A native pass lets a batch hold ``RUNS_PER_CUT * cut`` runs instead, up to ``MAX_BATCH_RUNS``, each batch
#: in one driver call after its first runs: a driver call costs the host a fixed part besides ~0.7 us a run, which 16
#: runs of 64 KiB (~19 us of DMA) do not cover. Measured call by call on the H200 host
#: (``tools/probe_native_planner.py``, session 28, six runs), natively planned kept reads of 256 x 64 KiB went from
#: 0.31-0.44 of one 16 MiB copy to 0.33-0.52 this way, 256 x 256 KiB from 0.87-0.88 to 0.88-0.89 on full-speed vCPUs
#: (from 0.80-0.85 to 0.78-0.84 on slowed ones), ``mset_d2h`` of 256 x 256 KiB from 0.41-0.50 to 0.46-0.56; 64 x 1 MiB
#: alike (cut by bytes). The Python loops keep ``cut`` runs: their ~2-9 us a key before a larger first batch cost more
#: than the fewer driver calls saved (256 x 256 KiB: 0.67-0.70 against 0.71-0.74).
RUN_BYTES = 1 << 20
RUNS_PER_CUT = 4
MAX_BATCH_RUNS = 64
#: the kind of tensor the native passes take: CUDA (tests without a GPU set False, so CPU tensors stand in)
NATIVE_CUDA = True
#: a native pass queues its own copies (``plan_copy`` / ``lay_out_copy``) where it can; ``KVSTRATA_NATIVE_COPIES=0``
#: has cuda-bindings queue the runs it answers instead (``tools/probe_native_planner.py`` switches it call by call)
NATIVE_COPIES = os.environ.get("KVSTRATA_NATIVE_COPIES", "1") != "0"


def batch_runs(cut: int) -> int:
    """The most runs a native pass's batch of a cut of ``cut`` holds (see :data:`RUNS_PER_CUT`)."""
    return min(RUNS_PER_CUT * cut, MAX_BATCH_RUNS)


def next_cut(cut: int) -> int:
    """Runs in the batch after one of ``cut``: twice as many (2, 4, 8, 16 or 3, 6, 12, 16), up to
    ``device.BATCH_RUNS``.

    Each batch costs the host a fixed part (the driver's batch call, the Python around it) besides its keys' own
    work, and must be ready before the copy engine ends the batches queued before it. Growing by half (2, 3, 5, 8,
    12, 16), which a simple model of a slowed vCPU favoured, or by a third, measured no faster call by call on the
    H200 host, slowed or not (``tools/probe_batch_growth.py``, session 23): doubling stays."""
    return min(2 * cut, _device.BATCH_RUNS)


@functools.cache
def planner() -> Any:
    """:mod:`kvstrata.ops.tensor_runs` where a GPU is there and the copy engine's raw calls to take its runs, else
    None (the Python loops' runs then go to torch's copies; a machine without a GPU never builds the module).
    Imported at the first one-pass device call: a client without device calls never loads torch."""
    import torch

    from kvstrata.ops import copy_engine, tensor_runs

    return tensor_runs if copy_engine._runtime() is not None and torch.cuda.is_available() else None


class NativePasses:
    """One device call's native passes, each a batch: planned, and queued on the call's copy stream.

    Where :func:`~kvstrata.client.device.native_copies` can start the copy stream before the first pass (the first
    key's first tensor is a CUDA tensor of the current device), each pass queues its own runs with the driver's batch
    call (:func:`~kvstrata.ops.tensor_runs.plan_copy`, :func:`~kvstrata.ops.tensor_runs.lay_out_copy`): no list of
    addresses is built and read back through cuda-bindings. Else each pass answers its runs and
    :func:`~kvstrata.client.device.copy_lists` queues them, the copy stream started at the first. ``stream`` and
    ``device`` are the copy stream and its device once started (None before): the call's Python loop goes on with
    them where a pass stops at a key it must take.
    """

    def __init__(self, native: Any, tensor_lists: Sequence[Sequence[Any]], first: int, caller_stream: Any) -> None:
        self.native = native
        self.tensor_lists = tensor_lists
        self.caller_stream = caller_stream
        self.stream: Any = None
        self.device: Any = None
        self.index = -1  # the device every planned tensor is on (-1: none met yet)
        self._copier: tuple[int, int, int] | None = None
        if NATIVE_COPIES:
            got = _device.native_copies(tensor_lists, first, caller_stream)
            if got is not None:
                self.device, self.stream, self._copier = got
                self.index = self.device.index

    @classmethod
    def start(cls, tensor_lists: Sequence[Sequence[Any]], first: int, caller_stream: Any) -> NativePasses | None:
        """The passes of a call whose keys from ``first`` on go through them; None where the native module is not
        loaded (being built, turned off, no GPU): the call's Python loop takes every key."""
        native = planner()
        if native is None or native.native() is None:
            return None
        return cls(native, tensor_lists, first, caller_stream)

    def plan(
        self, locs: list[Any], bases: dict[int, int], lo: int, hi: int, cut: int, head: int
    ) -> tuple[int, int, int, list[int]]:
        """A batch of keys ``lo..hi-1`` laid along ``locs`` (:func:`~kvstrata.ops.tensor_runs.plan`'s), of a cut of
        ``cut``, its first ``head`` runs in a driver call of their own: ``(stop, why, runs queued, the keys whose
        tensors' bytes differ from their object's size)``. A copy the driver refuses raises ``CopyEngineError``."""
        native, cap, max_bytes = self.native, batch_runs(cut), cut * RUN_BYTES
        if self._copier is not None:
            stop, why, queued, err, mismatched, self.index = native.plan_copy(
                self.tensor_lists, locs, bases, lo, hi, cap, max_bytes, (*self._copier, head, MAX_BATCH_RUNS),
                device_index=self.index, cuda=NATIVE_CUDA,
            )  # fmt: skip
            if err:
                raise _device.copy_error("cuMemcpyBatchAsync", err, queued)
            return stop, why, queued, mismatched
        stop, why, dsts, srcs, sizes, mismatched, self.index = native.plan(
            self.tensor_lists, locs, bases, lo, hi, cap, max_bytes, device_index=self.index, cuda=NATIVE_CUDA
        )
        return stop, why, self._queue(dsts, srcs, sizes, head), mismatched

    def lay_out(
        self, lo: int, hi: int, base: int, at: int, end: int, mask: int, segment: int, cut: int, head: int
    ) -> tuple[int, int, int, list[int], list[int], int]:
        """A batch of keys ``lo..hi-1`` laid one after another from offset ``at`` of a reservation (segment
        ``segment`` mapped at ``base``, ending at ``end``, objects aligned by ``mask``;
        :func:`~kvstrata.ops.tensor_runs.lay_out`'s), of a cut of ``cut``, its first ``head`` runs in a driver call of
        their own: ``(stop, why, runs queued, the objects' bytes, their offsets, the next object's offset)``."""
        native, cap, max_bytes = self.native, batch_runs(cut), cut * RUN_BYTES
        if self._copier is not None:
            stop, why, queued, err, totals, offsets, self.index, at = native.lay_out_copy(
                self.tensor_lists, lo, hi, base, at, end, mask, cap, max_bytes, (*self._copier, head, MAX_BATCH_RUNS),
                device_index=self.index, segment=segment, cuda=NATIVE_CUDA,
            )  # fmt: skip
            if err:
                raise _device.copy_error("cuMemcpyBatchAsync", err, queued)
            return stop, why, queued, totals, offsets, at
        stop, why, dsts, srcs, sizes, totals, offsets, self.index, at = native.lay_out(
            self.tensor_lists, lo, hi, base, at, end, mask, cap, max_bytes, device_index=self.index, segment=segment,
            cuda=NATIVE_CUDA,
        )  # fmt: skip
        return stop, why, self._queue(dsts, srcs, sizes, head), totals, offsets, at

    def _queue(self, dsts: list[int], srcs: list[int], sizes: list[int], head: int) -> int:
        """A pass's answered runs queued through cuda-bindings, the copy stream started first where it is not."""
        if sizes:
            if self.stream is None:
                self.device, self.stream = _device.start_index(self.index, self.caller_stream)
            _device.copy_lists(dsts, srcs, sizes, self.stream, head, MAX_BATCH_RUNS)
        return len(sizes)


__all__ = [
    "MAX_BATCH_RUNS",
    "NATIVE_COPIES",
    "NATIVE_CUDA",
    "RUNS_PER_CUT",
    "RUN_BYTES",
    "NativePasses",
    "batch_runs",
    "next_cut",
    "planner",
]
