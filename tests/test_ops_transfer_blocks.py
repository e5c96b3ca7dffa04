"""transfer_blocks on CPU (Triton kernels under TRITON_INTERPRET=1, torch and copy-engine fallbacks) and on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstrata
from kv_helpers import (
    DTYPES,
    clone_all,
    device_chunk,
    host_chunk,
    layout_of,
    make_cache,
    num_segments,
    same,
    tensors_of,
)
from kvstrata.ops import HostPool, transfer_blocks

CPU_METHODS = ["torch", "copy_engine", "zero_copy", "staging", "auto"]
GPU_METHODS = ["zero_copy", "staging", "copy_engine", "torch", "auto"]


def _pool(layout, n: int, host_layout: str, device_type: str) -> HostPool:
    pool = HostPool.allocate(layout, n, host_layout, pinned=device_type == "cuda")
    pool.flat.copy_(torch.randint(0, 256, (pool.flat.numel(),), dtype=torch.uint8))  # poison
    return pool


def roundtrip(kind, dtype, method, host_layout, *, device="cpu", layers=3, blocks=6, head_dim=8, page=3,
              dev_ids=(4, 1, 2), host_ids=(0, 3, 1), host_blocks=5, ids_as=list, **kw) -> None:  # fmt: skip
    """D2H then H2D into a second cache; checks copies, untouched blocks and unchanged sources."""
    cache = make_cache(kind, layers=layers, blocks=blocks, dtype=dtype, device=device, head_dim=head_dim, page=page)
    layout = layout_of(cache)
    pool = _pool(layout, host_blocks, host_layout, torch.device(device).type)
    nseg, chunk = num_segments(cache), layout.chunk_bytes
    before_host = pool.flat.clone()
    before_dev = clone_all(cache)

    transfer_blocks(layout, pool, ids_as(dev_ids), ids_as(host_ids), direction="d2h", method=method, **kw)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    for t, b in zip(tensors_of(cache), before_dev):
        assert same(t, b), "source changed"
    for d, h in zip(dev_ids, host_ids):
        for seg in range(nseg):
            got = host_chunk(pool.flat, host_layout, nseg, host_blocks, chunk, seg, h)
            assert same(got, device_chunk(cache, seg, d).cpu()), (seg, d, h)
    for h in set(range(host_blocks)) - set(host_ids):
        for seg in range(nseg):
            args = (host_layout, nseg, host_blocks, chunk, seg, h)
            assert same(host_chunk(pool.flat, *args), host_chunk(before_host, *args)), "untouched host block"

    # H2D into a fresh (poisoned) cache at other block ids
    target = make_cache(kind, layers=layers, blocks=blocks, dtype=dtype, device=device, head_dim=head_dim, page=page)
    target_before = clone_all(target)
    pool_before = pool.flat.clone()
    new_ids = tuple((blocks - 1 - d) for d in dev_ids)
    transfer_blocks(layout_of(target), pool, ids_as(new_ids), ids_as(host_ids), direction="h2d", method=method, **kw)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    assert same(pool.flat, pool_before), "host pool changed by h2d"
    for d_src, d_dst in zip(dev_ids, new_ids):
        for seg in range(nseg):
            assert same(device_chunk(target, seg, d_dst), device_chunk(cache, seg, d_src)), (seg, d_dst)
    old = _rebuild(target, target_before)
    for d in set(range(blocks)) - set(new_ids):
        for seg in range(nseg):
            assert same(device_chunk(target, seg, d), device_chunk(old, seg, d)), "untouched device block"
    if kind == "sglang":  # the trailing partial page is not addressable: never written
        for t, b in zip(tensors_of(target), target_before):
            assert same(t[-1], b[-1])


def _rebuild(cache: dict, tensors: list[torch.Tensor]) -> dict:
    out = dict(cache)
    if cache["kind"] == "sglang":
        n = len(cache["k"])
        out["k"], out["v"] = tensors[:n], tensors[n:]
    else:
        out["caches"] = tensors
    return out


# ----------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("method", CPU_METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_every_method(seeded, method, dtype):
    roundtrip("vllm", dtype, method, "block_first")


@pytest.mark.parametrize("method", ["torch", "copy_engine", "zero_copy", "staging"])
@pytest.mark.parametrize("host_layout", ["block_first", "layer_first"])
@pytest.mark.parametrize("kind", ["vllm", "sglang", "mla"])
def test_every_layout(seeded, kind, host_layout, method):
    roundtrip(kind, torch.bfloat16, method, host_layout)


@pytest.mark.parametrize("method", ["torch", "copy_engine", "zero_copy", "staging"])
def test_odd_sizes(seeded, method):
    # 7 layers, head_dim 80, one block; then int8 rows of 5 bytes (1-byte words, masked tiles)
    roundtrip("vllm", torch.bfloat16, method, "layer_first", layers=7, blocks=1, head_dim=80,
              dev_ids=(0,), host_ids=(2,), host_blocks=3)  # fmt: skip
    roundtrip("mla", torch.int8, method, "block_first", layers=7, blocks=3, head_dim=5, dev_ids=(2,), host_ids=(0,))
    roundtrip("sglang", torch.float16, method, "block_first", layers=2, page=1, dev_ids=(5, 0), host_ids=(4, 0))


ID_FORMS = [list, np.array, lambda x: torch.tensor(x, dtype=torch.int32), lambda x: torch.tensor(x, dtype=torch.int64)]


@pytest.mark.parametrize("ids_as", ID_FORMS, ids=["list", "np", "i32", "i64"])
@pytest.mark.parametrize("method", ["zero_copy", "staging", "copy_engine"])
def test_id_forms(seeded, ids_as, method):
    roundtrip("mla", torch.float32, method, "block_first", ids_as=ids_as)


@pytest.mark.parametrize("method", ["zero_copy", "staging"])
def test_kernel_tiling_many_chunks(seeded, monkeypatch, method):
    """Many small chunks per tile, a persistent grid of 2 CTAs, and a staging ring of 2 tiny slots (4 pieces)."""
    from kvstrata.ops import staging

    monkeypatch.setattr(staging, "SLOT_BYTES", 3 * 64 * 2)
    monkeypatch.setattr(staging, "NUM_SLOTS", 2)
    ids = {"dev_ids": (11, 3, 4, 5, 0, 7, 8, 9), "host_ids": (0, 1, 2, 3, 4, 5, 6, 7)}
    roundtrip("mla", torch.float16, method, "layer_first", layers=4, blocks=12, host_blocks=9, num_ctas=2, **ids)


def test_staging_splits_a_block_larger_than_a_slot(seeded, monkeypatch):
    from kvstrata.ops import staging

    monkeypatch.setattr(staging, "SLOT_BYTES", 1)  # one chunk per slot: pieces of one block, one segment
    roundtrip("vllm", torch.bfloat16, "staging", "block_first", layers=2)


def test_empty_id_lists_do_nothing():
    cache = make_cache("mla", layers=2, blocks=3, dtype=torch.float16)
    layout = layout_of(cache)
    pool = _pool(layout, 2, "block_first", "cpu")
    before = pool.flat.clone()
    transfer_blocks(layout, pool, [], [], direction="d2h")
    assert same(pool.flat, before)


# ------------------------------------------------------------------------------------------ bad input
def _setup():
    cache = make_cache("vllm", layers=2, blocks=4, dtype=torch.float16)
    layout = layout_of(cache)
    pool = _pool(layout, 3, "block_first", "cpu")
    return cache, layout, pool


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"device_block_ids": [0, 1], "host_block_ids": [0]}, ValueError, "host_block_ids"),
        ({"device_block_ids": [4], "host_block_ids": [0]}, ValueError, "device_block_ids"),
        ({"device_block_ids": [-1], "host_block_ids": [0]}, ValueError, "device_block_ids"),
        ({"device_block_ids": [0], "host_block_ids": [3]}, ValueError, "host_block_ids"),
        ({"device_block_ids": [0, 1], "host_block_ids": [2, 2]}, ValueError, "duplicate"),
        ({"device_block_ids": torch.tensor([0.0]), "host_block_ids": [0]}, TypeError, "device_block_ids"),
        ({"device_block_ids": [0], "host_block_ids": ["a"]}, TypeError, "host_block_ids"),
        ({"device_block_ids": torch.zeros(1, 1, dtype=torch.int64), "host_block_ids": [0]}, ValueError, "1-D"),
        ({"direction": "sideways"}, ValueError, "direction"),
        ({"method": "teleport"}, ValueError, "method"),
        ({"num_ctas": 0}, ValueError, "num_ctas"),
        ({"device_layout": "nope"}, TypeError, "device_layout"),
        ({"host_pool": torch.zeros(4)}, TypeError, "host_pool"),
    ],
)
def test_bad_input_raises_before_writing(kwargs, exc, word):
    _, layout, pool = _setup()
    before = pool.flat.clone()
    args = {"device_layout": layout, "host_pool": pool, "device_block_ids": [0], "host_block_ids": [0]}
    args.update(kwargs)
    with pytest.raises(exc, match=word):
        transfer_blocks(**args)
    assert same(pool.flat, before)


def test_duplicate_device_ids_on_load():
    _, layout, pool = _setup()
    with pytest.raises(ValueError, match="device_block_ids: duplicate"):
        transfer_blocks(layout, pool, [1, 1], [0, 1], direction="h2d")
    transfer_blocks(layout, pool, [0, 1], [2, 2], direction="h2d")  # duplicate sources are fine


def test_pool_of_another_geometry():
    _, layout, _ = _setup()
    other = layout_of(make_cache("vllm", layers=3, blocks=4, dtype=torch.float16))
    pool = HostPool.allocate(other, 2)
    with pytest.raises(ValueError, match="host_pool"):
        transfer_blocks(layout, pool, [0], [0])


def test_pool_overlapping_the_cache():
    cache, layout, _ = _setup()
    t = cache["caches"][0]
    alias = t.view(torch.uint8).reshape(-1)[: 3 * layout.block_bytes // 4 * 4]
    n = alias.numel() // layout.block_bytes
    pool = HostPool(alias[: n * layout.block_bytes], "block_first", layout.num_segments, layout.chunk_bytes)
    with pytest.raises(ValueError, match="overlaps"):
        transfer_blocks(layout, pool, [0], [0])


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
@pytest.mark.parametrize("host_layout", ["block_first", "layer_first"])
@pytest.mark.parametrize("kind", ["vllm", "sglang", "mla"])
def test_gpu_layouts_methods(seeded, kind, host_layout, method):
    roundtrip(kind, torch.bfloat16, method, host_layout, device="cuda", layers=5, blocks=40,
              dev_ids=(39, 3, 4, 5, 17, 0), host_ids=(0, 1, 2, 7, 3, 9), host_blocks=12)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("method", GPU_METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_dtypes_and_odd_sizes(seeded, dtype, method):
    roundtrip("vllm", dtype, method, "block_first", device="cuda", layers=7, blocks=3, head_dim=80,
              dev_ids=(2,), host_ids=(1,), host_blocks=2)  # fmt: skip
    roundtrip("mla", torch.int8, method, "layer_first", device="cuda", layers=7, blocks=3, head_dim=5,
              dev_ids=(2, 0), host_ids=(0, 1), host_blocks=2)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["zero_copy", "staging", "copy_engine"])
def test_gpu_large_scattered_on_side_stream(seeded, method):
    """~40 MiB of 16 KiB chunks, device ids on the GPU, run on a non-default stream."""
    perm = torch.randperm(600)[:500]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        roundtrip("vllm", torch.bfloat16, method, "block_first", device="cuda", layers=4, blocks=600, head_dim=1024,
                  dev_ids=tuple(perm.tolist()), host_ids=tuple(range(500)), host_blocks=520)  # fmt: skip


@pytest.mark.gpu
def test_gpu_zero_copy_needs_mapped_host_memory():
    cache = make_cache("mla", layers=2, blocks=4, dtype=torch.float16, device="cuda")
    layout = layout_of(cache)
    pool = HostPool.allocate(layout, 2, pinned=False)
    with pytest.raises(ValueError, match="host_pool"):
        transfer_blocks(layout, pool, [0], [0], method="zero_copy")
    transfer_blocks(layout, pool, [0], [0], method="staging")  # DMA works from pageable memory (slowly)


@pytest.mark.gpu
def test_gpu_compile():
    cache = make_cache("vllm", layers=3, blocks=8, dtype=torch.bfloat16, device="cuda")
    layout = layout_of(cache)
    pool = _pool(layout, 4, "block_first", "cuda")
    dev_ids = torch.tensor([5, 2], device="cuda")
    host_ids = torch.tensor([1, 3], device="cuda")

    @torch.compile(fullgraph=True)
    def store(d, h):
        geom = [layout.chunk_bytes, layout.block_stride, pool.block_stride, pool.seg_stride, 1, layout.align]
        torch.ops.kvstrata.transfer_blocks(*layout.op_args(), pool.tensor, d, h, geom, "d2h", "zero_copy", 0)

    store(dev_ids, host_ids)
    torch.cuda.synchronize()
    for d, h in zip([5, 2], [1, 3]):
        for seg in range(6):
            assert same(host_chunk(pool.flat, "block_first", 6, 4, layout.chunk_bytes, seg, h),
                               device_chunk(cache, seg, d).cpu())  # fmt: skip
    compiled = torch.compile(lambda d, h: transfer_blocks(layout, pool, d, h, direction="h2d", check=False))
    compiled(torch.tensor([0], device="cuda"), torch.tensor([1], device="cuda"))
    torch.cuda.synchronize()
    assert same(device_chunk(cache, 0, 0), device_chunk(cache, 0, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["zero_copy", "staging", "copy_engine"])
def test_gpu_graph_capture(seeded, method):
    cache = make_cache("vllm", layers=3, blocks=8, dtype=torch.bfloat16, device="cuda")
    layout = layout_of(cache)
    pool = _pool(layout, 4, "block_first", "cuda")
    on_gpu = method == "zero_copy"
    dev_ids = torch.tensor([5, 2], device="cuda")
    host_ids = torch.tensor([1, 3], device="cuda" if on_gpu else "cpu")
    if method == "copy_engine":
        dev_ids = dev_ids.cpu()
    transfer_blocks(layout, pool, dev_ids, host_ids, method=method, check=False)  # warm up (compile) first
    torch.cuda.synchronize()
    pool.flat.zero_()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        transfer_blocks(layout, pool, dev_ids, host_ids, method=method, check=False)
    torch.cuda.synchronize()
    assert not pool.flat.any(), "capture must not run the copy"
    graph.replay()
    torch.cuda.synchronize()
    for d, h in zip([5, 2], [1, 3]):
        for seg in range(6):
            assert same(host_chunk(pool.flat, "block_first", 6, 4, layout.chunk_bytes, seg, h),
                               device_chunk(cache, seg, d).cpu())  # fmt: skip


@pytest.mark.parametrize("method", ["zero_copy", "copy_engine", "torch"])
def test_op_addresses_the_tensors_it_is_given(seeded, method):
    """torch.compile's functionalization may hand the op clones of the cache: the op must write those."""
    cache = make_cache("vllm", layers=2, blocks=4, dtype=torch.float16)
    layout = layout_of(cache)
    pool = _pool(layout, 2, "block_first", "cpu")
    tensors, table, ptrs, owners, offsets = layout.op_args()
    clones = [t.clone() for t in tensors]
    before = clone_all(cache)
    geom = [layout.chunk_bytes, layout.block_stride, pool.block_stride, pool.seg_stride, 1, layout.align]
    ids = torch.tensor([3]), torch.tensor([1])
    torch.ops.kvstrata.transfer_blocks(clones, table, ptrs, owners, offsets, pool.tensor, *ids, geom, "h2d", method, 0)
    assert all(same(t, b) for t, b in zip(tensors, before)), "the originals were written"
    clone_cache = {"kind": "vllm", "caches": clones}
    for seg in range(4):
        assert same(
            device_chunk(clone_cache, seg, 3), host_chunk(pool.flat, "block_first", 4, 2, layout.chunk_bytes, seg, 1)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["staging", "copy_engine", "zero_copy", "auto"])
def test_gpu_store_and_load_at_once(seeded, method):
    """A store on one stream and a load on another, concurrently: both land exactly."""
    cache = make_cache("vllm", layers=4, blocks=64, dtype=torch.bfloat16, device="cuda", head_dim=512)
    layout = layout_of(cache)
    pool = _pool(layout, 64, "block_first", "cuda")
    before = clone_all(cache)
    pool_before = pool.flat.clone()
    on_gpu = method == "zero_copy"
    ids = (lambda x: torch.tensor(x, device="cuda")) if on_gpu else list
    store_dev, store_host = list(range(0, 32)), list(range(32, 64))
    load_dev, load_host = list(range(63, 31, -1)), list(range(0, 32))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        transfer_blocks(layout, pool, ids(store_dev), ids(store_host), direction="d2h", method=method, check=False)
    with torch.cuda.stream(s2):
        transfer_blocks(layout, pool, ids(load_dev), ids(load_host), direction="h2d", method=method, check=False)
    torch.cuda.synchronize()
    old = _rebuild(cache, before)
    for seg in range(8):
        for d, h in zip(store_dev, store_host):
            assert same(
                host_chunk(pool.flat, "block_first", 8, 64, layout.chunk_bytes, seg, h), device_chunk(old, seg, d).cpu()
            )
        for d, h in zip(load_dev, load_host):
            expect = host_chunk(pool_before, "block_first", 8, 64, layout.chunk_bytes, seg, h)
            assert same(device_chunk(cache, seg, d).cpu(), expect)


@pytest.mark.parametrize(
    ("direction", "method", "dev_ids", "host_ids", "exc", "word"),
    [
        ("sideways", "torch", [0], [1], ValueError, "direction"),  # ran as h2d, over the device cache
        ("d2h", "fastest", [0], [1], ValueError, "method"),
        ("d2h", "torch", [0.7], [1.2], TypeError, "device_block_ids"),  # floats were taken as ids
        ("d2h", "torch", [[0]], [[1]], ValueError, "1-D"),
        ("d2h", "torch", [0, 1], [1], ValueError, "host_block_ids: 1 ids"),
    ],
)
def test_the_registered_op_checks_its_arguments(direction, method, dev_ids, host_ids, exc, word):
    """``torch.ops.kvstrata.transfer_blocks`` itself (what torch.compile traces) checks kinds and shapes."""
    from kvstrata.ops import KVLayout
    from kvstrata.ops.transfer_blocks import _geom_list

    cache = torch.randn(2, 4, 2, 2, 4)
    layout = KVLayout.from_vllm([cache])
    pool = HostPool.allocate(layout, 2)
    before = cache.clone()
    with pytest.raises(exc, match=word):
        torch.ops.kvstrata.transfer_blocks(
            *layout.op_args(), pool.tensor, torch.tensor(dev_ids), torch.tensor(host_ids), _geom_list(layout, pool),
            direction, method, 0,
        )  # fmt: skip
    assert torch.equal(cache, before)


@pytest.mark.parametrize("method", ["zero_copy", "staging"])
def test_a_method_the_device_cannot_run_is_refused_even_unchecked(method, monkeypatch):
    """With ``check=False`` the call reached Triton (``0 active drivers``): the method is checked once per plan."""
    import importlib

    module = importlib.import_module("kvstrata.ops.transfer_blocks")

    monkeypatch.setattr(module, "interpreting", lambda: False)  # a CPU process without TRITON_INTERPRET
    cache = make_cache("vllm", layers=2, blocks=4, dtype=torch.float16, device="cpu", head_dim=8, page=3)
    layout = layout_of(cache)
    pool = _pool(layout, 4, "block_first", "cpu")
    with pytest.raises(kvstrata.InvalidValue, match="needs a CUDA device layout"):
        transfer_blocks(layout, pool, [0, 1], [2, 3], direction="d2h", method=method, check=False)
