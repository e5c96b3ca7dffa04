"""KV cache layouts reduced to one addressing scheme, so one copy kernel serves every engine.

A device KV cache is a set of *segments* (one per layer for MLA, two per layer -- K then V -- otherwise),
``seg = layer * S + s``. Every segment holds ``num_blocks`` *chunks* of ``chunk_bytes`` bytes (one block of
one layer's K or V), ``block_stride`` bytes apart. So block ``b`` of segment ``seg`` lives at
``seg_ptrs[seg] + b * block_stride``.

A host pool holds ``num_blocks`` host blocks of the same segments; chunk ``(block h, seg)`` lives at
``base + h * block_stride + seg * seg_stride``:

* ``"block_first"`` ``[N, L, S, chunk]``: every layer of a block is contiguous, so one block is one
  storable object (``HostPool.block_view(h)``).
* ``"layer_first"`` ``[L, S, N, chunk]``: one contiguous area per layer and K/V.

Example::

    caches = [torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    layout = KVLayout.from_vllm(caches)          # 8 segments of 32 KiB chunks
    pool = HostPool.allocate(layout, 128)        # pinned where CUDA exists
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvstrata.errors import InvalidType, InvalidValue

HostLayoutName = Literal["block_first", "layer_first"]
HOST_LAYOUTS = ("block_first", "layer_first")


def _byte_base(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of ``t`` (alias, no copy)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _seg_view(t: torch.Tensor, byte_offset: int, num_blocks: int, block_stride: int, chunk: int) -> torch.Tensor:
    """``[num_blocks, chunk]`` uint8 view of one segment of ``t`` (``byte_offset`` from ``t``'s first element)."""
    base = _byte_base(t)
    start = t.storage_offset() * t.element_size() + byte_offset
    return base.as_strided((num_blocks, chunk), (block_stride, 1), start)


@dataclass(frozen=True)
class KVLayout:
    """A paged device KV cache as ``S * L`` segment base pointers, a block stride and a chunk size.

    Build one with :meth:`from_vllm`, :meth:`from_sglang` or :meth:`from_mla`; the tensors are kept
    alive by the layout (``tensors``) and written in place by ``transfer_blocks(direction="h2d")``.
    """

    kind: str
    num_layers: int
    num_kv: int  # S: 2 (K, V) or 1 (MLA)
    num_blocks: int
    block_stride: int  # bytes between blocks of one segment
    chunk_bytes: int  # one block of one layer's K or V
    dtype: torch.dtype
    device: torch.device
    seg_ptrs: tuple[int, ...]
    seg_owner: tuple[int, ...]  # index into ``tensors`` of each segment's tensor
    seg_offset: tuple[int, ...]  # bytes from that tensor's data_ptr() to the segment base
    align: int  # largest power of two <= 16 dividing every segment base, the block stride and the chunk
    seg_ptr_table: torch.Tensor = field(repr=False, compare=False)  # int64 [S*L] on ``device``
    seg_views: tuple[torch.Tensor, ...] = field(repr=False, compare=False)  # uint8 [num_blocks, chunk] each
    tensors: tuple[torch.Tensor, ...] = field(repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return self.num_layers * self.num_kv

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (and K/V): one host block."""
        return self.num_segments * self.chunk_bytes

    def op_args(self) -> tuple[list[torch.Tensor], torch.Tensor, list[int], list[int], list[int]]:
        """The layout's arguments of ``torch.ops.kvstrata.transfer_blocks`` (tensors, table, ptrs, owners, offsets)."""
        return list(self.tensors), self.seg_ptr_table, list(self.seg_ptrs), list(self.seg_owner), list(self.seg_offset)

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_vllm(cls, kv_caches: Sequence[torch.Tensor]) -> KVLayout:
        """vLLM: one ``[2, num_blocks, block_size, heads, head_dim]`` tensor per layer (K = [0], V = [1]).

        Any strides on the first two dims are accepted (e.g. a ``[num_blocks, 2, ...]`` cache passed as
        ``t.transpose(0, 1)``); one block of K or V must be contiguous.
        """
        tensors = _check_list(kv_caches, "kv_caches", ndim=5)
        segs: list[tuple[torch.Tensor, int]] = []
        t0 = tensors[0]
        if t0.shape[0] != 2:
            raise InvalidValue(f"kv_caches: dim 0 must be 2 (K, V), got shape {tuple(t0.shape)}")
        for i, t in enumerate(tensors):
            _check_inner_contiguous(t, 2, f"kv_caches[{i}]")
            segs += [(t, 0), (t, t.stride(0) * t.element_size())]
        return cls._build("vllm", tensors, segs, num_kv=2, num_blocks=t0.shape[1], block_dim=1, block_span=1)

    @classmethod
    def from_sglang(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int = 1
    ) -> KVLayout:
        """SGLang-style: per layer a K and a V tensor ``[num_slots, heads, head_dim]``; a block is one
        page of ``page_size`` consecutive slots (a trailing partial page is not addressable)."""
        ks = _check_list(k_buffers, "k_buffers", ndim=3)
        vs = _check_list(v_buffers, "v_buffers", ndim=3)
        if len(ks) != len(vs):
            raise InvalidValue(f"v_buffers: {len(vs)} layers, k_buffers has {len(ks)}")
        if ks[0].shape != vs[0].shape or ks[0].dtype != vs[0].dtype or ks[0].device != vs[0].device:
            raise InvalidValue("v_buffers: shape/dtype/device must match k_buffers")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise InvalidValue(f"page_size must be an int >= 1, got {page_size!r}")
        num_blocks = ks[0].shape[0] // page_size
        if num_blocks < 1:
            raise InvalidValue(f"page_size: {page_size} exceeds the {ks[0].shape[0]} slots of k_buffers")
        segs = []
        for i, (k, v) in enumerate(zip(ks, vs)):
            for name, t in (("k_buffers", k), ("v_buffers", v)):
                _check_inner_contiguous(t, 0, f"{name}[{i}]")
                segs.append((t, 0))
        return cls._build(
            "sglang", ks + vs, segs, num_kv=2, num_blocks=num_blocks, block_dim=0, block_span=page_size, page=True
        )

    @classmethod
    def from_mla(cls, caches: Sequence[torch.Tensor]) -> KVLayout:
        """MLA: one ``[num_blocks, block_size, dim]`` latent cache per layer (one segment per layer)."""
        tensors = _check_list(caches, "caches", ndim=3)
        for i, t in enumerate(tensors):
            _check_inner_contiguous(t, 1, f"caches[{i}]")
        segs = [(t, 0) for t in tensors]
        return cls._build("mla", tensors, segs, num_kv=1, num_blocks=tensors[0].shape[0], block_dim=0, block_span=1)

    @classmethod
    def _build(
        cls,
        kind: str,
        tensors: list[torch.Tensor],
        segs: list[tuple[torch.Tensor, int]],
        *,
        num_kv: int,
        num_blocks: int,
        block_dim: int,
        block_span: int,
        page: bool = False,
    ) -> KVLayout:
        t0 = segs[0][0]
        elt = t0.element_size()
        if num_blocks < 1:  # (before the chunk's size is read off block 0)
            raise InvalidValue(f"{kind} cache has no blocks")
        if page:  # a page = block_span rows of a contiguous [slots, heads, head_dim] tensor
            chunk = block_span * t0[0].numel() * elt
            block_stride = chunk
        else:
            chunk = t0[(0,) * (block_dim + 1)].numel() * elt
            block_stride = t0.stride(block_dim) * elt
        if block_stride < chunk:
            raise InvalidValue(f"{kind} cache: blocks overlap (block stride {block_stride} B < block size {chunk} B)")
        _check_no_aliasing(kind, segs, num_blocks, block_stride, chunk)
        views, ptrs, owners, offsets = [], [], [], []
        index = {id(t): i for i, t in enumerate(tensors)}
        for t, off in segs:
            views.append(_seg_view(t, off, num_blocks, block_stride, chunk))
            ptrs.append(t.data_ptr() + off)
            owners.append(index[id(t)])
            offsets.append(off)
        table = torch.tensor(ptrs, dtype=torch.int64)
        if t0.device.type != "cpu":
            table = table.to(t0.device)
        num_layers = len(segs) // num_kv
        return cls(
            kind=kind,
            num_layers=num_layers,
            num_kv=num_kv,
            num_blocks=num_blocks,
            block_stride=block_stride,
            chunk_bytes=chunk,
            dtype=t0.dtype,
            device=t0.device,
            seg_ptrs=tuple(ptrs),
            seg_owner=tuple(owners),
            seg_offset=tuple(offsets),
            align=_alignment(chunk, block_stride, *ptrs),
            seg_ptr_table=table,
            seg_views=tuple(views),
            tensors=tuple(tensors),
        )


def _check_no_aliasing(
    kind: str, segs: list[tuple[torch.Tensor, int]], num_blocks: int, block_stride: int, chunk: int
) -> None:
    """Segments whose blocks share bytes (one tensor passed twice, K and V made by ``expand``) would make a
    transfer write one block's bytes over another's: refused. Each segment's extent is
    ``[ptr, ptr + (num_blocks - 1) * block_stride + chunk)``; segments interleaved block by block (vLLM's
    ``[2, num_blocks, ...]`` K/V, a layer-first cache) do not share bytes even though their extents cross,
    so those are compared chunk by chunk within one period."""
    spans = sorted((t.data_ptr() + off, i) for i, (t, off) in enumerate(segs))
    extent = (num_blocks - 1) * block_stride + chunk
    for x, (a, i) in enumerate(spans):
        for b, j in spans[x + 1 :]:
            if b >= a + extent:
                break  # this one and every later one start past a's last block
            # Inside a's extent: they share bytes unless each block of one falls between two blocks of the other
            gap = (b - a) % block_stride
            if gap < chunk or block_stride - gap < chunk:
                raise InvalidValue(
                    f"{kind} cache: segments {min(i, j)} and {max(i, j)} share memory (the same tensor twice, or "
                    "views of one another): a transfer would write one over the other"
                )


def _index(value: object, name: str, n: int) -> int:
    """``value`` as an index in ``[0, n)`` (ints and numpy integers; not bools), or InvalidValue naming ``name``."""
    try:
        i = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        i = None
    if i is None or not 0 <= i < n:
        raise InvalidValue(f"{name}: expected an int in [0, {n}), got {value!r}")
    return i


def _alignment(*values: int) -> int:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return min(16, g & -g) if g else 16


def _check_list(tensors: Sequence[torch.Tensor], name: str, *, ndim: int) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise InvalidType(f"{name} must be a non-empty list of tensors (one per layer)")
    out = list(tensors)
    t0 = out[0]
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise InvalidType(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise InvalidValue(f"{name}[{i}] must have {ndim} dims, got shape {tuple(t.shape)}")
        if t.shape != t0.shape or t.stride() != t0.stride():
            raise InvalidValue(f"{name}[{i}]: shape/strides {tuple(t.shape)}/{t.stride()} differ from {name}[0]")
        if t.dtype != t0.dtype:
            raise InvalidType(f"{name}[{i}]: dtype {t.dtype} differs from {name}[0] ({t0.dtype})")
        if t.device != t0.device:
            raise InvalidValue(f"{name}[{i}]: device {t.device} differs from {name}[0] ({t0.device})")
        if t.dtype.is_complex or t.dtype == torch.bool:
            raise InvalidType(f"{name}[{i}]: unsupported dtype {t.dtype}")
    return out


def _check_inner_contiguous(t: torch.Tensor, first_dim: int, name: str) -> None:
    """Dims ``first_dim..`` must be packed row-major (one block of K or V is one contiguous chunk)."""
    expected = 1
    for d in range(t.dim() - 1, first_dim - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            raise InvalidValue(f"{name}: dims {first_dim}.. must be contiguous, got strides {t.stride()}")
        expected *= t.shape[d]


@dataclass(frozen=True)
class HostPool:
    """A pool of host blocks for one device layout's geometry, in ``block_first`` or ``layer_first`` order.

    ``tensor`` is any contiguous CPU tensor of ``num_blocks * num_segments * chunk_bytes`` bytes (pinned or
    registered for fast DMA; registered/pinned is required by ``method="zero_copy"``).
    """

    tensor: torch.Tensor
    layout: HostLayoutName
    num_segments: int
    chunk_bytes: int
    num_blocks: int = -1  # derived from the tensor's size when left at -1
    flat: torch.Tensor = field(init=False, repr=False, compare=False)  # uint8 alias of tensor

    def __post_init__(self) -> None:
        t = self.tensor
        if not isinstance(t, torch.Tensor):
            raise InvalidType(f"tensor must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise InvalidValue(f"tensor: a host pool lives in host memory, got device {t.device}")
        if not t.is_contiguous():
            raise InvalidValue("tensor must be contiguous")
        if self.layout not in HOST_LAYOUTS:
            raise InvalidValue(f"layout must be one of {HOST_LAYOUTS}, got {self.layout!r}")
        for name in ("num_segments", "chunk_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidValue(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.num_blocks, bool):
            raise InvalidValue(f"num_blocks must be an int >= 1 (or -1: the tensor's size), got {self.num_blocks!r}")
        nbytes = t.numel() * t.element_size()
        per_block = self.num_segments * self.chunk_bytes
        n = self.num_blocks if self.num_blocks != -1 else nbytes // per_block
        if not isinstance(n, int) or n < 1 or n * per_block != nbytes:
            raise InvalidValue(
                f"tensor: {nbytes} bytes is not num_blocks x {self.num_segments} segments x {self.chunk_bytes} B"
            )
        object.__setattr__(self, "num_blocks", n)
        object.__setattr__(self, "flat", t.reshape(-1).view(torch.uint8) if t.numel() else t)

    @property
    def block_stride(self) -> int:
        return self.num_segments * self.chunk_bytes if self.layout == "block_first" else self.chunk_bytes

    @property
    def seg_stride(self) -> int:
        return self.chunk_bytes if self.layout == "block_first" else self.num_blocks * self.chunk_bytes

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def seg_view(self, seg: int) -> torch.Tensor:
        """``[num_blocks, chunk_bytes]`` uint8 view of one segment."""
        seg = _index(seg, "seg", self.num_segments)
        return self.flat.as_strided(
            (self.num_blocks, self.chunk_bytes),
            (self.block_stride, 1),
            self.flat.storage_offset() + seg * self.seg_stride,
        )

    def block_view(self, block: int) -> torch.Tensor:
        """The bytes of one host block (all layers, K and V): one storable object. ``block_first`` only."""
        if self.layout != "block_first":
            raise InvalidValue("block_view: a block is contiguous only in the block_first layout")
        block = _index(block, "block", self.num_blocks)
        n = self.block_stride
        return self.flat[block * n : (block + 1) * n]

    def matches(self, layout: KVLayout) -> bool:
        return self.num_segments == layout.num_segments and self.chunk_bytes == layout.chunk_bytes

    @classmethod
    def for_layout(
        cls, device_layout: KVLayout, tensor: torch.Tensor, layout: HostLayoutName = "block_first"
    ) -> HostPool:
        """Wrap ``tensor`` as a pool of host blocks shaped for ``device_layout``."""
        return cls(tensor, layout, device_layout.num_segments, device_layout.chunk_bytes)

    @classmethod
    def allocate(
        cls,
        device_layout: KVLayout,
        num_blocks: int,
        layout: HostLayoutName = "block_first",
        *,
        pinned: bool | None = None,
    ) -> HostPool:
        """A new pool of ``num_blocks`` host blocks for ``device_layout``.

        Pinned (``kvstrata.memory.alloc_pinned``: NUMA-local, registered, device-addressable) when the
        layout is on a GPU or ``pinned=True``; plain host memory otherwise.
        """
        if not isinstance(device_layout, KVLayout):
            raise InvalidType(f"device_layout: expected a KVLayout, got {type(device_layout).__name__}")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise InvalidType(f"num_blocks: expected an int, got {type(num_blocks).__name__}")
        if num_blocks < 1:
            raise InvalidValue(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        nbytes = num_blocks * device_layout.block_bytes
        if pinned is None:
            pinned = device_layout.device.type == "cuda"
        if pinned:
            tensor = _alloc_pinned(nbytes, device_layout.device)
        else:
            try:
                tensor = torch.zeros(nbytes, dtype=torch.uint8)
            except RuntimeError as exc:  # torch's allocator refused: say what was asked for
                raise MemoryError(
                    f"num_blocks: {num_blocks} blocks of {device_layout.block_bytes} bytes ({nbytes} bytes) "
                    f"do not fit in host memory"
                ) from exc
        return cls(tensor, layout, device_layout.num_segments, device_layout.chunk_bytes, num_blocks)


def _alloc_pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    try:
        from kvstrata.memory import alloc_pinned
    except ImportError:  # kvstrata.memory without the pinned allocator: torch's pinned allocator is still mapped (UVA)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return alloc_pinned(nbytes, device=device if device.type == "cuda" else None)


__all__ = ["HOST_LAYOUTS", "HostLayoutName", "HostPool", "KVLayout"]
