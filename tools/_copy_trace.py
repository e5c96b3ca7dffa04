"""What the device-call probes share (GPU machine): one 64 MiB pinned copy as the ceiling, a worker with a client
holding 64 x 1 MiB keys read once (leases kept), and a trace of each call's copy batches.

:class:`CopyTrace` patches the copy engine's batch call and ``device.mark`` so that each call notes the host time of
each batch handed to the driver and CUDA events on the copy stream: one just before its first batch, one at each of
its marks (the last follows every copy). ``span()`` is then the copy stream's time from the first batch to the last
byte. The first batch's host time is taken after its event is recorded, so call - first batch - span is the time
after the last byte (taken before it, the event's own ~20-35 us counted there until session 23).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import kvstrata
from kvstrata.bench._common import device_time
from kvstrata.bench.store import _start_worker
from kvstrata.client import device
from kvstrata.ops import copy_engine

N, SIZE = 64, 1 << 20


def ceilings() -> dict[str, float]:
    """Seconds of one 64 MiB pinned ``copy_`` host to device (``h2d``) and back (``d2h``)."""
    host = torch.empty(N * SIZE, dtype=torch.uint8).pin_memory()
    big = torch.empty(N * SIZE, dtype=torch.uint8, device="cuda")
    return {
        "h2d": device_time(lambda: big.copy_(host, non_blocking=True)),
        "d2h": device_time(lambda: host.copy_(big, non_blocking=True)),
    }


class CopyTrace:
    """Each call's batch times and copy-stream events (module docstring); ``wrap(event)`` may replace the event a
    call waits on (the mark's own, recorded with timing)."""

    def __init__(self, wrap: Callable[[torch.cuda.Event], Any] | None = None) -> None:
        self.batches: list[float] = []
        self.starts: list[torch.cuda.Event] = []
        self.ends: list[torch.cuda.Event] = []
        self._wrap = wrap
        real_memcpy, real_mark = copy_engine.memcpy_raw, device.mark

        def traced(dsts, srcs, sizes, handle):
            if not self.starts:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.ExternalStream(handle))
                self.starts.append(ev)
            self.batches.append(time.perf_counter())
            return real_memcpy(dsts, srcs, sizes, handle)

        def mark(stream):
            if stream is None:
                return real_mark(stream)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            self.ends.append(ev)
            return real_mark(stream) if wrap is None else wrap(ev)

        copy_engine.memcpy_raw, device.mark = traced, mark

    def clear(self) -> None:
        self.batches.clear()
        self.starts.clear()
        self.ends.clear()

    def span(self) -> float:
        """Seconds from the last call's first batch to its last byte (after ``torch.cuda.synchronize()``)."""
        return self.starts[0].elapsed_time(self.ends[-1]) * 1e-3


@contextlib.contextmanager
def kept_client(prefix: str) -> Iterator[tuple[Any, list[str], list[list[torch.Tensor]], list[list[torch.Tensor]]]]:
    """A worker and a client of it, with 64 x 1 MiB keys written and read once: ``(client, keys, src, dst)``."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = _start_worker(Path(tmp), 4 << 30)
        try:
            with kvstrata.connect(address) as kv:
                src = [[torch.randn(SIZE // 4, device="cuda")] for _ in range(N)]
                dst = [[torch.empty_like(t[0])] for t in src]
                keys = [f"{prefix}/{i}" for i in range(N)]
                assert kv.mset_d2h(keys, src) == [None] * N
                kv.mget_h2d(keys, dst)
                yield kv, keys, src, dst
        finally:
            proc.terminate()
            proc.wait()
