"""Hybrid all-gather: the device collective and a NUMA-aware host shared-memory path at once.

Each rank's input is split: the first ``count - count // ratio`` elements (the head) go through the
group's collective (NCCL, or gloo for CPU tensors), the last ``count // ratio`` (the tail) through
host memory over PCIe (:mod:`kvstrata.comm.hostpath`). Both legs run concurrently; the result equals
``torch.distributed.all_gather_into_tensor(out, inp)``.

Example (one process per GPU, ``torch.cuda.set_device(rank)`` and an NCCL group initialised)::

    ag = HybridAllGather(ratio="auto")
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    ag.all_gather(out, x)                        # ordered on the current stream
    token = ag.all_gather(out, x, async_op=True)
    ...                                          # other work
    token.wait()                                 # the current stream now sees ``out``
    ag.close()
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import math
import numbers
import os
import socket
import time
import uuid
import weakref
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from kvstrata.comm import segment as _segment
from kvstrata.comm.hostpath import HostPath, Topology, _Call
from kvstrata.errors import CapacityError, ClosedError, InvalidArgument, InvalidType, InvalidValue

log = logging.getLogger(__name__)

AUTO_CANDIDATES = (0, 32, 16, 8, 4, 2, 1)  # 0: the device collective only; 1: the host path only
HEADS = ("p2p", "gather")
AUTO_MIN_BYTES = 1 << 20  # below this per rank the host leg's fixed latency never pays off
AUTO_MARGIN = 0.98  # a split must beat the collective alone by 2% to be chosen (noise guard)
_MIN_SLOT = 1 << 20
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_live: weakref.WeakSet[HybridAllGather] = weakref.WeakSet()


class Token:
    """Completion handle of an asynchronous :meth:`HybridAllGather.all_gather`."""

    def __init__(self, finish, future: concurrent.futures.Future | None, device: torch.device) -> None:
        self._finish = finish  # makes ``stream`` (or the host) wait for the collective leg
        self._future = future  # the host leg: yields its CUDA event (None on CPU)
        self._device = device
        self._event: torch.cuda.Event | None = None
        self._host_done = self._done = False

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait until ``out`` is complete.

        Blocks the host until the peers' tails have reached host memory (the copies into ``out``
        are then ordered on ``stream``); on CPU tensors it blocks until ``out`` is complete. Raises
        the host leg's error (:class:`kvstrata.errors.Timeout` naming a rank that did not arrive,
        :class:`kvstrata.errors.ConnectionLost` for a rank that exited) or the collective's. May be
        called again, e.g. for another stream.
        """
        if not self._host_done:
            self._event = self._future.result() if self._future is not None else None
            self._host_done = True
        if self._device.type != "cuda":
            if not self._done:
                self._finish(None)
                self._done = True
            return
        self._finish(stream)
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)


class HybridAllGather:
    """All-gather over a process group through the device collective and host shared memory at once.

    Args:
        group: the ``torch.distributed`` group (default: the world). NCCL takes CUDA tensors of the
            current device, gloo CPU tensors.
        ratio: ``"auto"`` (measure once per world size, dtype and size bucket and pick the fastest
            split, the collective alone included), an int ``r >= 1`` (the last ``count // r`` elements
            of each rank's input travel through the host), or 0 / None (the collective alone).
        hugepages: back segments with ``/dev/hugepages``: True, False, or ``"auto"`` (when enough free
            huge pages exist).
        numa_map: NUMA node of each rank (sequence or ``{rank: node}``), identical on every rank;
            default: the node of each rank's GPU (node 0 without CUDA or NUMA information).
        timeout: seconds (finite, > 0) a rank waits for a peer on the host leg before raising.
        head: how the collective leg moves the heads: ``"p2p"`` (batched send/recv straight into
            ``out``), ``"gather"`` (``all_gather_into_tensor`` into a scratch buffer, then one strided
            copy into ``out``), or ``"auto"`` (measured with ``ratio="auto"``; for a fixed ratio
            ``"p2p"`` on two ranks, where it moves the same bytes as the ring, ``"gather"`` otherwise).
        cross_node: with ranks on several NUMA nodes, ``"relay"`` (one rank per node pair copies the
            other node's slots into its node's segment, as in the seed) or ``"direct"`` (each GPU reads
            a remote rank's slot straight from that rank's node segment; no CPU copy).

    Construction is collective: every rank of the group constructs it with the same ``head``,
    ``cross_node`` and ``numa_map``. A bad or mismatched argument on any rank raises
    :class:`~kvstrata.errors.InvalidValue` (or :class:`~kvstrata.errors.InvalidType`) naming the
    argument and the ranks on every rank, instead of leaving the others waiting.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        ratio: int | str | None = "auto",
        hugepages: bool | str = "auto",
        numa_map: Sequence[int] | Mapping[int, int] | None = None,
        timeout: float = 60.0,
        head: str = "auto",
        cross_node: str = "relay",
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (call init_process_group first)")
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        # Not raised here: a rank raising alone would leave the others in _discover's collective.
        problems = _option_problems(ratio=ratio, hugepages=hugepages, timeout=timeout, head=head, cross_node=cross_node)
        self.topology, self.host_path_enabled = self._discover(
            numa_map, problems, {"head": head, "cross_node": cross_node}
        )
        self.ratio: int | str = "auto" if ratio == "auto" else (ratio or 0)
        self.hugepages = hugepages
        self.timeout = float(timeout)
        self.head = head
        self.cross_node = cross_node
        self._closed = False
        self._seq = 0
        self._gen = 0
        self._validated: set[tuple] = set()
        self._auto: dict[tuple[int, str, int], tuple[int, str]] = {}
        self._scratch: torch.Tensor | None = None
        self._segments: dict[int, _segment.NodeSegment] = {}
        self._host: HostPath | None = None
        if self.device.type == "cuda":
            self._comm_stream = torch.cuda.Stream(self.device)
        self._uid = self._broadcast_uid()
        _live.add(self)

    # --- setup ---------------------------------------------------------------------------------------

    def _discover(self, numa_map, problems: list[tuple[str, str]], options: dict[str, object]) -> tuple[Topology, bool]:
        """Collective: every rank's host, pid and NUMA node; raises on every rank when any rank reported
        a bad argument (``problems``: ``(kind, message)``) or the ranks' protocol ``options`` differ."""
        nodes = None
        if numa_map is not None:
            try:
                nodes = _parse_numa_map(numa_map, self.world)
            except InvalidArgument as exc:
                problems.append(("type" if isinstance(exc, InvalidType) else "value", str(exc)))
        node = 0
        if nodes is not None:
            node = nodes[self.rank]
        elif numa_map is None and self.device.type == "cuda":
            from kvstrata.memory.numa import numa_node

            node = numa_node(self.device.index) or 0
        shown = {name: repr(value) for name, value in options.items()}  # reprs: whatever was passed pickles
        info = (_host_id(), os.getpid(), node, nodes, shown, problems)
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, info, group=self.group)
        reported = [(r, kind, text) for r, g in enumerate(gathered) for kind, text in g[5]]
        if reported:
            kind = InvalidType if any(k == "type" for _, k, _ in reported) else InvalidValue
            raise kind("HybridAllGather: " + _by_rank([(r, text) for r, _, text in reported]))
        differ = [(name, [g[4][name] for g in gathered]) for name in shown]
        differ += [("numa_map", [repr(g[3]) for g in gathered])]
        differ = [(name, values) for name, values in differ if len(set(values)) > 1]
        if differ:
            raise InvalidValue(
                "; ".join(
                    f"{name}: must be the same on every rank ({_by_rank(list(enumerate(v)))})" for name, v in differ
                )
            )
        topo = Topology(node_of=tuple(g[2] for g in gathered), pids=tuple(g[1] for g in gathered))
        one_host = len({g[0] for g in gathered}) == 1
        if not one_host:
            log.warning("hybrid all-gather: the group spans several hosts; using the collective alone")
        return topo, one_host and self.world > 1

    def _broadcast_uid(self) -> str:
        box = [uuid.uuid4().hex[:16] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _agree(self, error: str | None) -> list:
        """Collective: raise on every rank when any rank reports an error."""
        errors: list = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        bad = {r: e for r, e in enumerate(errors) if e}
        if bad:
            raise RuntimeError("hybrid all-gather setup failed: " + "; ".join(f"rank {r}: {e}" for r, e in bad.items()))
        return errors

    def _ensure_capacity(self, tail_bytes: int) -> None:
        """Collective: (re)build the node segments when a call's tail does not fit the current slots."""
        if self._host is not None and tail_bytes <= self._host.slot_bytes:
            return
        slot = max(_MIN_SLOT, 1 << math.ceil(math.log2(max(tail_bytes, 1))))
        self._teardown_host()
        self._gen += 1
        topo = self.topology
        my_node = topo.node_of[self.rank]
        creators = {n: topo.ranks_on(n)[0] for n in topo.nodes}
        direct = self.cross_node == "direct"
        needed = set(topo.nodes) if direct else {my_node, *topo.relay_sources(self.rank)}
        segments: dict[int, _segment.NodeSegment] = {}
        error = path = None
        try:
            for node, creator in creators.items():
                if creator == self.rank:
                    huge = self._use_hugepages(slot)
                    directory = _segment.HUGEPAGES_DIR if huge else _segment.SHM_DIR
                    _segment.sweep_stale(directory)
                    path = directory / f"{_segment.PREFIX}{self._uid}-n{node}-g{self._gen}-p{os.getpid()}"
                    segments[node] = _segment.NodeSegment.create(path, self.world, slot, huge=huge, node=node)
        except Exception as exc:
            error = f"creating {path}: {exc!r}"
            full = isinstance(exc, CapacityError)
        else:
            full = False
        try:
            info: list = [None] * self.world
            report = (error, {n: str(s.path) for n, s in segments.items()}, full)
            dist.all_gather_object(info, report, group=self.group)
            bad = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(info) if e]
            if bad:
                # the same class on every rank: a full /dev/shm is a CapacityError wherever it was found
                kind = CapacityError if any(f for _, _, f in info) else RuntimeError
                raise kind("hybrid all-gather: could not create segments: " + "; ".join(bad))
            paths = {n: Path(p) for _, d, _ in info for n, p in d.items()}
            error = None
            try:
                for node in needed - set(segments):
                    huge = paths[node].parent == _segment.HUGEPAGES_DIR
                    segments[node] = _segment.NodeSegment.attach(paths[node], self.world, slot, huge=huge)
                if self.device.type == "cuda":  # the segments this rank's GPU copies to or from
                    for node in topo.nodes if direct else [my_node]:
                        segments[node].register_cuda()
            except Exception as exc:
                error = f"attaching/registering segment: {exc!r}"
            self._agree(error)
        except BaseException:
            for seg in segments.values():
                seg.close()
            raise
        for seg in segments.values():
            seg.unlink()  # everyone is attached: from here on nothing can be left behind
        self._segments = segments
        self._host = HostPath(self.rank, topo, segments, device=self.device, timeout=self.timeout, direct=direct)

    def _use_hugepages(self, slot: int) -> bool:
        if self.hugepages is False:
            return False
        size = _segment.segment_bytes(self.world, slot, huge=True)
        available = _segment.hugepages_free_bytes() >= size
        if self.hugepages is True and not available:
            raise RuntimeError(f"hugepages=True but fewer than {size} bytes of free huge pages")
        return available

    def _teardown_host(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
        for seg in self._segments.values():
            seg.close()
        self._segments = {}

    # --- the call ------------------------------------------------------------------------------------

    def all_gather(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        *,
        async_op: bool = False,
        ratio: int | str | None = None,
    ) -> Token | None:
        """Gather every rank's ``inp`` into ``out`` (``world * inp.numel()`` elements, rank order).

        Collective: every rank of the group calls it with the same size, dtype and ``ratio``. With
        ``async_op=True`` returns a :class:`Token`; ``inp`` and ``out`` must stay alive and
        untouched until ``token.wait()``. Otherwise the result is ordered on the current stream.
        ``ratio`` overrides the instance's split for this call (same meaning as in the constructor;
        use 0 for the collective alone).

        Bad input (wrong types, layout, sizes, ratio) on any rank raises the same
        :class:`~kvstrata.errors.InvalidValue` / :class:`~kvstrata.errors.InvalidType` on every rank
        on the first call of a shape (a collective check, then cached). Later, ranks whose calls
        through the host path disagree (size, ratio) raise :class:`~kvstrata.errors.InvalidValue`
        naming each other from the host leg, and the host path stays broken afterwards.
        """
        if self._closed:
            raise ClosedError("HybridAllGather is closed")
        ratio = self.ratio if ratio is None else ratio
        self._validate(out, inp, ratio)
        ratio, head = self._choose(out, inp, ratio)
        if async_op:
            return self._launch(out, inp, ratio, head)
        self._run(out, inp, ratio, head)
        return None

    def _run(self, out: torch.Tensor, inp: torch.Tensor, ratio: int, head: str) -> None:
        """One synchronous call (its result ordered on the current stream)."""
        if self._collective_alone(inp, ratio):
            # Exactly what plain NCCL does: an async collective plus a wait cost measurably more
            # (the suspected cause of an 11x slowdown at 4 MiB beside a matmul on the H200 pair).
            _gather(out.reshape(-1), inp.reshape(-1), group=self.group)
            return
        self._launch(out, inp, ratio, head).wait()

    def _collective_alone(self, inp: torch.Tensor, ratio: int) -> bool:
        return self.world == 1 or not (ratio and self.host_path_enabled and inp.numel() // ratio)

    def _launch(self, out: torch.Tensor, inp: torch.Tensor, ratio: int, head: str) -> Token:
        count = inp.numel()
        if self._collective_alone(inp, ratio):
            return self._collective_only(out, inp)
        tail = count // ratio
        elem = inp.element_size()
        nbytes, tail_bytes = count * elem, tail * elem
        head_bytes = nbytes - tail_bytes
        self._ensure_capacity(tail_bytes)
        inp_b = inp.reshape(-1).view(torch.uint8)
        out_2d = out.reshape(-1).view(torch.uint8).view(self.world, nbytes)
        self._seq += 1
        cuda = self.device.type == "cuda"
        ev_in = None
        if cuda:
            ev_in = torch.cuda.Event()
            ev_in.record(torch.cuda.current_stream(self.device))
        out_tails = [out_2d[q, head_bytes:] for q in range(self.world)]
        call = _Call(self._seq, inp_b[head_bytes:], out_tails, ev_in, nbytes, head if head_bytes else None)
        future = self._host.submit(call)
        if cuda:
            comm = self._comm_stream
            comm.wait_event(ev_in)
            inp.record_stream(comm)
            out.record_stream(comm)
            with torch.cuda.stream(comm):
                finish_head = self._start_head(out_2d, inp_b, head_bytes, head)
                finish_head()
                out_2d[self.rank, head_bytes:].copy_(inp_b[head_bytes:])
            done = torch.cuda.Event()
            done.record(comm)
            return Token(lambda s: (s or torch.cuda.current_stream(self.device)).wait_event(done), future, self.device)
        finish_head = self._start_head(out_2d, inp_b, head_bytes, head)
        out_2d[self.rank, head_bytes:].copy_(inp_b[head_bytes:])
        return Token(lambda _s: finish_head(), future, self.device)

    def _start_head(self, out_2d: torch.Tensor, inp_b: torch.Tensor, head_bytes: int, head: str):
        """Start the collective leg for the heads; returns what completes it (on the current stream)."""
        if head_bytes == 0:
            return lambda: None
        src = inp_b[:head_bytes]
        if head == "gather":
            nbytes = self.world * head_bytes
            scratch = self._borrow_scratch(nbytes)
            work = _gather(scratch[:nbytes], src, group=self.group, async_op=True)

            def finish_gather() -> None:
                work.wait()
                out_2d[:, :head_bytes].copy_(scratch[:nbytes].view(self.world, head_bytes))
                self._return_scratch(scratch)

            return finish_gather
        ops = []
        for q in range(self.world):
            if q != self.rank:
                peer = dist.get_global_rank(self.group, q)
                ops.append(dist.P2POp(dist.isend, src, peer, self.group))
                ops.append(dist.P2POp(dist.irecv, out_2d[q, :head_bytes], peer, self.group))
        works = dist.batch_isend_irecv(ops)
        out_2d[self.rank, :head_bytes].copy_(src)

        def finish_p2p() -> None:
            for work in works:
                work.wait()

        return finish_p2p

    def _collective_only(self, out: torch.Tensor, inp: torch.Tensor) -> Token:
        flat_out, flat_in = out.reshape(-1), inp.reshape(-1)
        if self.device.type == "cuda":
            work = _gather(flat_out, flat_in, group=self.group, async_op=True)
            return Token(lambda s: work.wait() if s is None else _wait_on(work, s), None, self.device)
        work = _gather(flat_out, flat_in, group=self.group, async_op=True)
        return Token(lambda _s: work.wait(), None, self.device)

    def _borrow_scratch(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for one gather head, until :meth:`_return_scratch`.

        On CUDA one buffer serves every call: each call's copy out of it is queued on the comm stream
        right after its collective, before any later call's collective. On CPU that copy waits for
        ``token.wait()``, and a later call may start before it: the call owns the buffer until then
        (a call that finds it lent out gets a new one).
        """
        buf = self._scratch
        if buf is None or buf.numel() < nbytes:
            self._scratch = buf = None  # the old one goes first (CUDA: its last use is ordered before ours)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._scratch = buf if self.device.type == "cuda" else None
        return buf

    def _return_scratch(self, buf: torch.Tensor) -> None:
        """Take back a buffer from :meth:`_borrow_scratch` once its copy is done (keep the larger one)."""
        if not self._closed and (self._scratch is None or self._scratch.numel() < buf.numel()):
            self._scratch = buf

    # --- checks and the automatic split --------------------------------------------------------------

    def _validate(self, out: torch.Tensor, inp: torch.Tensor, ratio: int | str) -> None:
        """Collective on the first call of a shape: every rank raises the same error for bad input."""
        problems = 0
        tensors = isinstance(inp, torch.Tensor) and isinstance(out, torch.Tensor)
        if not tensors:
            problems |= 32
        if _ratio_problem(ratio) is not None:
            problems |= 64
        if tensors:
            if not inp.is_contiguous():
                problems |= 1
            if not out.is_contiguous():
                problems |= 2
            if out.numel() != self.world * inp.numel():
                problems |= 4
            if out.dtype != inp.dtype:
                problems |= 8
            if inp.device != self.device or out.device != self.device:
                problems |= 16
        code = -2 if problems & 64 else (-1 if ratio == "auto" else int(ratio))
        if problems == 0:
            key = (inp.numel(), inp.dtype, out.numel(), out.dtype, inp.device, out.device, code)
            if key in self._validated:
                return
        if problems & (32 | 64) and self._validated:
            # Past the first calls the peers may hold this shape as checked and skip the collective check: this rank
            # would wait in it alone. Said here, at once (the first call of a shape says it on every rank).
            if problems & 32:
                raise InvalidType("all_gather: out and inp must both be torch.Tensor")
            raise InvalidValue(f"all_gather: {_ratio_problem(ratio)}")
        count, dtype_id = (inp.numel(), zlib.crc32(str(inp.dtype).encode())) if tensors else (-1, 0)
        meta = torch.tensor([count, dtype_id, problems, code], dtype=torch.int64)
        gathered = torch.empty(self.world * 4, dtype=torch.int64, device=self.device)
        _gather(gathered, meta.to(self.device), group=self.group)
        rows = [tuple(r) for r in gathered.view(self.world, 4).tolist()]
        messages = []
        names = {
            32: "out and inp must both be torch.Tensor",
            64: "ratio: expected 'auto', None or an int >= 0",
            1: "inp is not contiguous",
            2: "out is not contiguous",
            4: "out has the wrong number of elements (need world * inp.numel())",
            8: "out.dtype differs from inp.dtype",
            16: f"tensors are not on {self.device.type} as the group's backend needs",
        }
        for r, (_, _, bits, _) in enumerate(rows):
            messages += [f"rank {r}: {text}" for bit, text in names.items() if bits & bit]
        if messages:
            kind = InvalidType if any(row[2] & (8 | 16 | 32) for row in rows) else InvalidValue
            raise kind("all_gather: " + "; ".join(messages))
        if len({(n, d) for n, d, _, _ in rows}) != 1:
            detail = ", ".join(f"rank {r}: {n} elements, dtype #{d:x}" for r, (n, d, _, _) in enumerate(rows))
            raise InvalidValue(f"inp: size and dtype must match on every rank ({detail})")
        if len({row[3] for row in rows}) != 1:
            detail = ", ".join(f"rank {r}: {'auto' if c < 0 else c}" for r, (_, _, _, c) in enumerate(rows))
            raise InvalidValue(f"ratio: must match on every rank ({detail})")
        self._validated.add(key)

    def _choose(self, out: torch.Tensor, inp: torch.Tensor, ratio: int | str) -> tuple[int, str]:
        """The split for this call: ``(ratio, head)``; ratio 0 means the collective alone."""
        if ratio != "auto":
            return int(ratio), self.default_head
        nbytes = inp.numel() * inp.element_size()
        if not self.host_path_enabled or self.world == 1 or nbytes < AUTO_MIN_BYTES:
            return 0, self.default_head
        key = (self.world, str(inp.dtype), int(math.log2(nbytes)))
        if key not in self._auto:
            self._auto[key] = self._measure(out, inp)
            log.info("hybrid all-gather: auto ratio for %s -> %s", key, self._auto[key])
        return self._auto[key]

    @property
    def default_head(self) -> str:
        """How a fixed ratio moves the heads (``head`` unless "auto": p2p on two ranks, else gather)."""
        if self.head != "auto":
            return self.head
        return "p2p" if self.world == 2 else "gather"

    def _measure(self, out: torch.Tensor, inp: torch.Tensor, iters: int = 3) -> tuple[int, str]:
        """Collective: time every candidate split on these tensors; all ranks pick the same one."""
        heads = HEADS if self.head == "auto" else (self.head,)
        candidates = [(0, self.default_head)]
        for r in AUTO_CANDIDATES:  # ratio 1 leaves no head: one candidate, whatever the head
            if r and inp.numel() // r > 0:
                candidates += [(r, h) for h in (heads if inp.numel() // r < inp.numel() else heads[:1])]
        try:
            self._ensure_capacity(max((inp.numel() // r for r, _ in candidates if r), default=0) * inp.element_size())
        except (RuntimeError, CapacityError) as exc:  # raised on every rank alike (setup agrees collectively)
            log.warning("hybrid all-gather: host path unavailable at this size, using the collective: %s", exc)
            return candidates[0]
        for r, h in candidates:  # warm-up: first use of each leg (P2P communicators, page faults)
            self._run(out, inp, r, h)
        t = self._slowest([self._time_split(out, inp, c, iters) for c in candidates])
        best = min(range(len(t)), key=t.__getitem__)
        if best == 0 or t[best] >= AUTO_MARGIN * t[0]:
            return candidates[0]
        # Confirm against the collective alone, interleaved, so one noisy batch cannot pick a loser.
        pair = (candidates[0], candidates[best])
        again = [0.0, 0.0]
        for _ in range(3):
            for i, c in enumerate(pair):
                again[i] += self._time_split(out, inp, c, iters)
        t0, t1 = self._slowest(again)
        return pair[1] if t1 < AUTO_MARGIN * t0 else pair[0]

    def _time_split(self, out: torch.Tensor, inp: torch.Tensor, split: tuple[int, str], iters: int) -> float:
        self._sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            self._run(out, inp, *split)
        self._sync()
        return (time.perf_counter() - t0) / iters

    def _slowest(self, times: list[float]) -> list[float]:
        """Collective: each entry's maximum over the ranks (a collective is as fast as its slowest rank)."""
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def _sync(self) -> None:
        # The current stream only: results are ordered on it, and a device-wide synchronize would also
        # wait for (and time) whatever the application runs on its other streams.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def auto_choices(self) -> dict[tuple[int, str, int], tuple[int, str]]:
        """What ``ratio="auto"`` picked so far: ``(world, dtype, log2 bytes) -> (ratio, head)``.

        Ratio 0 means the collective alone.
        """
        return dict(self._auto)

    def close(self) -> None:
        """Release the segments and the helper thread (local, not collective); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._teardown_host()
        self._scratch = None
        _live.discard(self)

    def __enter__(self) -> HybridAllGather:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ratio_problem(ratio) -> str | None:
    """What is wrong with a ``ratio`` argument, or None."""
    if ratio is None or (isinstance(ratio, str) and ratio == "auto"):
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0:
        return f"ratio: expected 'auto', None or an int >= 0, got {ratio!r}"
    return None


def _option_problems(*, ratio, hugepages, timeout, head, cross_node) -> list[tuple[str, str]]:
    """The constructor's local argument checks: ``(kind, message)`` with kind "type" or "value"."""
    problems = []
    if (text := _ratio_problem(ratio)) is not None:
        problems.append(("value", text))
    if hugepages not in (True, False, "auto"):
        problems.append(("value", f"hugepages: expected True, False or 'auto', got {hugepages!r}"))
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        problems.append(("type", f"timeout: expected a number of seconds, got {timeout!r}"))
    elif not (math.isfinite(timeout) and timeout > 0):
        problems.append(("value", f"timeout: expected a finite number of seconds > 0, got {timeout!r}"))
    if not (isinstance(head, str) and head in (*HEADS, "auto")):
        problems.append(("value", f"head: expected one of {(*HEADS, 'auto')}, got {head!r}"))
    if not (isinstance(cross_node, str) and cross_node in ("relay", "direct")):
        problems.append(("value", f"cross_node: expected 'relay' or 'direct', got {cross_node!r}"))
    return problems


def _by_rank(items: list[tuple[int, str]]) -> str:
    """``[(rank, text)]`` as "rank 1: a; ranks 0, 2: b" (ranks with the same text together, first seen first)."""
    ranks: dict[str, list[int]] = {}
    for r, text in items:
        ranks.setdefault(text, []).append(r)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}" for text, rs in ranks.items()
    )


def _wait_on(work, stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        work.wait()


def _parse_numa_map(numa_map, world: int) -> tuple[int, ...]:
    if isinstance(numa_map, Mapping):
        if set(numa_map) != set(range(world)):
            raise InvalidValue(f"numa_map: needs exactly the ranks 0..{world - 1}, got {list(numa_map)}")
        nodes = tuple(numa_map[r] for r in range(world))
    else:
        try:
            nodes = tuple(numa_map)
        except TypeError:
            raise InvalidType(f"numa_map: expected a sequence or a mapping of NUMA nodes, got {numa_map!r}") from None
        if len(nodes) != world:
            raise InvalidValue(f"numa_map: needs {world} entries, got {len(nodes)}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
        raise InvalidValue(f"numa_map: nodes must be ints >= 0, got {nodes}")
    return nodes


def _host_id() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@atexit.register
def _close_all() -> None:
    for ag in list(_live):
        try:
            ag.close()
        except Exception:  # exiting anyway; a half-closed segment is unmapped by the kernel
            log.debug("hybrid all-gather: close at exit failed", exc_info=True)


__all__ = ["AUTO_CANDIDATES", "HybridAllGather", "Token"]
