"""method="auto": the SM-frugal policy on injected calibration points (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.ops import _transfer_plan, calibration
from kvstrata.ops.auto_policy import BULK_SM_FREE_SHARE, TOLERANCE, pick, pick_pair
from kvstrata.ops.calibration import Calibration

KEY = {"name": "FakeGPU"}
BULK = 1 << 20  # chunks per call: far above SMALL_BYTES at any chunk size
CHUNKS = (2048, 8192, 32768, 2097152)


def _points(alone: dict, pairs: dict | None = None, small: dict | None = None) -> dict:
    """``alone``: {(direction, method): GB/s at every chunk}; ``pairs``: {"d2h+h2d": GB/s}."""
    pts: dict = {d: {m: {"bulk": [], "small": []} for m in calibration.PREFERENCE} for d in ("d2h", "h2d")}
    for (d, m), rate in alone.items():
        pts[d][m]["bulk"] = [[c, rate] for c in CHUNKS]
    for (d, m), rate in (small or {}).items():
        pts[d][m]["small"] = [[c, rate] for c in CHUNKS]
    pts["both"] = {name: {"bulk": [[c, r] for c in CHUNKS], "small": []} for name, r in (pairs or {}).items()}
    return pts


# What the H200 measured at 2 KiB chunks (bench/results/transfer_h200x2.json), as a realistic shape.
H200_2K = {("d2h", "zero_copy"): 52.4, ("d2h", "staging"): 53.1, ("d2h", "copy_engine"): 2.1,
           ("h2d", "zero_copy"): 51.1, ("h2d", "staging"): 51.9, ("h2d", "copy_engine"): 1.2}  # fmt: skip
H200_PAIRS = {"staging+staging": 81.0, "zero_copy+zero_copy": 75.0, "zero_copy+staging": 61.0,
              "staging+zero_copy": 68.7}  # fmt: skip


def test_pick_prefers_fewer_sms_within_tolerance():
    assert pick({"copy_engine": 51.5, "staging": 52.0, "zero_copy": 52.5}, bulk=True) == "copy_engine"
    # H200, d2h 128 KiB chunks: copy_engine at 0.95 of staging's rate ran at 0.86 of the ceiling
    assert pick({"copy_engine": 50.37, "staging": 52.88, "zero_copy": 52.22}, bulk=True) == "staging"
    assert pick({"copy_engine": 40.0, "staging": 52.0, "zero_copy": 52.5}, bulk=True) == "staging"
    assert pick({"copy_engine": 40.0, "staging": 52.0}, bulk=False) == "staging"
    assert pick({"staging": None, "zero_copy": 3.0}, bulk=True) == "zero_copy"
    assert pick({}, bulk=True) is None


def test_bulk_drops_zero_copy_unless_it_wins_by_far():
    # FORMAT 2's 2 KiB d2h calibration (zero_copy 50.8, staging 46.2): zero_copy was auto's choice.
    assert pick({"copy_engine": 1.3, "staging": 46.2, "zero_copy": 50.8}, bulk=True) == "staging"
    just_in = BULK_SM_FREE_SHARE * 50.0
    assert pick({"staging": just_in, "zero_copy": 50.0}, bulk=True) == "staging"
    assert pick({"staging": just_in - 0.5, "zero_copy": 50.0}, bulk=True) == "zero_copy"
    # one request's blocks: the SMs are held for microseconds, latency decides
    assert pick({"copy_engine": 10.0, "staging": 16.0, "zero_copy": 40.0}, bulk=False) == "zero_copy"
    assert pick({"copy_engine": 48.5, "staging": 42.6, "zero_copy": 49.1}, bulk=False) == "copy_engine"
    assert pick({"copy_engine": 47.3, "staging": 42.6, "zero_copy": 49.1}, bulk=False) == "zero_copy"


def test_pick_pair():
    assert pick_pair({tuple(k.split("+")): v for k, v in H200_PAIRS.items()}) == ("staging", "staging")
    # zero_copy pairs only when every SM-frugal pair is far behind
    assert pick_pair({("zero_copy", "zero_copy"): 90.0, ("staging", "staging"): 60.0}) == ("zero_copy", "zero_copy")
    assert pick_pair({("copy_engine", "copy_engine"): 80.0, ("staging", "staging"): 81.0}) == (
        "copy_engine",
        "copy_engine",
    )
    assert pick_pair({}) is None


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_h200_misses_are_fixed_by_the_policy(direction):
    cal = Calibration(KEY, _points(H200_2K, H200_PAIRS))
    for chunk in (2048, 8192):
        assert cal.choose(direction, chunk, BULK) == "staging"
        assert cal.choose(direction, chunk, BULK, concurrent=True) == "staging"
        assert cal.choose(direction, chunk, BULK, other="staging") == "staging"
        assert cal.choose(direction, chunk, BULK, other="zero_copy") == "staging"  # 68.7 vs 61/75


def test_store_choice_does_not_depend_on_starting_first():
    # Alone, d2h would pick copy_engine (within 5% of staging); the best pair is staging+staging, and
    # staging alone costs nothing beyond the tolerance: the store takes staging before the load exists.
    alone = {("d2h", "copy_engine"): 52.0, ("d2h", "staging"): 53.0, ("h2d", "copy_engine"): 52.0,
             ("h2d", "staging"): 53.0}  # fmt: skip
    pairs = {"staging+staging": 80.0, "copy_engine+copy_engine": 60.0, "copy_engine+staging": 62.0,
             "staging+copy_engine": 61.0}  # fmt: skip
    cal = Calibration(KEY, _points(alone, pairs))
    assert cal.best("d2h", 32768, BULK) == "copy_engine"
    store = cal.choose("d2h", 32768, BULK)
    load = cal.choose("h2d", 32768, BULK, other=store)
    assert (store, load) == ("staging", "staging") == cal.best_pair(32768)
    # ... but not when pairing well would cost the transfer alone more than the tolerance
    slow = Calibration(KEY, _points({**alone, ("d2h", "staging"): 52.0 * TOLERANCE - 1}, pairs))
    assert slow.choose("d2h", 32768, BULK) == "copy_engine"
    assert slow.choose("d2h", 32768, BULK, concurrent=True) == "staging"


def test_choose_restricted_methods_and_small_calls():
    cal = Calibration(KEY, _points(H200_2K, H200_PAIRS, small={("d2h", "zero_copy"): 20.0, ("d2h", "staging"): 2.0}))
    assert cal.choose("d2h", 2048, BULK, ("zero_copy",)) == "zero_copy"
    assert cal.choose("d2h", 2048, 64) == "zero_copy"  # one request: latency
    assert cal.choose("h2d", 2048, 64) is None  # nothing measured: the caller's static rule


@pytest.fixture
def fake_cuda(monkeypatch):
    """choose_method as on a GPU whose calibration is injected."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(calibration, "_index", lambda device: 0)
    monkeypatch.setattr(calibration, "_available", lambda: calibration.PREFERENCE)
    monkeypatch.setattr(calibration, "_memo", {0: Calibration(KEY, _points(H200_2K, H200_PAIRS))})
    monkeypatch.setattr(calibration, "_choices", {})


def test_choose_method_uses_policy_and_memoizes(fake_cuda):
    assert calibration.choose_method("d2h", 2048, BULK) == "staging"
    assert calibration.choose_method("d2h", 2048, BULK, methods={"zero_copy"}) == "zero_copy"
    assert calibration.choose_method("h2d", 2048, BULK, concurrent=True, other="zero_copy") == "staging"
    assert len(calibration._choices) == 3
    calibration._memo[0] = Calibration(KEY, _points({("d2h", "zero_copy"): 50.0}))
    assert calibration.choose_method("d2h", 2048, BULK) == "staging"  # memoized answer
    calibration._choices.clear()
    assert calibration.choose_method("d2h", 2048, BULK) == "zero_copy"
    calibration._memo[0] = None  # no calibration: the static rule, never zero_copy for bulk
    calibration._choices.clear()
    assert calibration.choose_method("d2h", 2048, BULK) == "staging"
    assert calibration.choose_method("d2h", 2 << 20, BULK) == "copy_engine"


def test_transfer_blocks_auto_passes_device_ids_and_the_other_direction(monkeypatch):
    """_build_plan restricts auto to zero_copy for device-resident host ids and passes the pairing hints."""
    import importlib

    from kvstrata.ops import HostPool, KVLayout

    tb = importlib.import_module("kvstrata.ops.transfer_blocks")

    seen = []

    def fake(direction, chunk, n_chunks, *, device=None, methods=None, concurrent=False, other=None):
        seen.append((direction, chunk, n_chunks, methods, concurrent, other))
        return "torch"

    monkeypatch.setattr(calibration, "choose_method", fake)
    layout = KVLayout.from_mla([torch.zeros(4, 1, 64, dtype=torch.uint8) for _ in range(3)])
    pool = HostPool.allocate(layout, 4)
    tb._build_plan(layout, pool, 2, "d2h", "auto", None, True, False)
    tb._build_plan(layout, pool, 2, "h2d", "auto", None, True, True, "staging", True)
    assert seen == [("d2h", 64, 6, None, False, None), ("h2d", 64, 6, ("zero_copy",), True, "staging")]


def test_other_direction_method_off_cuda():
    assert _transfer_plan.other_direction_method(torch.device("cpu"), "d2h") is None
    assert _transfer_plan.other_direction_busy(torch.device("cpu"), "h2d") is False


def test_pairs_are_never_extrapolated_far_below_their_measured_chunks():
    # this session's H200 calibration: copy_engine pairs measured from 128 KiB only
    both = {
        "staging+staging": {"bulk": [[2048, 87.06], [32768, 87.65], [131072, 88.8], [2097152, 88.24]], "small": []},
        "copy_engine+staging": {"bulk": [[131072, 88.51], [524288, 93.81], [2097152, 95.98]], "small": []},
    }
    cal = Calibration(KEY, {"both": both})
    assert set(cal.pair_rates(32 << 10)) == {("staging", "staging")}
    assert cal.best_pair(32 << 10) == ("staging", "staging")  # the bench measured copy_engine+staging at 58
    assert ("copy_engine", "staging") in cal.pair_rates(64 << 10)  # within a factor of 2 of 128 KiB
    assert cal.best_pair(2 << 20) == ("copy_engine", "staging")
