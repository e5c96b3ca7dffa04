"""Launch plans of the staging method: the runs each piece DMAs, plan reuse, and on CUDA the direct launch
path (compiled kernel on raw stream handles, reused events) against exact copies."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

from kv_helpers import clone_all, device_chunk, host_chunk, layout_of, make_cache, num_segments, same
from kvstrata.ops import HostPool, transfer_blocks
from kvstrata.ops.staging import Geometry

sp = sys.modules["kvstrata.ops._staging_plan"]
staging = sys.modules["kvstrata.ops.staging"]


@pytest.fixture(autouse=True)
def _fresh():
    sp.clear_plans()
    yield
    sp.clear_plans()


def _geometry(block_first: bool, nseg: int, chunk: int, nblocks: int, *, gap: int = 0) -> Geometry:
    """A pool of ``nblocks``: block_first packed (``gap`` bytes after each chunk make segments non-adjacent),
    or layer_first."""
    if block_first:
        hss = chunk + gap
        return Geometry(tuple(range(nseg)), chunk, chunk, 1 << 20, nseg * hss, hss, True, 1)
    return Geometry(tuple(range(nseg)), chunk, chunk, 1 << 20, chunk, nblocks * chunk, False, 1)


def _reference_runs(g: Geometry, piece, host_ids: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """Every chunk of the piece in staging (= pool) order, then adjacent chunks merged one by one."""
    chunks = []
    order = (
        [(b, s) for b in range(piece.b0, piece.b1) for s in range(piece.s0, piece.s1)]
        if g.block_first
        else [(b, s) for s in range(piece.s0, piece.s1) for b in range(piece.b0, piece.b1)]
    )
    for i, (b, s) in enumerate(order):
        chunks.append((i * g.chunk, g.host_base + int(host_ids[b]) * g.host_block_stride + s * g.host_seg_stride))
    stage, host, sizes = [], [], []
    for st, h in chunks:
        if sizes and host[-1] + sizes[-1] == h and stage[-1] + sizes[-1] == st:
            sizes[-1] += g.chunk
        else:
            stage.append(st), host.append(h), sizes.append(g.chunk)
    return stage, host, sizes


@pytest.mark.parametrize(
    ("block_first", "gap", "nblocks", "slot_chunks"),
    [(True, 0, 9, 12), (True, 0, 150, 4 * 100), (True, 0, 5, 2), (True, 8, 9, 12), (False, 0, 9, 12),
     (False, 0, 7, 1)],
)  # fmt: skip
@pytest.mark.parametrize("ids", ["consecutive", "shuffled", "reversed"])
def test_runs_match_chunk_by_chunk(block_first, gap, nblocks, slot_chunks, ids):
    """Blocks whole or split across pieces, few (Python merge) or many (numpy merge) per piece."""
    nseg, chunk = 4, 64
    g = _geometry(block_first, nseg, chunk, 2 * nblocks, gap=gap)
    host_ids = {"consecutive": np.arange(3, 3 + nblocks), "reversed": np.arange(nblocks)[::-1].copy(),
                "shuffled": np.random.default_rng(0).permutation(2 * nblocks)[:nblocks]}[ids]  # fmt: skip
    plan = sp.StagingPlan(g, nblocks, slot_chunks * chunk, 2, True, 4)
    covered = 0
    for piece in plan.pieces:
        got = plan.runs(piece, host_ids, g.host_base)
        assert tuple(got) == _reference_runs(g, piece, host_ids)
        assert sum(got[2]) == piece.nb * piece.ns * chunk <= plan.biggest
        covered += piece.nb * piece.ns
    assert covered == nblocks * nseg
    assert {p.slot for p in plan.pieces} == set(range(plan.nslots))


def test_plan_cached_per_signature():
    g = _geometry(True, 4, 64, 8)
    a = sp.get_plan(g, 5, 1024, 3, True, 4, device_index=0, id_dtype=torch.int64)
    assert sp.get_plan(g, 5, 1024, 3, True, 4, device_index=0, id_dtype=torch.int64) is a
    assert sp.get_plan(g, 5, 1024, 3, True, 4, device_index=0, id_dtype=torch.int32) is not a  # other kernel
    assert sp.get_plan(g, 5, 1024, 3, True, 4, device_index=1, id_dtype=torch.int64) is not a  # other device
    assert sp.get_plan(g, 5, 1024, 3, False, 4, device_index=0, id_dtype=torch.int64) is not a
    assert sp.plan_count() == 4
    moved = Geometry(g.seg_ptrs, g.chunk, g.dev_block_stride, g.host_base + 4096, g.host_block_stride,
                     g.host_seg_stride, g.block_first, g.align)  # fmt: skip
    assert sp.get_plan(moved, 5, 1024, 3, True, 4, device_index=0, id_dtype=torch.int64) is a  # runs take the base


def test_transfer_blocks_reuses_the_staging_plan(seeded):
    cache = make_cache("vllm", layers=2, blocks=6, dtype=torch.float16)
    layout = layout_of(cache)
    pool = HostPool.allocate(layout, 4, pinned=False)
    for dev, host in (([4, 1], [0, 3]), ([2, 5], [1, 2])):
        transfer_blocks(layout, pool, dev, host, direction="d2h", method="staging")
        for d, h in zip(dev, host):
            for seg in range(4):
                assert same(host_chunk(pool.flat, "block_first", 4, 4, layout.chunk_bytes, seg, h),
                            device_chunk(cache, seg, d))  # fmt: skip
    assert sp.plan_count() == 1


# ------------------------------------------------------------------------------------------------ GPU
class _NoJit:
    """Stands in for the Triton kernel: any launch through Triton's JIT fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("staging launched through Triton's JIT although a direct launch was planned")


def _fill_pool(layout, n: int, host_layout: str) -> HostPool:
    pool = HostPool.allocate(layout, n, host_layout, pinned=True)
    pool.flat.copy_(torch.randint(0, 256, (pool.flat.numel(),), dtype=torch.uint8))
    return pool


@pytest.mark.gpu
@pytest.mark.parametrize("ids_as", ["list", "cuda_int32", "cuda_int64"])
@pytest.mark.parametrize("host_layout", ["block_first", "layer_first"])
def test_gpu_direct_launch_exact(seeded, monkeypatch, host_layout, ids_as):
    """Once every piece was launched through Triton, later calls of the signature launch directly (the JIT is
    replaced by a trap) and still copy exactly: poisoned destinations, sources unchanged, others untouched.
    Small slots: 7 blocks in 4 pieces through 2 slots (slots reused, events reused across calls)."""
    cache = make_cache("vllm", layers=3, blocks=40, dtype=torch.bfloat16, device="cuda", head_dim=40)
    layout = layout_of(cache)
    nseg, chunk, host_blocks = num_segments(cache), layout.chunk_bytes, 16
    monkeypatch.setattr(staging, "SLOT_BYTES", 2 * nseg * chunk)
    monkeypatch.setattr(staging, "NUM_SLOTS", 2)
    pool = _fill_pool(layout, host_blocks, host_layout)

    def ids(values):
        if ids_as == "list":
            return list(values)
        return torch.tensor(values, dtype=torch.int32 if ids_as == "cuda_int32" else torch.int64, device="cuda")

    host_ids = [0, 1, 2, 3, 9, 8, 15]  # a run of four, then scattered: several DMA runs per piece
    transfer_blocks(layout, pool, ids([1, 2, 3, 4, 5, 6, 7]), host_ids, direction="d2h", method="staging")
    transfer_blocks(layout, pool, ids([8, 9, 10, 11, 12, 13, 14]), host_ids, direction="h2d", method="staging")
    torch.cuda.synchronize()
    assert sp.plan_count() == 2 and all(p.runners for plan in sp._plans.values() for p in plan.pieces)
    monkeypatch.setattr(sp, "_copy_chunks_kernel", _NoJit())

    # store: 7 scattered device blocks into the poisoned pool
    store_dev = [39, 3, 17, 0, 22, 5, 30]
    pool.flat.copy_(torch.randint(0, 256, (pool.flat.numel(),), dtype=torch.uint8))
    host_before, dev_before = pool.flat.clone(), clone_all(cache)
    transfer_blocks(layout, pool, ids(store_dev), host_ids, direction="d2h", method="staging")
    torch.cuda.synchronize()
    assert all(same(t, b) for t, b in zip(clone_all(cache), dev_before)), "source changed"
    for seg in range(nseg):
        for d, h in zip(store_dev, host_ids):
            assert same(host_chunk(pool.flat, host_layout, nseg, host_blocks, chunk, seg, h),
                        device_chunk(cache, seg, d).cpu()), (seg, d, h)  # fmt: skip
        for h in set(range(host_blocks)) - set(host_ids):
            args = (host_layout, nseg, host_blocks, chunk, seg, h)
            assert same(host_chunk(pool.flat, *args), host_chunk(host_before, *args)), "untouched host block"

    # load: the same host blocks into 7 other (poisoned) device blocks
    load_dev = [38, 1, 16, 2, 21, 4, 31]
    pool_before = pool.flat.clone()
    old = {(seg, d): device_chunk(cache, seg, d).clone() for seg in range(nseg) for d in range(40)}
    transfer_blocks(layout, pool, ids(load_dev), host_ids, direction="h2d", method="staging")
    torch.cuda.synchronize()
    assert same(pool.flat, pool_before), "host pool changed by h2d"
    for seg in range(nseg):
        for d, h in zip(load_dev, host_ids):
            assert same(device_chunk(cache, seg, d).cpu(),
                        host_chunk(pool.flat, host_layout, nseg, host_blocks, chunk, seg, h)), (seg, d)  # fmt: skip
        for d in set(range(40)) - set(load_dev):
            assert same(device_chunk(cache, seg, d), old[(seg, d)]), "untouched device block"


@pytest.mark.gpu
def test_gpu_two_threads_same_direction(seeded):
    """Two threads storing at once (one side, one set of reused events, one lock), each on its own stream,
    six rounds; then two threads loading. Every block lands exactly."""
    cache = make_cache("mla", layers=8, blocks=64, dtype=torch.float16, device="cuda", head_dim=512)
    layout = layout_of(cache)
    nseg, chunk = num_segments(cache), layout.chunk_bytes
    pool = _fill_pool(layout, 64, "block_first")
    halves = (list(range(0, 32)), list(range(32, 64)))
    errors: list[BaseException] = []

    def run(direction: str, dev: list[int], host: list[int]) -> None:
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(6):
                    transfer_blocks(layout, pool, dev, host, direction=direction, method="staging", check=False)
            s.synchronize()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    rev = [list(reversed(h)) for h in halves]
    _both([threading.Thread(target=run, args=("d2h", halves[i], rev[i])) for i in range(2)])
    assert not errors, errors
    for seg in range(nseg):
        for d, h in zip(halves[0] + halves[1], rev[0] + rev[1]):
            got = host_chunk(pool.flat, "block_first", nseg, 64, chunk, seg, h)
            assert same(got, device_chunk(cache, seg, d).cpu())
    target = make_cache("mla", layers=8, blocks=64, dtype=torch.float16, device="cuda", head_dim=512)
    tlayout = layout_of(target)

    def load(i: int) -> None:
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(6):
                    transfer_blocks(tlayout, pool, rev[i], halves[i], direction="h2d", method="staging", check=False)
            s.synchronize()
        except BaseException as exc:
            errors.append(exc)

    _both([threading.Thread(target=load, args=(i,)) for i in range(2)])
    assert not errors, errors
    for seg in range(nseg):
        for d in range(64):  # each block went to a host block and came back to the same device block
            assert same(device_chunk(target, seg, d), device_chunk(cache, seg, d))


def _both(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ------------------------------------------------------------------------------------------- stepping
_END = object()


def _step_in_turn(*gens) -> list[int]:
    """Step the generators alternately until all are done; how many steps each took."""
    counts, left = [0] * len(gens), set(range(len(gens)))
    while left:
        for i in sorted(left):
            if next(gens[i], _END) is _END:
                left.discard(i)
            else:
                counts[i] += 1
    return counts


def _stored_ok(cache, pool, host_layout, nseg, host_blocks, dev, host) -> bool:
    chunk = pool.chunk_bytes
    return all(
        same(host_chunk(pool.flat, host_layout, nseg, host_blocks, chunk, seg, h), device_chunk(cache, seg, d).cpu())
        for d, h in zip(dev, host)
        for seg in range(nseg)
    )


@pytest.mark.parametrize("host_layout", ["block_first", "layer_first"])
def test_store_and_load_stepped_in_turn(seeded, monkeypatch, host_layout):
    """A staging store and load stepped alternately (one piece each per step) land exactly; a staging call
    takes one step per piece, an in-place one a single step; bad arguments fail at the first step."""
    from kvstrata.ops.transfer_blocks import interleave, transfer_blocks_steps

    cache = make_cache("vllm", layers=2, blocks=12, dtype=torch.float16)
    layout = layout_of(cache)
    nseg, chunk = num_segments(cache), layout.chunk_bytes
    monkeypatch.setattr(staging, "SLOT_BYTES", 2 * nseg * chunk)  # 2 blocks per piece
    monkeypatch.setattr(staging, "NUM_SLOTS", 2)
    pool = HostPool.allocate(layout, 10, host_layout, pinned=False)
    pool.flat.copy_(torch.randint(0, 256, (pool.flat.numel(),), dtype=torch.uint8))
    before = pool.flat.clone()
    store_dev, store_host = [11, 0, 5, 7, 2], [0, 1, 2, 3, 4]
    load_dev, load_host = [1, 3, 4, 6, 8], [9, 8, 7, 6, 5]  # disjoint from the store's blocks on both sides
    expect = {(seg, h): host_chunk(before, host_layout, nseg, 10, chunk, seg, h).clone()
              for seg in range(nseg) for h in load_host}  # fmt: skip
    store = transfer_blocks_steps(layout, pool, store_dev, store_host, direction="d2h", method="staging")
    load = transfer_blocks_steps(layout, pool, load_dev, load_host, direction="h2d", method="staging")
    assert _step_in_turn(store, load) == [3, 3]  # 5 blocks, 2 per piece: 3 pieces each
    assert _stored_ok(cache, pool, host_layout, nseg, 10, store_dev, store_host)
    for seg in range(nseg):
        for d, h in zip(load_dev, load_host):
            assert same(device_chunk(cache, seg, d), expect[(seg, h)])
    assert len(list(transfer_blocks_steps(layout, pool, [0], [0], direction="d2h", method="torch"))) == 0
    bad = transfer_blocks_steps(layout, pool, [12], [0], direction="d2h", method="staging")
    with pytest.raises(ValueError, match="device_block_ids"):
        next(bad)
    interleave()  # nothing to step


@pytest.mark.gpu
@pytest.mark.parametrize("methods", [("staging", "staging"), ("auto", "auto"), ("zero_copy", "staging")])
@pytest.mark.parametrize("host_layout", ["block_first", "layer_first"])
def test_gpu_calibration_store_and_load_exact(seeded, monkeypatch, host_layout, methods):
    """calibration.store_and_load (the two calls stepped in turn on two streams) on one cache and pool:
    the store's blocks land in the pool, the load's in the cache, exactly, with slots reused (5 pieces)."""
    from kvstrata.ops import calibration

    cache = make_cache("vllm", layers=4, blocks=64, dtype=torch.bfloat16, device="cuda", head_dim=256)
    layout = layout_of(cache)
    nseg, chunk = num_segments(cache), layout.chunk_bytes
    monkeypatch.setattr(staging, "SLOT_BYTES", 4 * nseg * chunk)
    monkeypatch.setattr(staging, "NUM_SLOTS", 2)
    pool = _fill_pool(layout, 48, host_layout)
    pool_before = pool.flat.clone()
    old = {(seg, d): device_chunk(cache, seg, d).clone() for seg in range(nseg) for d in range(64)}
    store_dev, store_host = list(range(0, 20)), list(range(47, 27, -1))
    load_dev, load_host = list(range(63, 43, -1)), list(range(0, 20))
    on_gpu = methods[0] == "zero_copy"  # zero_copy reads device-resident ids without a sync
    sd = torch.tensor(store_dev, device="cuda") if on_gpu else store_dev
    sh = torch.tensor(store_host, device="cuda") if on_gpu else store_host
    calibration.store_and_load((layout, pool, sd, sh), (layout, pool, load_dev, load_host), *methods)
    torch.cuda.synchronize()
    assert _stored_ok(cache, pool, host_layout, nseg, 48, store_dev, store_host)
    for seg in range(nseg):
        for d, h in zip(load_dev, load_host):
            expect = host_chunk(pool_before, host_layout, nseg, 48, chunk, seg, h)
            assert same(device_chunk(cache, seg, d).cpu(), expect), (seg, d, h)
        for d in set(range(64)) - set(load_dev):
            assert same(device_chunk(cache, seg, d), old[(seg, d)]), "untouched device block"
        for h in set(range(48)) - set(store_host):
            args = (host_layout, nseg, 48, chunk, seg, h)
            assert same(host_chunk(pool.flat, *args), host_chunk(pool_before, *args)), "untouched host block"


def test_a_stepped_call_closed_early_still_copies_everything(seeded, monkeypatch):
    """close() after the first piece (an abandoned generator, or interleave after a failure): the remaining
    pieces are enqueued at once, never left half done."""
    from kvstrata.ops.transfer_blocks import interleave, transfer_blocks_steps

    cache = make_cache("mla", layers=3, blocks=9, dtype=torch.float16)
    layout = layout_of(cache)
    nseg, chunk = num_segments(cache), layout.chunk_bytes
    monkeypatch.setattr(staging, "SLOT_BYTES", nseg * chunk)  # one block per piece
    pool = HostPool.allocate(layout, 9, pinned=False)
    dev, host = [8, 6, 4, 2, 0], [0, 1, 2, 3, 4]
    gen = transfer_blocks_steps(layout, pool, dev, host, direction="d2h", method="staging")
    next(gen)
    gen.close()
    assert _stored_ok(cache, pool, "block_first", nseg, 9, dev, host)

    def failing():
        yield
        raise RuntimeError("the other call failed")

    pool.flat.zero_()
    store = transfer_blocks_steps(layout, pool, dev, host, direction="d2h", method="staging")
    with pytest.raises(RuntimeError, match="other call"):
        interleave(failing(), store)
    assert _stored_ok(cache, pool, "block_first", nseg, 9, dev, host)
