"""Launch plans of the eager ``transfer_blocks`` path: reuse, invalidation, checks that stay per call,
and ``auto`` beside a transfer in the other direction."""

from __future__ import annotations

import sys

import pytest
import torch

from kv_helpers import device_chunk, host_chunk, layout_of, make_cache, same
from kvstrata.ops import HostPool, transfer_blocks
from kvstrata.ops.calibration import Calibration

plans = sys.modules["kvstrata.ops._transfer_plan"]
tb = sys.modules["kvstrata.ops.transfer_blocks"]


@pytest.fixture(autouse=True)
def _fresh():
    plans.clear_plans()
    yield
    plans.clear_plans()


def _setup(device="cpu", blocks=6, host_blocks=4):
    cache = make_cache("vllm", layers=2, blocks=blocks, dtype=torch.float16, device=device)
    layout = layout_of(cache)
    pool = HostPool.allocate(layout, host_blocks, pinned=device == "cuda")
    pool.flat.copy_(torch.randint(0, 256, (pool.flat.numel(),), dtype=torch.uint8))
    return cache, layout, pool


def _stored(cache, pool, dev_ids, host_ids, host_blocks=4) -> bool:
    nseg, chunk = 4, pool.chunk_bytes
    return all(
        same(host_chunk(pool.flat, "block_first", nseg, host_blocks, chunk, seg, h), device_chunk(cache, seg, d).cpu())
        for d, h in zip(dev_ids, host_ids)
        for seg in range(nseg)
    )


@pytest.mark.parametrize("method", ["zero_copy", "copy_engine", "torch"])
def test_plan_reused_across_calls_with_new_ids(seeded, method):
    cache, layout, pool = _setup()
    transfer_blocks(layout, pool, [4, 1], [0, 3], method=method)
    assert plans.plan_count() == 1 and _stored(cache, pool, [4, 1], [0, 3])
    plan = next(iter(plans._plans.values()))
    transfer_blocks(layout, pool, [2, 5], [1, 2], method=method)  # same signature, other ids
    assert plans.plan_count() == 1 and next(iter(plans._plans.values())) is plan
    assert _stored(cache, pool, [2, 5], [1, 2])
    transfer_blocks(layout, pool, [0], [0], method=method)  # another block count: another plan
    assert plans.plan_count() == 2 and _stored(cache, pool, [0], [0])


def test_reallocated_cache_at_new_address_gets_a_new_plan(seeded):
    cache, layout, pool = _setup()
    transfer_blocks(layout, pool, [4], [0], method="zero_copy")
    old_ptrs = layout.seg_ptrs
    cache2 = make_cache("vllm", layers=2, blocks=6, dtype=torch.float16)  # allocated while the old one lives
    layout2 = layout_of(cache2)
    assert layout2.seg_ptrs != old_ptrs
    del cache, layout
    transfer_blocks(layout2, pool, [4], [0], method="zero_copy")
    assert plans.plan_count() == 2
    assert _stored(cache2, pool, [4], [0]), "a plan of the freed cache was reused"


def test_reallocated_pool_at_new_address_gets_a_new_plan(seeded):
    cache, layout, pool = _setup()
    transfer_blocks(layout, pool, [3], [1], direction="d2h", method="zero_copy")
    pool2 = HostPool.allocate(layout, 4)
    pool2.flat.fill_(0x77)
    del pool
    transfer_blocks(layout, pool2, [3], [1], direction="d2h", method="zero_copy")
    assert plans.plan_count() == 2 and _stored(cache, pool2, [3], [1])


def test_registry_change_rebuilds_the_plan(seeded, monkeypatch):
    _, layout, pool = _setup()
    transfer_blocks(layout, pool, [3], [1], method="zero_copy")
    first = next(iter(plans._plans.values()))
    monkeypatch.setattr(tb, "registry_generation", lambda: first.generation + 1)
    transfer_blocks(layout, pool, [3], [1], method="zero_copy")
    assert next(iter(plans._plans.values())) is not first


@pytest.mark.parametrize(
    ("dev_ids", "host_ids", "word"),
    [([6], [0], "device_block_ids"), ([0], [4], "host_block_ids"), ([0, 1], [2, 2], "duplicate"),
     ([-1], [0], "device_block_ids"), ([0, 1], [0], "host_block_ids"), ([0.5], [0], "device_block_ids")],
)  # fmt: skip
def test_bad_ids_rejected_with_a_cached_plan(seeded, dev_ids, host_ids, word):
    _, layout, pool = _setup()
    transfer_blocks(layout, pool, [0, 1], [0, 1], method="zero_copy")
    transfer_blocks(layout, pool, [0], [0], method="zero_copy")
    before = pool.flat.clone()
    with pytest.raises((ValueError, TypeError), match=word):
        transfer_blocks(layout, pool, dev_ids, host_ids, method="zero_copy")
    assert same(pool.flat, before)


def test_bad_signature_not_cached_when_it_fails(seeded):
    _, layout, pool = _setup()
    other = HostPool(
        torch.zeros(4 * 4 * 2 * pool.chunk_bytes, dtype=torch.uint8), "block_first", 4, 2 * pool.chunk_bytes
    )
    with pytest.raises(ValueError, match="host_pool"):
        transfer_blocks(layout, other, [0], [0], method="zero_copy")
    assert plans.plan_count() == 0


def _pair_calibration(best_pair: str, rate: float = 95.0) -> Calibration:
    solo = {m: {"bulk": [[2048, 50.0], [2097152, 50.0]], "small": []} for m in ("copy_engine", "staging", "zero_copy")}
    both = {}
    for d2h in ("copy_engine", "staging", "zero_copy"):
        for h2d in ("copy_engine", "staging", "zero_copy"):
            r = rate if f"{d2h}+{h2d}" == best_pair else 80.0
            both[f"{d2h}+{h2d}"] = {"bulk": [[2048, r], [2097152, r]], "small": []}
    return Calibration({"name": "fake"}, {"d2h": solo, "h2d": dict(solo), "both": both})


def test_best_pair_from_two_direction_points():
    cal = _pair_calibration("staging+copy_engine")
    assert cal.best_pair(32768) == ("staging", "copy_engine")
    assert cal.best_pair(32768, methods=("copy_engine", "zero_copy")) == ("copy_engine", "copy_engine")
    # a pair with zero_copy must beat every SM-frugal pair by far: 95 vs 80 is not enough, 120 is
    assert _pair_calibration("zero_copy+staging").best_pair(32768) == ("copy_engine", "copy_engine")
    assert _pair_calibration("zero_copy+staging", 120.0).best_pair(32768) == ("zero_copy", "staging")
    assert Calibration({"name": "old"}, {"d2h": {}, "h2d": {}}).best_pair(32768) is None


def test_choose_method_concurrent_uses_the_pair(monkeypatch):
    from kvstrata.ops import calibration

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(calibration, "_available", lambda: calibration.PREFERENCE)
    monkeypatch.setattr(calibration, "_choices", {})
    monkeypatch.setitem(calibration._memo, 0, _pair_calibration("staging+copy_engine"))
    bulk = 64 * 4096  # 8 GiB of 32 KiB chunks: the bulk regime
    assert calibration.choose_method("d2h", 32768, bulk, device=0, concurrent=True) == "staging"
    assert calibration.choose_method("h2d", 32768, bulk, device=0, concurrent=True) == "copy_engine"
    # alone all methods are equal: the store takes its side of the best pair, so a later load pairs well
    assert calibration.choose_method("d2h", 32768, bulk, device=0) == "staging"
    small = calibration.choose_method("d2h", 32768, 64, device=0)  # one request: the pair does not apply
    assert calibration.choose_method("d2h", 32768, 64, device=0, concurrent=True) == small


def test_concurrent_argument_checked():
    _, layout, pool = _setup()
    with pytest.raises(TypeError, match="concurrent"):
        transfer_blocks(layout, pool, [0], [0], concurrent="yes")


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("ids_on", ["list", "cuda", "cpu_tensor"])
def test_gpu_zero_copy_many_calls_reuse_lane_slots(seeded, ids_on):
    """More calls than lane slots, each with other ids, no sync in between: every copy lands right."""
    cache, layout, pool = _setup("cuda", blocks=80, host_blocks=80)
    perm = torch.randperm(80).tolist()
    conv = {"list": list, "cuda": lambda x: torch.tensor(x, device="cuda"), "cpu_tensor": torch.tensor}[ids_on]
    for i in range(plans.LANE_SLOTS + 16):
        transfer_blocks(layout, pool, conv([perm[i % 80]]), conv([i % 80]), method="zero_copy", check=False)
    torch.cuda.synchronize()
    last = {i % 80: perm[i % 80] for i in range(plans.LANE_SLOTS + 16)}
    assert _stored(cache, pool, list(last.values()), list(last.keys()), host_blocks=80)
    assert plans.plan_count() == 1


@pytest.mark.gpu
def test_gpu_freed_pinned_pool_replaced_at_new_address(seeded):
    cache, layout, pool = _setup("cuda")
    transfer_blocks(layout, pool, [3], [1], method="zero_copy")
    pool2 = HostPool.allocate(layout, 4)
    del pool
    transfer_blocks(layout, pool2, [3], [1], method="zero_copy")
    torch.cuda.synchronize()
    assert _stored(cache, pool2, [3], [1])


@pytest.mark.gpu
def test_gpu_auto_sees_the_other_direction_in_flight(seeded):
    _, layout, pool = _setup("cuda", blocks=64, host_blocks=64)
    side = torch.cuda.Stream()
    # Warm first: the first call compiles the kernel and builds the plan, longer than the sleep below.
    transfer_blocks(layout, pool, list(range(32)), list(range(32)), direction="d2h", method="zero_copy")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)  # keep the store's stream busy (~0.25 s)
        transfer_blocks(layout, pool, list(range(32)), list(range(32)), direction="d2h", method="zero_copy")
    assert plans.other_direction_busy(layout.device, "h2d")
    assert plans.other_direction_method(layout.device, "h2d") == "zero_copy"  # what auto the other way pairs with
    torch.cuda.synchronize()
    assert not plans.other_direction_busy(layout.device, "h2d")
