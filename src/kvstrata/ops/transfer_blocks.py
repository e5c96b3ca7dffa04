"""``transfer_blocks``: copy a list of KV blocks, every layer, between a paged device cache and a host pool.

One call moves ``len(ids)`` blocks x ``S*L`` segments, in either direction, by one of four methods:

* ``"zero_copy"``: one persistent Triton kernel reads/writes the (registered, pinned) host pool in place.
* ``"staging"``: device gather into a small ring + DMA, pipelined (:mod:`kvstrata.ops.staging`).
* ``"copy_engine"``: ``cudaMemcpyBatchAsync`` over merged runs: zero SMs (:mod:`kvstrata.ops.copy_engine`).
* ``"torch"``: plain torch indexing, per segment (the CPU implementation; works anywhere).
* ``"auto"``: per call, from the device's calibration (:mod:`kvstrata.ops.calibration`).

Async on the caller's current stream; also ``torch.ops.kvstrata.transfer_blocks`` for ``torch.compile``
and CUDA-graph capture (pass device ids and ``check=False`` there: checking device ids costs a sync).

Example::

    layout = KVLayout.from_vllm(kv_caches)
    pool = HostPool.allocate(layout, 1024)                 # block_first, pinned
    transfer_blocks(layout, pool, [3, 9, 4], [0, 1, 2], direction="d2h")   # offload 3 blocks
    transfer_blocks(layout, pool, [5, 6, 7], [0, 1, 2], direction="h2d")   # and load them back
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.memory.pinned import registry_generation
from kvstrata.ops import _transfer_plan as _plan
from kvstrata.ops import copy_engine
from kvstrata.ops._block_ids import (
    Ids,
    _as_ids,
    _as_tensor,
    _check_ids,
    _eager_ids,
    _host_np,
    _kernel_ids,
    _on_device,
    _staging_dev_ids,
)
from kvstrata.ops._common import interpreting
from kvstrata.ops.auto_policy import SMALL_BYTES
from kvstrata.ops.chunk_copy import alignment, default_ctas, launch_copy_chunks
from kvstrata.ops.kv_layout import HostPool, KVLayout
from kvstrata.ops.staging import Geometry, staging_steps, staging_transfer

METHODS = ("auto", "zero_copy", "staging", "copy_engine", "torch")
DIRECTIONS = ("d2h", "h2d")
# Default CTAs of the in-place kernel: SMs reading host memory (h2d) need more bytes in flight.
ZERO_COPY_CTAS = {"d2h": 16, "h2d": 32}


def transfer_blocks(
    device_layout: KVLayout,
    host_pool: HostPool,
    device_block_ids: Ids,
    host_block_ids: Ids,
    *,
    direction: str = "d2h",
    method: str = "auto",
    num_ctas: int | None = None,
    check: bool = True,
    concurrent: bool | None = None,
) -> None:
    """Copy blocks ``device_block_ids[i] <-> host_block_ids[i]`` for all layers (and K/V) in one call.

    ``direction="d2h"`` writes the host pool, ``"h2d"`` the device cache. Ids: lists, numpy arrays or
    int32/int64 tensors (host or device). ``num_ctas`` caps the SMs of the kernels. With ``check=True``
    (default) bad input raises ``ValueError``/``TypeError`` before anything is written; device-resident
    ids are then copied to the host (a sync). ``staging``/``copy_engine`` need the ids on the host.
    ``check=False`` trusts the ids' values (no range or duplicate check, no sync: what CUDA-graph capture
    and ``torch.compile(fullgraph=True)`` need, since the check reads the values): an id out of range then
    reads or writes outside the cache or the pool. The arguments' types and shapes are checked either way.

    ``method="auto"`` picks per call signature from the device's calibration, SM-frugal (details in
    :mod:`kvstrata.ops.auto_policy`): ``copy_engine`` (no SMs), then ``staging`` (a short gather, then
    DMA), whenever within 2% of the fastest measured method; ``zero_copy`` (SMs held for the whole
    transfer) for one request's blocks (<= 4 MiB, lowest latency), and for bulk transfers only where it
    beats both others by more than 25%, or when ``host_block_ids`` live on the device (the only method
    that reads them there without a sync). The choice is cached with the call's launch plan.

    ``concurrent`` (``method="auto"`` only): whether a transfer in the other direction runs at the same
    time, so ``auto`` picks from the two-direction calibration (the method that does best beside the
    one in flight, or the best pair). ``None`` (default) asks the device whether this process's last
    transfer the other way is still in flight; pass ``True``/``False`` when the caller knows better
    (e.g. a store and a load issued back to back from one thread). A bulk transfer alone also takes its
    side of the best pair when that costs it at most 2%, so a store and a load pair well whichever
    starts first.
    """
    _check_call(device_layout, host_pool, direction, method, num_ctas, concurrent)
    if torch.compiler.is_compiling():
        _compiled_call(device_layout, host_pool, device_block_ids, host_block_ids, direction, method, num_ctas, check)
        return
    rest = _eager(device_layout, host_pool, device_block_ids, host_block_ids, direction, method, num_ctas, check,
                  concurrent)  # fmt: skip
    if rest is not None:  # a staging call's pieces after the first
        for _ in rest:
            pass


def transfer_blocks_steps(
    device_layout: KVLayout,
    host_pool: HostPool,
    device_block_ids: Ids,
    host_block_ids: Ids,
    *,
    direction: str = "d2h",
    method: str = "auto",
    num_ctas: int | None = None,
    check: bool = True,
    concurrent: bool | None = None,
) -> Iterator[None]:
    """:func:`transfer_blocks` (eager) as a generator: each ``next()`` enqueues the next piece of a ``staging``
    transfer (other methods: the whole call in the first step). The call forks from the current stream of
    its first step and is joined back to that stream in its last; errors come at the first step. A generator
    closed (or dropped) before its end enqueues its remaining pieces at once: a call is never left half issued.

    Stepping a store and a load in turn starts both directions' DMAs within one piece's host time, however
    long each call takes to issue (what :func:`kvstrata.ops.calibration.store_and_load` does)::

        store = transfer_blocks_steps(layout, pool, dev_a, host_a, direction="d2h", concurrent=True)
        load = transfer_blocks_steps(layout, pool, dev_b, host_b, direction="h2d", concurrent=True)
        interleave(store, load)   # next() on each in turn until both are done
    """
    _check_call(device_layout, host_pool, direction, method, num_ctas, concurrent)
    rest = _eager(device_layout, host_pool, device_block_ids, host_block_ids, direction, method, num_ctas, check,
                  concurrent)  # fmt: skip
    if rest is not None:
        yield from rest


def interleave(*steps: Iterator[None]) -> None:
    """Step each generator (e.g. of :func:`transfer_blocks_steps`) in turn until all are exhausted."""
    live = list(steps)
    try:
        while live:
            live = [s for s in live if next(s, _DONE) is not _DONE]
    finally:  # one failed: the others are closed, which enqueues the rest of each at once
        for s in live:
            s.close()


_DONE = object()


def _check_call(device_layout, host_pool, direction, method, num_ctas, concurrent) -> None:
    if not isinstance(device_layout, KVLayout):
        raise InvalidType(f"device_layout must be a KVLayout, got {type(device_layout).__name__}")
    if not isinstance(host_pool, HostPool):
        raise InvalidType(f"host_pool must be a HostPool, got {type(host_pool).__name__}")
    if direction not in DIRECTIONS:
        raise InvalidValue(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if method not in METHODS:
        raise InvalidValue(f"method must be one of {METHODS}, got {method!r}")
    if num_ctas is not None and (isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1):
        raise InvalidValue(f"num_ctas must be None or an int >= 1, got {num_ctas!r}")
    if concurrent is not None and not isinstance(concurrent, bool):
        raise InvalidType(f"concurrent must be None or a bool, got {type(concurrent).__name__}")


def _eager(device_layout, host_pool, device_block_ids, host_block_ids, direction, method, num_ctas, check,
           concurrent) -> Iterator[None] | None:  # fmt: skip
    """Eager calls skip the dispatcher and run a cached launch plan (see kvstrata.ops._transfer_plan).

    Enqueues the call, or returns the steps left to enqueue: a staging call's pieces, one per step, the first
    of them when first stepped. Plain functions otherwise: a generator per call costs the latency path ~1 us."""
    dev_ids = _eager_ids(device_block_ids, "device_block_ids")
    host_ids = _eager_ids(host_block_ids, "host_block_ids")
    n = int(dev_ids.shape[0])
    if n != int(host_ids.shape[0]):
        raise InvalidValue(f"host_block_ids: {int(host_ids.shape[0])} ids, device_block_ids has {n}")
    if check:
        _check_ids(device_layout, host_pool, dev_ids, host_ids, direction)
    if n == 0:
        return None
    return _run_plan(device_layout, host_pool, dev_ids, host_ids, n, direction, method, num_ctas, check, concurrent)


def _compiled_call(device_layout, host_pool, device_block_ids, host_block_ids, direction, method, num_ctas, check):
    """Under torch.compile: the registered op (traced), arguments in its schema's form."""
    dev_ids = _as_ids(device_block_ids, "device_block_ids")
    host_ids = _as_ids(host_block_ids, "host_block_ids")
    if check:
        _validate(device_layout, host_pool, dev_ids, host_ids, direction, method)
    if dev_ids.numel() == 0:
        return
    torch.ops.kvstrata.transfer_blocks(
        *device_layout.op_args(),
        host_pool.tensor,
        dev_ids,
        host_ids,
        _geom_list(device_layout, host_pool),
        direction,
        method,
        num_ctas or 0,
    )


def _geom_list(layout: KVLayout, pool: HostPool) -> list[int]:
    return [layout.chunk_bytes, layout.block_stride, pool.block_stride, pool.seg_stride,
            int(pool.layout == "block_first"), layout.align]  # fmt: skip


def _check_signature(layout: KVLayout, pool: HostPool, method: str) -> None:
    """Checks that depend only on the call's signature (run once per launch plan)."""
    on_cuda = layout.device.type == "cuda"
    if method in ("zero_copy", "staging") and not on_cuda and not interpreting():
        raise InvalidValue(f"method={method!r} needs a CUDA device layout (or TRITON_INTERPRET=1)")
    if method == "copy_engine" and on_cuda and copy_engine._runtime() is None:
        raise InvalidValue("method='copy_engine' needs cuda-bindings (pip install cuda-bindings)")
    if method == "zero_copy" and on_cuda and not _host_mapped(pool.tensor):
        raise InvalidValue("host_pool: zero_copy needs pinned/registered host memory (kvstrata.memory.alloc_pinned)")
    lo, hi = pool.data_ptr, pool.data_ptr + pool.flat.numel()
    for t in layout.tensors:
        if t.device.type == "cpu":
            s = t.untyped_storage()
            if s.data_ptr() < hi and lo < s.data_ptr() + s.nbytes():
                raise InvalidValue("host_pool overlaps the device layout's tensors")


def _ids_kind(ids) -> object:
    return ids.dtype if isinstance(ids, torch.Tensor) else None  # device tensors specialise the kernel


def _run_plan(layout, pool, dev_ids, host_ids, n, direction, method, num_ctas, check,
              concurrent) -> Iterator[None] | None:  # fmt: skip
    device = layout.device
    busy, other = False, None
    # The other direction's state decides only a bulk auto call with host ids (a small call, one request's
    # blocks, or device-resident host ids have one answer whatever runs beside): skip its event query then.
    if (method == "auto" and device.type == "cuda" and n * layout.num_segments * layout.chunk_bytes > SMALL_BYTES
            and not isinstance(host_ids, torch.Tensor)):  # fmt: skip
        other = None if concurrent is False else _plan.other_direction_method(device, direction)
        busy = concurrent if concurrent is not None else other is not None
    key = (layout.seg_ptr_table.data_ptr(), layout.seg_ptrs, layout.chunk_bytes, layout.block_stride,
           layout.num_blocks, layout.align, pool.data_ptr, pool.num_blocks, pool.layout, pool.num_segments,
           pool.chunk_bytes, n, direction, method, num_ctas, check, busy, other, _ids_kind(dev_ids),
           _ids_kind(host_ids))  # fmt: skip
    plan = _plan.get_plan(key)
    if plan is None or not plan.usable(pool.tensor, registry_generation()):
        host_ids_on_device = isinstance(host_ids, torch.Tensor)
        plan = _build_plan(layout, pool, n, direction, method, num_ctas, check, busy, other, host_ids_on_device)
        _plan.put_plan(key, plan)
    if plan.device_index is None:
        return _execute_cpu(plan, layout, pool, dev_ids, host_ids)
    if torch.cuda.current_device() == plan.device_index:
        return _execute_cuda(plan, layout, pool, dev_ids, host_ids)
    with torch.cuda.device(plan.device_index):  # the whole call at once: a device guard must not span steps
        rest = _execute_cuda(plan, layout, pool, dev_ids, host_ids)
        for _ in rest or ():
            pass
    return None


def _build_plan(layout, pool, n, direction, method, num_ctas, check, busy, other=None,
                host_ids_on_device=False) -> _plan.TransferPlan:  # fmt: skip
    generation = registry_generation()  # read before the lookups: a change meanwhile invalidates the plan
    # whatever ``check`` says: a plan is built once per signature, and a method the device cannot run would
    # otherwise fail deep in Triton or the driver
    _check_signature(layout, pool, method)
    device = layout.device
    cuda = device.type == "cuda"
    if method == "auto":
        from kvstrata.ops.calibration import choose_method

        # Host block ids on the device: only the in-place kernel reads them without a sync (and under
        # graph capture), so the caller who put them there gets it; staging/copy_engine plan DMA on the host.
        methods = ("zero_copy",) if host_ids_on_device else None
        method = choose_method(direction, layout.chunk_bytes, n * layout.num_segments, device=device,
                               methods=methods, concurrent=busy, other=other)  # fmt: skip
    mapped = not cuda or _host_mapped(pool.tensor)
    if method == "zero_copy" and not mapped:
        # A pageable pool (auto's choice or check=False): the kernel cannot address it, DMA can.
        method = "staging"
    host = pool.tensor
    g = Geometry(
        seg_ptrs=layout.seg_ptrs,
        chunk=layout.chunk_bytes,
        dev_block_stride=layout.block_stride,
        host_base=host.data_ptr(),
        host_block_stride=pool.block_stride,
        host_seg_stride=pool.seg_stride,
        block_first=pool.layout == "block_first",
        align=alignment(layout.align, pool.block_stride, pool.seg_stride, host.data_ptr()),
    )
    plan = _plan.TransferPlan(method, direction, n, g, device, generation)
    if cuda and mapped:
        from kvstrata.memory import is_registered

        plan.recheck_pinned = not is_registered(host.data_ptr(), max(1, pool.flat.numel()))
    if method in ("zero_copy", "staging"):
        plan.ctas = num_ctas or (ZERO_COPY_CTAS[direction] if method == "zero_copy" else default_ctas(device))
    if method == "zero_copy":
        base = _host_device_ptr(host) if cuda else host.data_ptr()
        plan.set_kernel_shape(plan.ctas, layout.seg_ptr_table.data_ptr(), base)
    return plan


def _execute_cpu(plan, layout, pool, dev_ids, host_ids) -> Iterator[None] | None:
    """Off CUDA: the torch implementation, or the same kernels under the Triton interpreter (staging stepped
    piece by piece as on CUDA)."""
    m, device = plan.method, layout.device
    if m == "torch":
        _torch_copy(list(layout.tensors), plan.g, pool.flat, _as_tensor(dev_ids), _as_tensor(host_ids), plan.to_host)
    elif m == "copy_engine":
        _copy_engine_copy(list(layout.tensors), plan.g, pool.flat, _as_tensor(dev_ids), _as_tensor(host_ids),
                          plan.to_host, device)  # fmt: skip
    elif m == "zero_copy":
        plan.launch(_as_tensor(dev_ids), _as_tensor(host_ids), layout.seg_ptr_table)
    else:
        return staging_steps(plan.g, layout.seg_ptr_table, _as_tensor(dev_ids), _host_np(host_ids), pool.flat,
                             to_host=plan.to_host, num_ctas=plan.ctas)  # fmt: skip
    return None


def _execute_cuda(plan, layout, pool, dev_ids, host_ids) -> Iterator[None] | None:
    """On the plan's (current) device: enqueue the copy on the current stream, then mark the lane (staging:
    returns its pieces as steps, the lane marked after the last)."""
    device, m = layout.device, plan.method
    stream = _plan.current_stream(plan.device_index)
    capturing = torch.cuda.is_current_stream_capturing()
    lane = None if capturing else _plan.lane(device, plan.direction)
    k = None if lane is None else lane.acquire()
    if m == "zero_copy":
        d = _kernel_ids(dev_ids, "device_block_ids", lane, k, 0, device, capturing)
        h = _kernel_ids(host_ids, "host_block_ids", lane, k, 1, device, capturing)
        plan.launch(d, h, layout.seg_ptr_table)
    elif m == "copy_engine":
        da, ha, sizes = plan.runs(_host_np(dev_ids), _host_np(host_ids))
        src, dst = (da, ha) if plan.to_host else (ha, da)
        copy_engine.memcpy_batch(dst, src, sizes, device=device)
    elif m == "staging":
        d_ids = _staging_dev_ids(dev_ids, lane, k, plan.device_index)
        steps = staging_steps(plan.g, layout.seg_ptr_table, d_ids, _host_np(host_ids), pool.flat,
                              to_host=plan.to_host, num_ctas=plan.ctas)  # fmt: skip
        return _then_mark(steps, lane, k, stream, m)
    else:  # torch
        _torch_copy(list(layout.tensors), plan.g, pool.flat, _as_tensor(dev_ids), _as_tensor(host_ids), plan.to_host)
    if lane is not None:
        lane.mark(k, stream, m)
    return None


def _then_mark(steps: Iterator[None], lane, k: int | None, stream: torch.cuda.Stream, m: str) -> Iterator[None]:
    try:
        yield from steps  # closed early, the staging steps enqueue their rest at once (staging._issue_cuda)
    finally:
        if lane is not None:
            lane.mark(k, stream, m)


def _validate(layout: KVLayout, pool: HostPool, dev_ids: torch.Tensor, host_ids: torch.Tensor, direction: str,
              method: str) -> None:  # fmt: skip
    if not pool.matches(layout):
        raise InvalidValue(
            f"host_pool: {pool.num_segments} segments of {pool.chunk_bytes} B, the device layout has "
            f"{layout.num_segments} of {layout.chunk_bytes} B"
        )
    if dev_ids.numel() != host_ids.numel():
        raise InvalidValue(f"host_block_ids: {host_ids.numel()} ids, device_block_ids has {dev_ids.numel()}")
    d, h = dev_ids.cpu().numpy(), host_ids.cpu().numpy()  # a sync when the ids live on the device
    for name, v, n in (("device_block_ids", d, layout.num_blocks), ("host_block_ids", h, pool.num_blocks)):
        if v.size and (v.min() < 0 or v.max() >= n):
            raise InvalidValue(f"{name}: ids must be in [0, {n}), got range [{v.min()}, {v.max()}]")
    dst_name, dst = ("host_block_ids", h) if direction == "d2h" else ("device_block_ids", d)
    if np.unique(dst).size != dst.size:
        raise InvalidValue(f"{dst_name}: duplicate destination ids")
    _check_signature(layout, pool, method)


def _host_mapped(t: torch.Tensor) -> bool:
    try:
        from kvstrata.memory import is_registered
    except ImportError:
        is_registered = None
    if is_registered is not None and is_registered(t.data_ptr(), t.numel() * t.element_size()):
        return True
    return t.is_pinned()


def _host_device_ptr(t: torch.Tensor) -> int:
    """The device address of a host pool (equal to the host address under UVA)."""
    try:
        from kvstrata.memory import device_ptr
    except ImportError:
        return t.data_ptr()
    try:
        return device_ptr(t.data_ptr())
    except ValueError:  # torch-pinned memory is mapped under UVA but not in kvstrata's registry
        return t.data_ptr()


# -- the custom op ---------------------------------------------------------------------------------


def _transfer_blocks_impl(
    dev_tensors: list[torch.Tensor],
    seg_table: torch.Tensor,
    seg_ptrs: list[int],
    seg_owner: list[int],
    seg_offset: list[int],
    host: torch.Tensor,
    dev_ids: torch.Tensor,
    host_ids: torch.Tensor,
    geom: list[int],
    direction: str,
    method: str,
    num_ctas: int,
) -> None:
    """Body of ``torch.ops.kvstrata.transfer_blocks``.

    ``geom`` = [chunk bytes, device block stride, host block stride, host seg stride, block_first, device alignment].
    """
    _check_op_args(dev_ids, host_ids, direction, method)
    chunk, dbs, hbs, hss, block_first, dev_align = geom
    device = seg_table.device
    n = dev_ids.numel()
    if n == 0:
        return
    # Under torch.compile the tensors may arrive as functionalization clones: address those, not the originals.
    first, last = 0, len(seg_ptrs) - 1
    if (
        dev_tensors[seg_owner[first]].data_ptr() + seg_offset[first] != seg_ptrs[first]
        or dev_tensors[seg_owner[last]].data_ptr() + seg_offset[last] != seg_ptrs[last]
    ):
        seg_ptrs = [dev_tensors[o].data_ptr() + off for o, off in zip(seg_owner, seg_offset)]
        seg_table = torch.tensor(seg_ptrs, dtype=torch.int64).to(device)
    if method == "auto":
        from kvstrata.ops.calibration import choose_method

        on_device = host_ids.device.type == "cuda"  # only zero_copy reads them there without a sync
        method = choose_method(direction, chunk, n * len(seg_ptrs), device=device,
                               methods=("zero_copy",) if on_device else None)  # fmt: skip
    if method == "zero_copy" and device.type == "cuda" and not _host_mapped(host):
        # A pageable pool (auto's choice, check=False, or a compile-time clone): the kernel cannot address it,
        # DMA can. Never launch a kernel on an unmapped host address.
        method = "staging"
    host_flat = host.reshape(-1).view(torch.uint8)
    g = Geometry(
        seg_ptrs=tuple(seg_ptrs),
        chunk=chunk,
        dev_block_stride=dbs,
        host_base=host.data_ptr(),
        host_block_stride=hbs,
        host_seg_stride=hss,
        block_first=bool(block_first),
        align=alignment(dev_align, hbs, hss, host.data_ptr()),
    )
    to_host = direction == "d2h"
    if method == "torch":
        _torch_copy(dev_tensors, g, host_flat, dev_ids, host_ids, to_host)
        return
    if method == "copy_engine":
        _copy_engine_copy(dev_tensors, g, host_flat, dev_ids, host_ids, to_host, device)
        return
    ctas = num_ctas or (ZERO_COPY_CTAS[direction] if method == "zero_copy" else default_ctas(device))
    guard = torch.cuda.device(device) if device.type == "cuda" else _null()
    with guard:
        d_ids = _on_device(dev_ids, device, "device_block_ids")
        if method == "zero_copy":
            h_ids = _on_device(host_ids, device, "host_block_ids")
            base = _host_device_ptr(host) if device.type == "cuda" else host.data_ptr()
            launch_copy_chunks(
                seg_table, d_ids, h_ids, base, n_blocks=n, nseg=g.nseg, chunk_bytes=chunk, dev_block_stride=dbs,
                other_block_stride=hbs, other_seg_stride=hss, to_other=to_host, align=g.align, num_ctas=ctas,
            )  # fmt: skip
        elif method == "staging":
            staging_transfer(g, seg_table, d_ids, host_ids.cpu().numpy(), host_flat, to_host=to_host, num_ctas=ctas)
        else:
            raise InvalidValue(f"method must be one of {METHODS}, got {method!r}")


_transfer_blocks_op = torch.library.custom_op("kvstrata::transfer_blocks", mutates_args=("dev_tensors", "host"))(
    _transfer_blocks_impl
)


@_transfer_blocks_op.register_fake
def _(dev_tensors, seg_table, seg_ptrs, seg_owner, seg_offset, host, dev_ids, host_ids, geom, direction, method,
      num_ctas) -> None:  # fmt: skip
    _check_op_args(dev_ids, host_ids, direction, method)
    return None


def _check_op_args(dev_ids: torch.Tensor, host_ids: torch.Tensor, direction: str, method: str) -> None:
    """What ``torch.ops.kvstrata.transfer_blocks`` checks of its arguments whatever ``check`` says: their kinds
    and shapes, nothing that reads the ids' values (no sync; also under torch.compile)."""
    if direction not in DIRECTIONS:
        raise InvalidValue(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    if method not in METHODS:
        raise InvalidValue(f"method: expected one of {METHODS}, got {method!r}")
    for name, ids in (("device_block_ids", dev_ids), ("host_block_ids", host_ids)):
        if ids.dtype not in (torch.int32, torch.int64):
            raise InvalidType(f"{name}: expected int32 or int64 ids, got {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidValue(f"{name}: expected a 1-D tensor of ids, got shape {tuple(ids.shape)}")
    if dev_ids.shape[0] != host_ids.shape[0]:
        raise InvalidValue(f"host_block_ids: {host_ids.shape[0]} ids, device_block_ids has {dev_ids.shape[0]}")


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _chunk_addresses(g: Geometry, dev_ids: np.ndarray, host_ids: np.ndarray):
    """(device address, host address, segment) of every chunk, in the host pool's order."""
    seg = np.arange(g.nseg, dtype=np.int64)
    base = np.asarray(g.seg_ptrs, dtype=np.int64)
    d, h = dev_ids.astype(np.int64), host_ids.astype(np.int64)
    if g.block_first:  # (block, seg)
        da = base[None, :] + d[:, None] * g.dev_block_stride
        ha = g.host_base + h[:, None] * g.host_block_stride + seg[None, :] * g.host_seg_stride
        sg = np.broadcast_to(seg[None, :], da.shape)
    else:  # (seg, block)
        da = base[:, None] + d[None, :] * g.dev_block_stride
        ha = g.host_base + seg[:, None] * g.host_seg_stride + h[None, :] * g.host_block_stride
        sg = np.broadcast_to(seg[:, None], da.shape)
    return da.reshape(-1), ha.reshape(-1), sg.reshape(-1)


def merged_runs(g: Geometry, dev_ids: np.ndarray, host_ids: np.ndarray):
    """Merged (device address, host address, bytes) runs, in the host pool's order; runs never cross a segment."""
    da, ha, sg = _chunk_addresses(g, dev_ids, host_ids)
    return copy_engine.merge_runs(da, ha, g.chunk, keys=sg)


def _copy_engine_copy(dev_tensors, g, host_flat, dev_ids, host_ids, to_host, device) -> None:
    da, ha, sizes = merged_runs(g, dev_ids.cpu().numpy(), host_ids.cpu().numpy())
    if device.type == "cuda":
        with torch.cuda.device(device):
            src, dst = (da, ha) if to_host else (ha, da)
            copy_engine.memcpy_batch(dst, src, sizes, device=device)
        return
    spaces = _storages(dev_tensors)
    host_off = ha - host_flat.data_ptr()
    for (flat, lo), idx in _by_storage(spaces, da):
        if to_host:
            copy_engine.copy_runs_torch(host_flat, host_off[idx], flat, da[idx] - lo, sizes[idx])
        else:
            copy_engine.copy_runs_torch(flat, da[idx] - lo, host_flat, host_off[idx], sizes[idx])


def _storages(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))
            seen[s.data_ptr()] = (flat, s.data_ptr())
    return sorted(seen.values(), key=lambda x: x[1])


def _by_storage(spaces, addrs: np.ndarray):
    starts = np.array([lo for _, lo in spaces], dtype=np.int64)
    which = np.searchsorted(starts, addrs, side="right") - 1
    for k in np.unique(which):
        yield spaces[int(k)], np.flatnonzero(which == k)


def _torch_copy(dev_tensors, g: Geometry, host_flat, dev_ids, host_ids, to_host) -> None:
    """Per segment: ``host[seg][host_ids] = dev[seg][dev_ids]`` (or the reverse) with torch indexing.

    The CPU implementation, and a slow but simple path on CUDA (synchronous for d2h)."""
    spaces = _storages(dev_tensors)
    starts = np.array([lo for _, lo in spaces], dtype=np.int64)
    d_ids = dev_ids.to(spaces[0][0].device, dtype=torch.int64)
    h_ids = host_ids.to(torch.int64).cpu()
    n_host = host_flat.numel() // (g.nseg * g.chunk)
    for seg, ptr in enumerate(g.seg_ptrs):
        flat, lo = spaces[int(np.searchsorted(starts, ptr, side="right") - 1)]
        n_dev = (flat.numel() - (ptr - lo) - g.chunk) // g.dev_block_stride + 1
        dev = flat.as_strided((n_dev, g.chunk), (g.dev_block_stride, 1), ptr - lo)
        offset = host_flat.storage_offset() + seg * g.host_seg_stride
        hst = host_flat.as_strided((n_host, g.chunk), (g.host_block_stride, 1), offset)
        if to_host:
            hst.index_copy_(0, h_ids, dev.index_select(0, d_ids).cpu())
        else:
            dev.index_copy_(0, d_ids, hst.index_select(0, h_ids).to(dev.device))


__all__ = ["DIRECTIONS", "METHODS", "ZERO_COPY_CTAS", "interleave", "merged_runs", "transfer_blocks",
           "transfer_blocks_steps"]  # fmt: skip
