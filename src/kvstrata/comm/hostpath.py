"""The host leg of the hybrid all-gather: device -> node segment -> (relay across nodes) -> device.

One helper thread per :class:`HostPath` runs the calls in order. For call ``seq`` with tail chunks
``k = 0..K-1`` each rank:

1. copies its tail chunk by chunk into its slot of its node's segment and, after each chunk, sets its
   ready flag to ``seq << 16 | k + 1``. On CUDA both copies are D2H on one stream, so the flag lands
   after the data; on CPU they are plain stores in program order.
2. if it is the relay for a node pair ``(src, dst = its node)``: waits for the src ranks' flags in the
   src segment, copies their chunks H2H into its own node's segment and sets their flags there.
3. waits for every peer's flag in its node's segment and copies the peer's chunk into ``out``
   (H2D on CUDA), taking peers in the order they arrive.

With ``direct=True`` there are no relays: a rank reads each peer's chunk from the peer's own node
segment (the DMA crosses the socket link instead of a CPU memcpy).

Segments are double buffered (call ``seq`` uses buffer ``seq % 2``), which is safe without
acknowledgements: a rank raises its flags for call ``seq + 1`` only after its reads of call ``seq``
finished (on CUDA the D2H stream waits for the previous H2D event), and a rank writes buffer
``seq % 2`` again for call ``seq + 2`` only after it saw every peer's ``seq + 1`` flags. Every wait
has a deadline and checks that the peer process is alive, so a lost rank surfaces as an error.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from dataclasses import dataclass

import torch

from kvstrata._proc import pid_alive
from kvstrata.comm.segment import NodeSegment
from kvstrata.errors import ConnectionLost, Timeout
from kvstrata.memory import device_ptr
from kvstrata.ops.stream_ops import stream_writes_supported, write_value64

CHUNK_BYTES = 4 << 20  # pipelining grain: a peer's H2D of chunk k overlaps the D2H of chunk k + 1
MAX_CHUNKS = 16
_ALIGN = 4096


@dataclass(frozen=True)
class Topology:
    """Where every rank of the group lives: NUMA node and pid (all ranks on this host)."""

    node_of: tuple[int, ...]
    pids: tuple[int, ...]

    @property
    def nodes(self) -> list[int]:
        return sorted(set(self.node_of))

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def relay_sources(self, rank: int) -> list[int]:
        """The nodes whose slots ``rank`` copies into its own node's segment."""
        node = self.node_of[rank]
        return [src for (src, dst), r in self.relays().items() if dst == node and r == rank]

    def relays(self) -> dict[tuple[int, int], int]:
        """``(src, dst) -> rank`` on dst that copies src's slots into dst's segment (spread over dst's ranks)."""
        out = {}
        for dst in self.nodes:
            local = self.ranks_on(dst)
            for i, src in enumerate(n for n in self.nodes if n != dst):
                out[(src, dst)] = local[i % len(local)]
        return out


def chunk_bounds(tail_bytes: int) -> list[tuple[int, int]]:
    """Split ``tail_bytes`` into at most MAX_CHUNKS pieces of about CHUNK_BYTES, 4 KiB aligned."""
    if tail_bytes <= 0:
        return []
    k = min(MAX_CHUNKS, -(-tail_bytes // CHUNK_BYTES))
    per_chunk = -(-tail_bytes // k)
    step = -(-per_chunk // _ALIGN) * _ALIGN
    return [(lo, min(lo + step, tail_bytes)) for lo in range(0, tail_bytes, step)]


@dataclass
class _Call:
    seq: int
    inp_tail: torch.Tensor  # this rank's tail bytes (uint8, contiguous)
    out_tails: list[torch.Tensor]  # every rank's tail bytes inside ``out``
    ev_in: torch.cuda.Event | None  # inputs ready on the caller's stream (CUDA only)


class HostPath:
    """Runs host-leg calls on a helper thread over already-mapped node segments."""

    def __init__(
        self,
        rank: int,
        topo: Topology,
        segments: dict[int, NodeSegment],
        *,
        device: torch.device,
        timeout: float,
        direct: bool = False,
    ) -> None:
        self.rank = rank
        self.direct = direct
        self.topo = topo
        self.node = topo.node_of[rank]
        self.segments = segments
        self.device = device
        self.timeout = timeout
        self.relay_sources = [] if direct else topo.relay_sources(rank)
        self.peers = [q for q in range(len(topo.node_of)) if q != rank]
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvstrata-ag-r{rank}")
        self._last: concurrent.futures.Future | None = None
        self._error: BaseException | None = None
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
            self._flag_src = torch.zeros(MAX_CHUNKS, dtype=torch.int64, device=device)
            self._arange = torch.arange(MAX_CHUNKS, dtype=torch.int64, device=device)
            # Flags by stream memory operation: no SM, so a GEMM filling the GPU cannot delay them.
            self._flag_writes = os.environ.get("KVSTRATA_AG_FLAG_KERNEL", "") in ("", "0") and (
                stream_writes_supported(device.index if device.index is not None else torch.cuda.current_device())
            )
            self._prev_done: torch.cuda.Event | None = None

    @property
    def slot_bytes(self) -> int:
        return self.segments[self.node].slot_bytes

    def submit(self, call: _Call) -> concurrent.futures.Future:
        """Queue one call; the future yields the CUDA event that marks its H2D copies (None on CPU)."""
        if self._error is not None:
            raise ConnectionLost(f"hybrid all-gather host path is broken by an earlier error: {self._error}")
        if self._cuda and call.inp_tail.numel():
            # The caching allocator must not hand these blocks out again while our side streams use them.
            call.inp_tail.record_stream(self._d2h)
            for t in call.out_tails:
                t.record_stream(self._h2d)
        self._last = self._pool.submit(self._run_guarded, call)
        return self._last

    def drain(self) -> None:
        """Wait until every queued call finished on the host and on the device (errors are not raised)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])
        if self._cuda:
            self._d2h.synchronize()
            self._h2d.synchronize()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)

    # --- the helper thread ---------------------------------------------------------------------------

    def _run_guarded(self, call: _Call) -> torch.cuda.Event | None:
        try:
            if self._cuda:
                with torch.cuda.device(self.device):
                    return self._run(call)
            return self._run(call)
        except BaseException as exc:
            self._error = exc
            raise

    def _run(self, call: _Call) -> torch.cuda.Event | None:
        seg = self.segments[self.node]
        buf = call.seq % 2
        base = call.seq << 16
        bounds = chunk_bounds(call.inp_tail.numel())
        if self._cuda:
            self._h2d.wait_event(call.ev_in)
        self._write(seg, buf, base, bounds, call)
        for k, (lo, hi) in enumerate(bounds):
            value = base + k + 1
            for src in self.relay_sources:
                src_seg = self.segments[src]
                for q in self._arrivals(
                    self.topo.ranks_on(src), lambda _q, s=src_seg: s, value, call.seq, k, len(bounds)
                ):
                    seg.slot(buf, q)[lo:hi].copy_(src_seg.slot(buf, q)[lo:hi])
                    seg.flags[q] = value
            for q in self._arrivals(self.peers, self._source, value, call.seq, k, len(bounds)):
                src = self._source(q).slot(buf, q)[lo:hi]
                if self._cuda:
                    with torch.cuda.stream(self._h2d):
                        call.out_tails[q][lo:hi].copy_(src, non_blocking=True)
                else:
                    call.out_tails[q][lo:hi].copy_(src)
        if not self._cuda:
            return None
        done = torch.cuda.Event()
        done.record(self._h2d)
        self._prev_done = done
        return done

    def _write(self, seg: NodeSegment, buf: int, base: int, bounds: list[tuple[int, int]], call: _Call) -> None:
        mine = seg.slot(buf, self.rank)
        if not self._cuda:
            for k, (lo, hi) in enumerate(bounds):
                mine[lo:hi].copy_(call.inp_tail[lo:hi])
                seg.flags[self.rank] = base + k + 1
            return
        d2h = self._d2h
        d2h.wait_event(call.ev_in)
        if self._prev_done is not None:  # our flags for this call must imply our previous reads are done
            d2h.wait_event(self._prev_done)
        flag = seg.flags_tensor[self.rank : self.rank + 1]
        if self._flag_writes:
            flag_address = device_ptr(flag.data_ptr())
            with torch.cuda.stream(d2h):
                for k, (lo, hi) in enumerate(bounds):
                    mine[lo:hi].copy_(call.inp_tail[lo:hi], non_blocking=True)
                    write_value64(d2h, flag_address, base + k + 1)
            return
        with torch.cuda.stream(d2h):
            torch.add(self._arange[: len(bounds)], base + 1, out=self._flag_src[: len(bounds)])
            for k, (lo, hi) in enumerate(bounds):
                mine[lo:hi].copy_(call.inp_tail[lo:hi], non_blocking=True)
                flag.copy_(self._flag_src[k : k + 1], non_blocking=True)

    def _source(self, q: int) -> NodeSegment:
        """The segment where rank ``q``'s data shows up for this rank (its own node's, unless direct)."""
        return self.segments[self.topo.node_of[q] if self.direct else self.node]

    def _arrivals(self, ranks: list[int], where, value: int, seq: int, chunk: int, chunks: int):
        """Yield the ranks of ``ranks`` as their flag in segment ``where(rank)`` reaches ``value``, in arrival order."""
        pending = list(ranks)
        deadline = time.monotonic() + self.timeout
        next_check = time.monotonic() + 0.2
        spins = 0
        flags = {q: where(q).flags for q in ranks}
        while pending:
            ready = [q for q in pending if flags[q][q] >= value]
            if ready:
                spins = 0
                for q in ready:
                    pending.remove(q)
                    yield q
                continue
            spins += 1
            # sleep(0) still releases the GIL, so the caller's thread can launch work while we poll.
            # A 4 MiB chunk crosses PCIe in ~75 us: spin first, then nap briefly (a late H2D idles the link).
            time.sleep(0 if spins < 200 else 5e-5)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.2
                for q in pending:
                    if not pid_alive(self.topo.pids[q]):
                        raise ConnectionLost(
                            f"hybrid all-gather: rank {q} (pid {self.topo.pids[q]}) exited before call {seq} "
                            f"arrived (rank {self.rank} waiting on chunk {chunk + 1}/{chunks})"
                        )
                if now >= deadline:
                    raise Timeout(
                        f"hybrid all-gather: rank(s) {pending} did not arrive within {self.timeout:g} s "
                        f"(call {seq}, chunk {chunk + 1}/{chunks}, rank {self.rank} waiting on NUMA node {self.node})"
                    )


__all__ = ["CHUNK_BYTES", "HostPath", "Topology", "chunk_bounds"]
