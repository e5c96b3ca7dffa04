"""method="auto": calibration cache (write, reuse, invalidate) with a fake measurement, and the choice rule."""

from __future__ import annotations

import json

import pytest
import torch

import kvstrata
from kvstrata.ops import calibration
from kvstrata.ops.calibration import Calibration, calibrate, choose_method, static_rule

KEY_A = {"name": "FakeGPU", "driver": "1.0", "torch": "x", "triton": "y"}


def _fake_points(fast: str = "staging"):
    pts = {}
    for d in ("d2h", "h2d"):
        pts[d] = {}
        for m in ("copy_engine", "staging", "zero_copy"):
            rate = {"copy_engine": 10.0, "staging": 50.0, "zero_copy": 51.0}[m]
            if m == fast:
                rate = 60.0
            pts[d][m] = {"bulk": [[2048, rate], [2097152, 55.0 if m == "copy_engine" else rate]], "small": []}
    return pts


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cache_written_reused_and_invalidated(cache_dir):
    calls = []

    def measure(device):
        calls.append(device)
        return _fake_points()

    cal = calibrate(measure=measure, key=KEY_A)
    assert len(calls) == 1 and calibration.cache_path(KEY_A).exists()
    assert str(calibration.cache_path(KEY_A)).startswith(str(cache_dir))
    assert json.loads(calibration.cache_path(KEY_A).read_text())["key"] == KEY_A
    again = calibrate(measure=measure, key=KEY_A)
    assert len(calls) == 1 and again.points == cal.points  # reused from disk
    calibrate(measure=measure, key={**KEY_A, "driver": "2.0"})  # new driver: measured again
    assert len(calls) == 2
    calibrate(measure=measure, key=KEY_A, force=True)
    assert len(calls) == 3


def test_corrupt_or_foreign_cache_is_remeasured(cache_dir):
    path = calibration.cache_path(KEY_A)
    path.write_text("{not json")
    calls = []
    calibrate(measure=lambda d: calls.append(1) or _fake_points(), key=KEY_A)
    assert calls == [1]
    path.write_text(json.dumps({"key": {**KEY_A, "name": "Other"}, "points": _fake_points()}))
    calibrate(measure=lambda d: calls.append(1) or _fake_points(), key=KEY_A)
    assert calls == [1, 1]


def test_best_prefers_fewer_sms_within_tolerance():
    cal = Calibration(KEY_A, _fake_points())
    # staging 60 beats zero_copy 51: staging
    assert cal.best("d2h", 32768, 10**6) == "staging"
    near = Calibration(KEY_A, _fake_points(fast="zero_copy"))
    near.points["d2h"]["staging"]["bulk"] = [[2048, 58.0], [2097152, 58.0]]  # 58 vs 60: within 5%
    assert near.best("d2h", 32768, 10**6) == "staging"
    near.points["d2h"]["copy_engine"]["bulk"] = [[2048, 59.0], [2097152, 59.0]]
    assert near.best("d2h", 32768, 10**6) == "copy_engine"
    assert near.best("d2h", 32768, 10**6, methods={"zero_copy"}) == "zero_copy"


def test_interpolation_in_log_chunk_size():
    cal = Calibration(KEY_A, _fake_points())
    ce = cal.gbps("d2h", "copy_engine", 65536, 10**6)  # halfway in log2 between 2 KiB (10) and 2 MiB (55)
    assert ce == pytest.approx(32.5)
    assert cal.gbps("d2h", "copy_engine", 1024, 10**6) == 10.0 and cal.gbps("d2h", "copy_engine", 1 << 30, 10) == 55.0
    assert cal.gbps("d2h", "copy_engine", 2048, 4) is None  # no "small" points measured
    assert cal.best("h2d", 2048, 4) is None


def test_static_rule():
    assert static_rule("h2d", 32768, 64) == "zero_copy"  # one request: 2 MiB
    assert static_rule("h2d", 32768, 65536) == "staging"
    assert static_rule("d2h", 2 << 20, 1024) == "copy_engine"


def test_choose_method_off_cuda_is_torch():
    assert choose_method("d2h", 32768, 100, device="cpu") == "torch"
    if not torch.cuda.is_available():
        assert choose_method("h2d", 32768, 100) == "torch"
    with pytest.raises(ValueError, match="direction"):
        choose_method("up", 1, 1)


@pytest.mark.gpu
def test_gpu_calibrate_real_device(cache_dir):
    import time

    t0 = time.perf_counter()
    cal = calibrate(force=True)
    took = time.perf_counter() - t0
    assert took < 40, f"calibration took {took:.1f} s"  # it runs on a user's first auto call
    for d in ("d2h", "h2d"):
        for m in calibration._available():
            for regime in ("bulk", "small"):
                assert len(cal.points[d][m][regime]) == len(calibration.CHUNK_SIZES)
                assert all(r > 0 for _, r in cal.points[d][m][regime])
    assert cal.points["both"] and cal.key["format"] == calibration.FORMAT
    assert choose_method("d2h", 32768, 65536) in calibration.PREFERENCE
    assert calibration.cache_path(calibration.device_key()).exists()


@pytest.mark.gpu
def test_gpu_bulk_auto_is_sm_frugal(cache_dir):
    """Bulk auto never picks zero_copy unless the measured rates say it wins by far."""
    from kvstrata.ops.auto_policy import BULK_SM_FREE_SHARE

    cal = calibrate()
    for d in ("d2h", "h2d"):
        for chunk in calibration.CHUNK_SIZES:
            n = (256 << 20) // chunk
            if choose_method(d, chunk, n) == "zero_copy":
                rates = cal.rates(d, chunk, n)
                assert max(r for m, r in rates.items() if m != "zero_copy") < BULK_SM_FREE_SHARE * rates["zero_copy"]


@pytest.mark.gpu
def test_gpu_store_and_load_auto_pair(cache_dir):
    """A bulk store, then a bulk load issued while it runs: both auto, the pair the policy names, data exact."""
    from kvstrata.bench.transfer import Setup
    from kvstrata.ops import _transfer_plan, transfer_blocks

    calibrate()
    chunk = 32768
    a, b = Setup(32, chunk, 256 << 20, seed=1), Setup(32, chunk, 256 << 20, seed=2)
    exp_a, exp_b = a.expected(), b.expected()
    a.pool.flat.fill_(0xA5)
    b.pool.flat.copy_(exp_b.cpu())
    for v in b.layout.seg_views:
        v[b.dev_ids_gpu] = 0x5A
    torch.cuda.synchronize()
    cur = torch.cuda.current_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(cur)
    s2.wait_stream(cur)
    with torch.cuda.stream(s1):
        transfer_blocks(a.layout, a.pool, a.dev_ids, a.host_ids, direction="d2h")
    with torch.cuda.stream(s2):
        transfer_blocks(b.layout, b.pool, b.dev_ids, b.host_ids, direction="h2d")
    dev = torch.device("cuda", torch.cuda.current_device())
    store_m, load_m = _transfer_plan.lane(dev, "d2h").method, _transfer_plan.lane(dev, "h2d").method
    torch.cuda.synchronize()
    assert torch.equal(a.pool.flat.to(exp_a.device), exp_a)
    assert torch.equal(b.expected(), exp_b)
    n = a.n * a.nseg
    expect_store = choose_method("d2h", chunk, n)
    assert store_m == expect_store
    assert load_m == choose_method("h2d", chunk, n, concurrent=True, other=expect_store)


def test_measure_setup_views_move_the_right_bytes():
    """The calibration's caches and pools are views of shared buffers: each view pair moves its own blocks."""
    from kvstrata.ops.transfer_blocks import transfer_blocks

    dev, host = torch.randint(0, 255, (3000,), dtype=torch.uint8), torch.zeros(1024, dtype=torch.uint8)
    layout, pool, dev_ids, host_ids = calibration._setup(dev, host, 16, 5, 6)
    assert pool.flat.numel() == 5 * 6 * 16 and layout.num_segments == 6 and dev_ids.numel() == 5
    transfer_blocks(layout, pool, dev_ids, host_ids, direction="d2h", method="torch")
    for b, d in enumerate(dev_ids.tolist()):
        for s, view in enumerate(layout.seg_views):
            assert torch.equal(pool.flat[(b * 6 + s) * 16 : (b * 6 + s + 1) * 16], view[d])
    assert int(host[5 * 6 * 16 :].count_nonzero()) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_calibrate_without_a_gpu_says_so():
    """It failed with torch's ``Torch not compiled with CUDA enabled`` AssertionError."""
    with pytest.raises(kvstrata.InvalidValue, match="needs a CUDA device"):
        calibrate()
