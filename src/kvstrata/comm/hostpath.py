"""The host leg of the hybrid all-gather: device -> node segment -> (relay across nodes) -> device.

One helper thread per :class:`HostPath` runs the calls in order. For call ``seq`` with tail chunks
``k = 0..K-1`` each rank:

1. writes its call record (``seq``, input bytes, tail bytes, how the heads move) next to its flags,
   then copies its tail chunk by chunk into its slot of its node's segment and, after each chunk, sets
   its ready flag to ``seq << 16 | k + 1``. On CUDA both copies are D2H on one stream, so the flag
   lands after the data (and after the record, a host store made before the copies were queued); on
   CPU they are plain stores in program order.
2. if it is the relay for a node pair ``(src, dst = its node)``: waits for the src ranks' flags in the
   src segment, copies their chunks H2H (and their records) into its own node's segment and sets their
   flags there.
3. waits for every peer's flag in its node's segment and copies the peer's chunk into ``out``
   (H2D on CUDA), taking peers in the order they arrive. At a peer's first chunk it checks the peer's
   record against its own: ranks that disagree on the call (size, ratio, head) raise
   :class:`~kvstrata.errors.InvalidValue` naming the peer instead of returning the wrong bytes.

With ``direct=True`` there are no relays: a rank reads each peer's chunk from the peer's own node
segment (the DMA crosses the socket link instead of a CPU memcpy).

Segments are double buffered (call ``seq`` uses buffer ``seq % 2``), which is safe without
acknowledgements: a rank raises its flags for call ``seq + 1`` only after its reads of call ``seq``
finished (on CUDA the D2H stream waits for the previous H2D event), and a rank writes buffer
``seq % 2`` again for call ``seq + 2`` only after it saw every peer's ``seq + 1`` flags (the call
records are double buffered the same way). Every wait has a deadline and checks that the peer process,
and the relay it comes through, is alive, so a lost rank surfaces as an error naming it.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import traceback
from dataclasses import dataclass

import torch

from kvstrata._proc import pid_alive
from kvstrata.comm.segment import NodeSegment
from kvstrata.errors import ConnectionLost, InvalidValue, KvstrataError, Timeout
from kvstrata.memory import device_ptr
from kvstrata.ops.stream_ops import stream_writes_supported, write_value64

CHUNK_BYTES = 4 << 20  # pipelining grain: a peer's H2D of chunk k overlaps the D2H of chunk k + 1
MAX_CHUNKS = 16
_ALIGN = 4096
_HEAD_CODES = {None: 0, "p2p": 1, "gather": 2}  # how the heads move, in a call record (None: no head)


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
    nbytes: int  # this rank's whole input in bytes, head and tail
    head: str | None  # how the collective leg moves the heads ("p2p", "gather"; None: no head)

    def record(self) -> tuple[int, int, int, int]:
        """The call as this rank sees it, published next to its flags: every peer must see the same."""
        return (self.seq, self.nbytes, self.inp_tail.numel(), _HEAD_CODES[self.head])


def describe_record(record: tuple[int, ...]) -> str:
    """A call record in words, for error messages."""
    seq, nbytes, tail, head = record
    if tail == nbytes:
        return f"call {seq}: {nbytes} bytes per rank, all through the host"
    how = {code: name for name, code in _HEAD_CODES.items()}.get(head, f"#{head}")
    return f"call {seq}: {nbytes} bytes per rank, the last {tail} through the host, the rest by {how}"


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
        # The rank that copies each remote peer's slot into this node's segment (relay mode only).
        relays = topo.relays()
        self._relay_of = {
            q: relays[(topo.node_of[q], self.node)] for q in self.peers if not direct and topo.node_of[q] != self.node
        }
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
            _drop_frames(exc)
            self._error = exc
            raise

    def _run(self, call: _Call) -> torch.cuda.Event | None:
        seg = self.segments[self.node]
        buf = call.seq % 2
        base = call.seq << 16
        bounds = chunk_bounds(call.inp_tail.numel())
        if self._cuda:
            self._h2d.wait_event(call.ev_in)
        record = call.record()
        # Before this call's first flag (on CUDA: before its flag writes are even queued), so a peer
        # that sees a flag of this call reads this record.
        seg.calls[buf, self.rank] = record
        self._write(seg, buf, base, bounds, call)
        for k, (lo, hi) in enumerate(bounds):
            value = base + k + 1
            for src in self.relay_sources:
                src_seg = self.segments[src]
                for q in self._arrivals(self.topo.ranks_on(src), lambda _q, s=src_seg: s, call, k, len(bounds)):
                    seg.slot(buf, q)[lo:hi].copy_(src_seg.slot(buf, q)[lo:hi])
                    if k == 0:  # forwarded unchecked: the readers here check it (this rank among them)
                        seg.calls[buf, q] = src_seg.calls[buf, q]
                    seg.flags[q] = value
            # Every peer's first chunk is checked against this rank's record before any later chunk
            # is awaited: a peer with a different size may never raise the flags this rank expects.
            expect = record if k == 0 else None
            for q in self._arrivals(self.peers, self._source, call, k, len(bounds), expect=expect, relayed=True):
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

    def _arrivals(
        self,
        ranks: list[int],
        where,
        call: _Call,
        chunk: int,
        chunks: int,
        *,
        expect: tuple[int, ...] | None = None,
        relayed: bool = False,
    ):
        """Yield the ranks of ``ranks`` as their flag in segment ``where(rank)`` reaches chunk ``chunk`` of
        ``call``, in arrival order.

        ``expect``: this rank's call record; an arriving rank whose record differs raises
        :class:`~kvstrata.errors.InvalidValue`. ``relayed``: the ranks' data comes through this node's
        relays (unless direct), whose liveness is checked as well as the ranks' own.
        """
        value = (call.seq << 16) + chunk + 1
        buf = call.seq % 2
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
                    if expect is not None:
                        self._check_record(q, tuple(int(v) for v in where(q).calls[buf, q]), expect)
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
                self._check_alive(pending, relayed, call.seq, chunk, chunks)
                if now >= deadline:
                    raise Timeout(
                        f"hybrid all-gather: rank(s) {pending} did not arrive within {self.timeout:g} s (call "
                        f"{call.seq}, chunk {chunk + 1}/{chunks}, rank {self.rank} waiting on NUMA node {self.node})"
                    )

    def _check_record(self, q: int, theirs: tuple[int, ...], mine: tuple[int, ...]) -> None:
        if theirs == mine:
            return
        raise InvalidValue(
            f"hybrid all-gather: rank {q} and rank {self.rank} disagree on the call (rank {q}: "
            f"{describe_record(theirs)}; rank {self.rank}: {describe_record(mine)}); every rank must pass "
            "the same size, dtype and ratio"
        )

    def _check_alive(self, pending: list[int], relayed: bool, seq: int, chunk: int, chunks: int) -> None:
        """Raise ConnectionLost naming a pending rank, or the relay a pending rank comes through, that exited."""
        where = f"(rank {self.rank} waiting on chunk {chunk + 1}/{chunks})"
        for q in pending:
            if not pid_alive(self.topo.pids[q]):
                raise ConnectionLost(
                    f"hybrid all-gather: rank {q} (pid {self.topo.pids[q]}) exited before call {seq} arrived {where}"
                )
        if not relayed:
            return
        for relay in sorted({self._relay_of[q] for q in pending if q in self._relay_of} - {self.rank}):
            if not pid_alive(self.topo.pids[relay]):
                src = sorted({self.topo.node_of[q] for q in pending if self._relay_of.get(q) == relay})
                raise ConnectionLost(
                    f"hybrid all-gather: rank {relay} (pid {self.topo.pids[relay]}), which relays NUMA node "
                    f"{', '.join(map(str, src))}'s slots to node {self.node}, exited before call {seq} arrived "
                    f"{where}; rank(s) {pending} come through it"
                )


def _drop_frames(exc: BaseException) -> None:
    """Drop the tracebacks of a helper-thread error (and its causes) before it is stored and re-raised.

    Their frames hold views of the segments (flag arrays, slot tensors), which would keep the mappings
    from being unmapped by ``close()`` for as long as the error lives (in a future, in the caller's hands).
    The frames of an unexpected error are kept as text in a note.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            if not isinstance(exc, KvstrataError):
                exc.add_note("host path thread traceback:\n" + "".join(traceback.format_tb(exc.__traceback__)))
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


__all__ = ["CHUNK_BYTES", "HostPath", "Topology", "chunk_bounds", "describe_record"]
