"""HeteroFusedKernels' multi-layer KV block transfer, both directions, three methods.

A host block ``[T, L, H, D]`` (token-major, contiguous, in registered host memory) maps to, for each
layer ``l``, a device slice ``[H, T, D]`` at address ``layer_ptrs[l]``::

    host_block[t, l, h, :]  <->  layer_l[h, t, :]

Methods:

* ``"zero_copy"``: one Triton kernel reads (h2d) or writes (d2h) host memory in place over PCIe.
* ``"staging"``: :mod:`kvstrata.ops.staging`, the engine of ``transfer_blocks``' staging method: a
  token is a block and each (layer, head) row a segment, so a token range of the host block is one
  contiguous piece; per 32 MiB piece a gather kernel (high-priority stream) packs the rows into a ring
  slot and one DMA moves it (reversed for h2d), the kernel of piece ``i+1`` overlapping the DMA of
  piece ``i``. Streams are forked and joined with events: no host synchronisation.
* ``"auto"``: :func:`choose_method`: the device's calibration (:mod:`kvstrata.ops.calibration`, the
  same measured rates and SM-frugal policy as ``transfer_blocks``, with a row as the chunk), or a
  size threshold without one.

Layer pointers must be aligned like the rows they address (any slice of a torch allocation at a row
boundary is). Rows of any size work: the kernel loops over ``D`` in tiles.

Example (oracle of the tests)::

    pool = torch.empty(num_blocks, L, H, T, D, dtype=torch.bfloat16, device="cuda")
    ptrs = torch.tensor([pool[b, l].data_ptr() for l in range(L)], dtype=torch.int64, device="cuda")
    multi_layer_block_transfer(ptrs, host_block, direction="h2d")
    assert torch.equal(pool[b].permute(2, 0, 1, 3).cpu(), host_block)
"""

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.memory.pinned import device_alias, is_registered
from kvstrata.ops._common import (
    TileConfig,
    as_words,
    check_choice,
    check_contiguous,
    check_dtype,
    check_ndim,
    check_optional_positive_int,
    check_tensor,
    launch_config,
    pinned_copy_to,
    runs_triton,
    vec_words,
    word_bytes_for,
)
from kvstrata.ops.chunk_copy import alignment, default_ctas
from kvstrata.ops.staging import Geometry, _arange, staging_transfer

TILE = TileConfig(tile_bytes=16384, max_row_bytes=4096, num_warps=4, ctas_per_sm=4)
DIRECTIONS = ("h2d", "d2h")
METHODS = ("auto", "zero_copy", "staging")
STAGING_MIN_BYTES = 256 << 10  # auto without a calibration: below this one in-place kernel beats DMA + gather


@triton.jit
def _block_transfer_kernel(
    host_ptr,
    layer_ptrs_ptr,
    n_rows,
    t_start,
    n_tokens_total,
    n_layers,
    n_heads,
    row_words,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    VEC: tl.constexpr,
    EVEN_COLS: tl.constexpr,
    TO_DEVICE: tl.constexpr,
):
    """Rows ``r`` of the host block piece (``host_ptr``, tokens from ``t_start``) <-> layer slices."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    col_tiles = tl.cdiv(row_words, BLOCK_WORDS)
    tiles = tl.cdiv(n_rows, BLOCK_ROWS) * col_tiles
    for tile in range(pid, tiles, nprog):
        row_tile = tile // col_tiles
        col_tile = tile - row_tile * col_tiles
        rows = row_tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < n_rows
        r = rows.to(tl.int64)
        head = r % n_heads
        layer = (r // n_heads) % n_layers
        token = r // (n_heads * n_layers) + t_start
        base = tl.load(layer_ptrs_ptr + layer, mask=row_ok, other=0).to(tl.pointer_type(host_ptr.dtype.element_ty))
        dev_rows = base + tl.multiple_of((head * n_tokens_total + token) * row_words, VEC)
        host_rows = host_ptr + tl.multiple_of(r * row_words, VEC)
        cols = col_tile * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
        if EVEN_COLS:  # noqa: SIM108 (constexpr branch: no mask math along columns)
            mask = row_ok[:, None]
        else:
            mask = row_ok[:, None] & (cols < row_words)[None, :]
        if TO_DEVICE:
            values = tl.load(host_rows[:, None] + cols[None, :], mask=mask)
            tl.store(dev_rows[:, None] + cols[None, :], values, mask=mask)
        else:
            values = tl.load(dev_rows[:, None] + cols[None, :], mask=mask)
            tl.store(host_rows[:, None] + cols[None, :], values, mask=mask)


@dataclass(frozen=True)
class _Geometry:
    L: int
    H: int
    T: int
    word: int
    row_words: int
    vec: int


def _launch(
    piece: torch.Tensor, ptrs: torch.Tensor, t_start: int, geo: _Geometry, to_device: bool, num_ctas: int | None
) -> None:
    """Transpose-copy one token range; ``piece`` is ``[n, L, H, D]`` words on the kernel's device."""
    n_rows = piece.shape[0] * geo.L * geo.H
    if n_rows == 0:
        return
    cfg = launch_config(n_rows, geo.row_words, geo.word, device=piece.device, tile=TILE, num_ctas=num_ctas)
    _block_transfer_kernel[(cfg.grid,)](
        piece,
        ptrs,
        n_rows,
        t_start,
        geo.T,
        geo.L,
        geo.H,
        geo.row_words,
        BLOCK_ROWS=cfg.block_rows,
        BLOCK_WORDS=cfg.block_words,
        VEC=geo.vec,
        EVEN_COLS=geo.row_words % cfg.block_words == 0,
        TO_DEVICE=to_device,
        num_warps=cfg.num_warps,
    )


def choose_method(
    nbytes: int, direction: str, *, row_bytes: int | None = None, device: torch.device | None = None
) -> str:
    """``method="auto"`` for a block of ``nbytes`` made of ``row_bytes`` rows, moved on ``device``.

    On a CUDA device with a row size: the calibration's choice among ``zero_copy`` and ``staging`` with a
    row as the chunk (what was slow before: a fixed threshold chose staging for every block >= 256 KiB,
    whatever the device measured). Otherwise: staging from ``STAGING_MIN_BYTES``, else zero_copy.
    """
    if row_bytes and device is not None and device.type == "cuda":
        from kvstrata.ops import calibration

        m = calibration.choose_method(direction, row_bytes, max(1, nbytes // row_bytes), device=device,
                                      methods=("zero_copy", "staging"))  # fmt: skip
        if m in ("zero_copy", "staging"):
            return m
    return "staging" if nbytes >= STAGING_MIN_BYTES else "zero_copy"


def block_transfer_reference(layer_ptrs: torch.Tensor, host_block: torch.Tensor, direction: str) -> None:
    """Plain-torch transfer on CPU (layer pointers are host addresses): the semantics, spelled out."""
    import ctypes

    T, _, H, D = host_block.shape
    nbytes = H * T * D * host_block.element_size()
    if nbytes == 0:
        return
    for layer_index, ptr in enumerate(layer_ptrs.tolist()):
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        layer = torch.frombuffer(raw, dtype=torch.uint8).view(host_block.dtype).view(H, T, D)
        if direction == "h2d":
            layer.copy_(host_block[:, layer_index].permute(1, 0, 2))
        else:
            host_block[:, layer_index].copy_(layer.permute(1, 0, 2))


def _check_meta(
    layer_ptrs: torch.Tensor,
    host_block: torch.Tensor,
    direction: str,
    method: str,
    staging: torch.Tensor | None,
    num_ctas: int | None,
) -> None:
    check_tensor(layer_ptrs, "layer_ptrs")
    check_tensor(host_block, "host_block")
    check_choice(direction, "direction", DIRECTIONS)
    check_choice(method, "method", METHODS)
    check_optional_positive_int(num_ctas, "num_ctas")
    check_ndim(host_block, "host_block", 4)
    check_dtype(host_block, "host_block")
    check_contiguous(host_block, "host_block")
    if host_block.device.type != "cpu":
        raise InvalidValue(f"host_block: must be in host memory, got a tensor on {host_block.device}")
    check_ndim(layer_ptrs, "layer_ptrs", 1)
    if layer_ptrs.dtype != torch.int64:
        raise InvalidType(f"layer_ptrs: expected int64 addresses, got {layer_ptrs.dtype}")
    if layer_ptrs.shape[0] != host_block.shape[1]:
        raise InvalidValue(f"layer_ptrs: {layer_ptrs.shape[0]} pointers for {host_block.shape[1]} layers in host_block")
    if staging is not None:
        check_tensor(staging, "staging")
        check_ndim(staging, "staging", 4)
        check_contiguous(staging, "staging")
        if staging.dtype != host_block.dtype:
            raise InvalidType(f"staging: dtype {staging.dtype} differs from host_block's {host_block.dtype}")
        if tuple(staging.shape[1:]) != tuple(host_block.shape[1:]) or staging.shape[0] < 1:
            raise InvalidValue(f"staging: expected shape [S >= 1, {', '.join(map(str, host_block.shape[1:]))}]")


def _host_word(host_block: torch.Tensor, layer_ptrs: torch.Tensor, staging: torch.Tensor | None) -> int:
    row_bytes = host_block.shape[3] * host_block.element_size()
    addrs = [host_block.data_ptr()] + ([staging.data_ptr()] if staging is not None else [])
    if layer_ptrs.device.type == "cpu":
        addrs += layer_ptrs.tolist()
    return word_bytes_for(row_bytes, *addrs)


def _impl(
    layer_ptrs: torch.Tensor,
    host_block: torch.Tensor,
    direction: str,
    method: str,
    staging: torch.Tensor | None,
    num_ctas: int | None,
) -> None:
    _check_meta(layer_ptrs, host_block, direction, method, staging, num_ctas)
    if layer_ptrs.device.type == "cpu" and host_block.numel() and (layer_ptrs <= 0).any():
        bad = int((layer_ptrs <= 0).nonzero()[0])
        raise InvalidValue(f"layer_ptrs: layer {bad}'s pointer is {int(layer_ptrs[bad])} (null or negative)")
    T, L, H, D = host_block.shape
    if host_block.numel() == 0:
        return
    to_device = direction == "h2d"
    cuda = torch.cuda.is_available()
    if method == "auto":
        nbytes = host_block.numel() * host_block.element_size()
        device = _device_of(layer_ptrs, staging) if cuda else None
        method = choose_method(nbytes, direction, row_bytes=D * host_block.element_size(), device=device)
    if not cuda and not runs_triton(host_block, layer_ptrs):
        block_transfer_reference(layer_ptrs, host_block, direction)
        return
    word = _host_word(host_block, layer_ptrs, staging)
    row_words = D * host_block.element_size() // word
    geo = _Geometry(L, H, T, word, row_words, vec_words(word, row_words, host_block.data_ptr() // word))
    if not cuda:  # Triton interpreter on CPU memory: same kernels, same piece plan, no streams
        ptrs = layer_ptrs.contiguous()
        if method == "zero_copy":
            _launch(as_words(host_block, word), ptrs, 0, geo, to_device, num_ctas)
        else:
            _staged(host_block, ptrs, staging, geo, to_device, num_ctas)
        return
    device = _device_of(layer_ptrs, staging)
    if staging is not None and staging.device != device:
        raise InvalidValue(f"staging: on {staging.device}, layer_ptrs on {device}")
    with torch.cuda.device(device):
        ptrs = pinned_copy_to(layer_ptrs.contiguous(), device)
        if method == "zero_copy":
            try:
                host_d = device_alias(host_block, device)
            except ValueError as exc:
                raise InvalidValue(f"host_block: zero_copy needs registered or pinned host memory ({exc})") from exc
            _launch(as_words(host_d, word), ptrs, 0, geo, to_device, num_ctas)
        else:
            if not (host_block.is_pinned() or is_registered(host_block.data_ptr(), host_block.numel())):
                raise InvalidValue("host_block: staging needs registered or pinned host memory (pageable DMA blocks)")
            _staged(host_block, ptrs, staging, geo, to_device, num_ctas)


def _device_of(layer_ptrs: torch.Tensor, staging: torch.Tensor | None) -> torch.device:
    if staging is not None and staging.device.type == "cuda":
        return staging.device
    if layer_ptrs.device.type == "cuda":
        return layer_ptrs.device
    return torch.device("cuda", torch.cuda.current_device())


def _staged(
    host_block: torch.Tensor,
    ptrs: torch.Tensor,
    staging: torch.Tensor | None,
    geo: _Geometry,
    to_device: bool,
    num_ctas: int | None,
) -> None:
    """The staging method through :func:`kvstrata.ops.staging.staging_transfer` (see the module docstring).

    Token ``t`` is block ``t`` on both sides; segment ``l*H + h`` starts at ``layer_ptrs[l] + h*T*row`` on
    the device (rows of a head are consecutive tokens) and at ``(l*H + h)*row`` within a host token."""
    T, L, H, _ = host_block.shape
    row = geo.row_words * geo.word
    device = ptrs.device
    if H == 1:
        seg_table = ptrs
    else:  # computed on the device: reading device-resident layer pointers on the host would sync
        offsets = torch.arange(H, dtype=torch.int64, device=device) * (T * row)
        seg_table = (ptrs[:, None] + offsets[None, :]).reshape(-1)
    g = Geometry(
        seg_ptrs=(0,) * (L * H),  # the addresses live in seg_table (on the device); staging needs their count
        chunk=row,
        dev_block_stride=row,
        host_base=host_block.data_ptr(),
        host_block_stride=L * H * row,
        host_seg_stride=row,
        block_first=True,
        align=alignment(geo.word, row, host_block.data_ptr()),
    )
    dev_ids = _arange(T, device) if device.type == "cuda" else torch.arange(T, dtype=torch.int32)
    ctas = num_ctas or default_ctas(device)
    staging_transfer(g, seg_table, dev_ids, np.arange(T, dtype=np.int64), host_block.view(torch.uint8).reshape(-1),
                     to_host=not to_device, num_ctas=ctas, ring=staging)  # fmt: skip


# Registered ops. ``layer_ptrs`` stands for the device memory it addresses: h2d declares it mutated
# so torch.compile neither drops nor reorders the call; the host block is declared mutated only by
# d2h (a functionalized copy of it would not be registered memory).
_TAIL = "str method, Tensor(c!)? staging, int? num_ctas) -> ()"


@torch.library.custom_op(
    "kvstrata::multi_layer_block_transfer",
    mutates_args=("layer_ptrs", "host_block", "staging"),
    schema="(Tensor(a!) layer_ptrs, Tensor(b!) host_block, str direction, " + _TAIL,
)
def _op(layer_ptrs, host_block, direction, method, staging, num_ctas) -> None:
    _impl(layer_ptrs, host_block, direction, method, staging, num_ctas)


@_op.register_fake
def _(layer_ptrs, host_block, direction, method, staging, num_ctas) -> None:
    _check_meta(layer_ptrs, host_block, direction, method, staging, num_ctas)


@torch.library.custom_op(
    "kvstrata::block_transfer_h2d",
    mutates_args=("layer_ptrs", "staging"),
    schema="(Tensor(a!) layer_ptrs, Tensor host_block, " + _TAIL,
)
def _op_h2d(layer_ptrs, host_block, method, staging, num_ctas) -> None:
    _impl(layer_ptrs, host_block, "h2d", method, staging, num_ctas)


@_op_h2d.register_fake
def _(layer_ptrs, host_block, method, staging, num_ctas) -> None:
    _check_meta(layer_ptrs, host_block, "h2d", method, staging, num_ctas)


@torch.library.custom_op(
    "kvstrata::block_transfer_d2h",
    mutates_args=("host_block", "staging"),
    schema="(Tensor layer_ptrs, Tensor(b!) host_block, " + _TAIL,
)
def _op_d2h(layer_ptrs, host_block, method, staging, num_ctas) -> None:
    _impl(layer_ptrs, host_block, "d2h", method, staging, num_ctas)


@_op_d2h.register_fake
def _(layer_ptrs, host_block, method, staging, num_ctas) -> None:
    _check_meta(layer_ptrs, host_block, "d2h", method, staging, num_ctas)


def multi_layer_block_transfer(
    layer_ptrs: torch.Tensor,
    host_block: torch.Tensor,
    *,
    direction: str = "h2d",
    method: str = "auto",
    staging: torch.Tensor | None = None,
    num_ctas: int | None = None,
) -> None:
    """Copy host block ``[T, L, H, D]`` to (``"h2d"``) or from (``"d2h"``) the layer slices ``[H, T, D]``.

    Args:
        layer_ptrs: int64 tensor of ``L`` device addresses (on the GPU or the host).
        host_block: contiguous ``[T, L, H, D]`` in registered or pinned host memory; bf16, fp16,
            fp32, int8, uint8 or fp8.
        direction: ``"h2d"`` or ``"d2h"``.
        method: ``"zero_copy"``, ``"staging"`` or ``"auto"`` (see the module docstring).
        staging: device buffer ``[S, L, H, D]`` (``S >= 1`` tokens) for the staging method; taken from
            torch's caching allocator when None. Reused across calls safely (stream-ordered).
        num_ctas: cap on the programs (SMs) the kernels occupy.

    Asynchronous on the current stream. Without CUDA the same call runs on CPU, with
    ``layer_ptrs`` holding host addresses.
    """
    check_tensor(layer_ptrs, "layer_ptrs")  # before the dispatcher, which would reject it less helpfully
    check_tensor(host_block, "host_block")
    if staging is not None:
        check_tensor(staging, "staging")
    check_choice(direction, "direction", DIRECTIONS)
    check_choice(method, "method", METHODS)
    check_optional_positive_int(num_ctas, "num_ctas")
    if not torch.compiler.is_compiling():
        # Eager calls skip the dispatcher: it costs ~100 us of host time per call, longer than the copy
        # of one request's blocks; torch.compile and export still see the registered op.
        _impl(layer_ptrs, host_block, direction, method, staging, num_ctas)
        return
    op = torch.ops.kvstrata.block_transfer_h2d if direction == "h2d" else torch.ops.kvstrata.block_transfer_d2h
    op(layer_ptrs, host_block, method, staging, num_ctas)


def fused_memcpy_multi_layer_block_transfer(
    layer_ptrs: torch.Tensor,
    host_block: torch.Tensor,
    staging: torch.Tensor | None = None,
    *,
    direction: str = "h2d",
    num_ctas: int | None = None,
) -> None:
    """HeteroFusedKernels' name for ``multi_layer_block_transfer(..., method="staging")``."""
    multi_layer_block_transfer(
        layer_ptrs, host_block, direction=direction, method="staging", staging=staging, num_ctas=num_ctas
    )


__all__ = [
    "TILE",
    "block_transfer_reference",
    "choose_method",
    "fused_memcpy_multi_layer_block_transfer",
    "multi_layer_block_transfer",
]
