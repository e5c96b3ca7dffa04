"""KVLayout / HostPool: geometry of each engine's cache, host addressing, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_helpers import device_chunk, make_cache, same
from kvstrata.ops import HostPool, KVLayout


def test_vllm_geometry_and_pointers():
    caches = [torch.zeros(2, 5, 16, 8, 128, dtype=torch.bfloat16) for _ in range(3)]
    lay = KVLayout.from_vllm(caches)
    assert (lay.num_layers, lay.num_kv, lay.num_segments, lay.num_blocks) == (3, 2, 6, 5)
    assert lay.chunk_bytes == 16 * 8 * 128 * 2 == lay.block_stride
    assert lay.seg_ptrs[2] == caches[1].data_ptr()
    assert lay.seg_ptrs[3] == caches[1][1].data_ptr()
    assert lay.seg_ptr_table.tolist() == list(lay.seg_ptrs)
    assert lay.block_bytes == 6 * lay.chunk_bytes


def test_vllm_blocks_major_cache_passed_transposed(seeded):
    """A [num_blocks, 2, ...] cache passed as t.transpose(0, 1): K/V stride is one block's chunk."""
    raw = [torch.randn(4, 2, 3, 2, 8) for _ in range(2)]
    lay = KVLayout.from_vllm([t.transpose(0, 1) for t in raw])
    assert lay.block_stride == 2 * 3 * 2 * 8 * 4
    assert same(lay.seg_views[1][2], raw[0][2, 1].reshape(-1).view(torch.uint8))
    assert same(lay.seg_views[2][3], raw[1][3, 0].reshape(-1).view(torch.uint8))


def test_sglang_pages_and_partial_page(seeded):
    cache = make_cache("sglang", layers=2, blocks=4, dtype=torch.float16, page=3)
    lay = KVLayout.from_sglang(cache["k"], cache["v"], page_size=3)
    assert lay.num_blocks == 4  # 13 slots, page 3: the 13th slot is a partial page
    assert lay.chunk_bytes == 3 * 2 * 8 * 2
    assert same(lay.seg_views[3][2], device_chunk(cache, 3, 2))


def test_mla(seeded):
    cache = make_cache("mla", layers=3, blocks=4, dtype=torch.int8, head_dim=5)
    lay = KVLayout.from_mla(cache["caches"])
    assert (lay.num_kv, lay.num_segments, lay.chunk_bytes) == (1, 3, 2 * 15)
    assert same(lay.seg_views[2][1], device_chunk(cache, 2, 1))


@pytest.mark.parametrize("host_layout", ["block_first", "layer_first"])
def test_host_addressing(host_layout):
    lay = KVLayout.from_mla([torch.zeros(4, 2, 8, dtype=torch.float16) for _ in range(3)])
    pool = HostPool.allocate(lay, 5, host_layout)
    assert pool.num_blocks == 5 and pool.flat.numel() == 5 * 3 * 32 and not pool.tensor.is_pinned()
    pool.seg_view(2)[4].fill_(7)
    i = 4 * 3 + 2 if host_layout == "block_first" else 2 * 5 + 4
    assert (pool.flat[i * 32 : (i + 1) * 32] == 7).all() and int(pool.flat.sum()) == 7 * 32
    if host_layout == "block_first":
        assert (pool.block_view(4)[2 * 32 : 3 * 32] == 7).all() and pool.block_view(4).numel() == 96
    else:
        with pytest.raises(ValueError, match="block_first"):
            pool.block_view(0)


def test_host_pool_from_a_typed_tensor():
    lay = KVLayout.from_mla([torch.zeros(4, 2, 8, dtype=torch.float16) for _ in range(3)])
    pool = HostPool.for_layout(lay, torch.zeros(2, 3, 16, dtype=torch.float16), "layer_first")
    assert pool.num_blocks == 2 and pool.matches(lay)


def _cpu_layout() -> KVLayout:
    return KVLayout.from_vllm([torch.zeros(2, 4, 4, 2, 8)])


@pytest.mark.parametrize(
    ("build", "exc", "word"),
    [
        (lambda: KVLayout.from_vllm([]), TypeError, "kv_caches"),
        (lambda: KVLayout.from_vllm(torch.zeros(2, 2, 2, 2, 2)), TypeError, "kv_caches"),
        (lambda: KVLayout.from_vllm([torch.zeros(3, 2, 2, 2, 2)]), ValueError, "dim 0"),
        (lambda: KVLayout.from_vllm([torch.zeros(2, 2, 2, 2)]), ValueError, r"kv_caches\[0\]"),
        (lambda: KVLayout.from_vllm([torch.zeros(2, 2, 2, 2, 2), torch.zeros(2, 3, 2, 2, 2)]), ValueError, r"\[1\]"),
        (
            lambda: KVLayout.from_vllm([torch.zeros(2, 2, 2, 2, 2), torch.zeros(2, 2, 2, 2, 2, dtype=torch.half)]),
            TypeError,
            "dtype",
        ),
        (lambda: KVLayout.from_vllm([torch.zeros(2, 2, 2, 2, 4)[..., ::2]]), ValueError, "contiguous"),
        (lambda: KVLayout.from_vllm([torch.zeros(2, 2, 2, 2, 2, dtype=torch.bool)]), TypeError, "dtype"),
        (lambda: KVLayout.from_sglang([torch.zeros(6, 2, 2)], [], 3), TypeError, "v_buffers"),
        (lambda: KVLayout.from_sglang([torch.zeros(6, 2, 2)], [torch.zeros(6, 2, 2)] * 2, 3), ValueError, "v_buffers"),
        (lambda: KVLayout.from_sglang([torch.zeros(6, 2, 2)], [torch.zeros(6, 2, 2)], 0), ValueError, "page_size"),
        (lambda: KVLayout.from_sglang([torch.zeros(2, 2, 2)], [torch.zeros(2, 2, 2)], 3), ValueError, "page_size"),
        (lambda: KVLayout.from_mla([torch.zeros(4, 2)]), ValueError, "3 dims"),
        (lambda: KVLayout.from_mla([torch.zeros(4, 2, 3)[:, :, :2]]), ValueError, "contiguous"),
        (lambda: HostPool(torch.zeros(10, dtype=torch.uint8), "block_first", 3, 4), ValueError, "num_blocks"),
        (lambda: HostPool(torch.zeros(12, dtype=torch.uint8), "page_first", 3, 4), ValueError, "layout"),
        (lambda: HostPool(torch.zeros(12, dtype=torch.uint8), "block_first", 0, 4), ValueError, "num_segments"),
        (lambda: HostPool(torch.zeros(24, dtype=torch.uint8)[::2], "block_first", 3, 4), ValueError, "contiguous"),
        (lambda: HostPool([0] * 12, "block_first", 3, 4), TypeError, "tensor"),
        (lambda: HostPool.allocate(None, 3), TypeError, "device_layout: expected a KVLayout"),
        (lambda: HostPool.allocate(_cpu_layout(), True), TypeError, "num_blocks: expected an int"),
        (lambda: HostPool.allocate(_cpu_layout(), 0), ValueError, "num_blocks"),
        (lambda: HostPool.allocate(_cpu_layout(), 1 << 50), MemoryError, "do not fit in host memory"),
        # caches whose segments share bytes: a transfer would write one over the other (silently lost data)
        (lambda: KVLayout.from_vllm([_ALIAS, _ALIAS]), ValueError, "share memory"),
        (lambda: KVLayout.from_vllm([_ALIAS[:1].expand(2, 4, 2, 2, 4)]), ValueError, "share memory|overlap"),
        (lambda: KVLayout.from_vllm([torch.zeros(2, 0, 2, 2, 4)]), ValueError, "no blocks"),  # was an IndexError
        (lambda: KVLayout.from_mla([torch.zeros(0, 2, 4)]), ValueError, "no blocks"),
        (lambda: HostPool(torch.zeros(12, dtype=torch.uint8), "block_first", True, 12), ValueError, "num_segments"),
        (lambda: HostPool(torch.zeros(12, dtype=torch.uint8), "block_first", 3, True), ValueError, "chunk_bytes"),
        (lambda: _cpu_pool().seg_view(-1), ValueError, "seg: expected an int"),
        (lambda: _cpu_pool().seg_view(99), ValueError, "seg: expected an int"),
        (lambda: _cpu_pool().block_view(1.0), ValueError, "block: expected an int"),
    ],
)
def test_bad_layouts(build, exc, word):
    with pytest.raises(exc, match=word):
        build()


_ALIAS = torch.zeros(2, 4, 2, 2, 4)


def _cpu_pool() -> HostPool:
    return HostPool.allocate(_cpu_layout(), 2)


def test_interleaved_segments_of_one_tensor_are_not_aliasing():
    """A blocks-major cache gives K and V segments whose extents cross, block by block, without sharing a byte."""
    cache = torch.zeros(4, 2, 2, 2, 8)  # [num_blocks, K/V, block_size, heads, head_dim]
    layout = KVLayout.from_vllm([cache.transpose(0, 1)])
    assert layout.num_segments == 2 and layout.num_blocks == 4


def test_numpy_ids_must_be_one_dimensional_as_tensor_ids_are():
    from kvstrata.ops import transfer_blocks

    layout = _cpu_layout()
    pool = HostPool.allocate(layout, 2)
    with pytest.raises(ValueError, match="must be 1-D"):  # was flattened silently
        transfer_blocks(layout, pool, np.array([[0, 1]]), np.array([0, 1]))
    transfer_blocks(layout, pool, np.array([0], dtype=">i8"), [1])  # big-endian ids: read, not refused


@pytest.mark.gpu
def test_gpu_layout_table_and_pinned_pool():
    caches = [torch.zeros(2, 4, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    lay = KVLayout.from_vllm(caches)
    assert lay.seg_ptr_table.device.type == "cuda" and lay.seg_ptr_table.tolist() == list(lay.seg_ptrs)
    pool = HostPool.allocate(lay, 3)
    assert pool.tensor.is_pinned() and pool.layout == "block_first"
    with pytest.raises(ValueError, match="host memory"):
        HostPool.for_layout(lay, torch.zeros(3 * lay.block_bytes, dtype=torch.uint8, device="cuda"))
