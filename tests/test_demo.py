"""``kvstrata demo``: a full store, bad arguments, its counts and Ctrl-C (the audit's findings, one test each)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import kvstrata
from kvstrata.cli import demo
from kvstrata.cli.main import main

SMALL = ["--layers", "2"]  # 64 KiB blocks: quick


def _numbers(out: str) -> dict[str, int]:
    """The summary's counts, by name."""
    got = {
        "blocks": int(re.search(r"prompt blocks\s+(\d+)", out).group(1)),
        "reused": int(re.search(r"reused from kvstrata\s+(\d+)", out).group(1)),
        "computed": int(re.search(r"computed\s+(\d+)", out).group(1)),
        "offloaded": int(re.search(r"(\d+) offloaded", out).group(1)),
    }
    lookups = re.search(r"lookups\s+(\d+) hits .*?, (\d+) misses", out)
    got["lookup_hits"], got["lookup_misses"] = map(int, lookups.groups())
    full = re.search(r"(\d+) not offloaded: store full", out)
    got["store_full"] = int(full.group(1)) if full else 0
    already = re.search(r"(\d+) not offloaded: already stored", out)
    got["already_stored"] = int(already.group(1)) if already else 0
    return got


def _adds_up(n: dict[str, int]) -> None:
    assert n["blocks"] == n["reused"] + n["computed"]
    assert n["computed"] == n["offloaded"] + n["store_full"] + n["already_stored"]


# ----------------------------------------------------------------------------------------- 1: a full store
def test_ssd_tier_is_sized_for_the_planned_sessions(capsys):
    """200 sessions outgrew memory + 8x memory of SSD and ended in CapacityError."""
    assert main(["demo", "--sessions", "200", "--memory", "2MiB", *SMALL]) == 0
    out = capsys.readouterr().out
    n = _numbers(out)
    _adds_up(n)
    assert n["store_full"] == 0 and n["offloaded"] == demo.planned_blocks(200)
    assert "every reused block matched bit for bit" in out


def test_a_full_store_leaves_blocks_out_instead_of_crashing(monkeypatch, capsys):
    """Memory and SSD both full: the blocks with no room are counted as not offloaded, the run goes on."""
    monkeypatch.setattr(demo, "ssd_bytes", lambda sessions, block_bytes: 2 << 20)
    assert main(["demo", "--sessions", "40", "--memory", "2MiB", *SMALL]) == 0
    out = capsys.readouterr().out
    n = _numbers(out)
    _adds_up(n)
    assert n["store_full"] > 0
    assert "every reused block matched bit for bit" in out


def test_memory_minimum_covers_the_largest_request(capsys):
    block = demo.Model(2, 8, 64, 16, "cpu").block_bytes
    need = demo.min_memory(block)
    assert need > demo.LARGEST_REQUEST * block  # the request's blocks and the write reservation beside them
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--memory", str(need - 1), *SMALL])
    assert f"the largest request's {demo.LARGEST_REQUEST} KV blocks" in str(exit_.value.code)
    # At the minimum every second turn's prefix loads: none fails for want of room in the host tier.
    assert main(["demo", "--sessions", "60", "--memory", str(need), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "cached but not loaded" not in out
    _adds_up(_numbers(out))


# ----------------------------------------------------------------------------------------- 2: no leaked folder
@pytest.mark.parametrize(
    "args", [["--memory", "lots"], ["--memory", "1KiB"], ["--device", "bogus"], ["--device", "meta"]]
)
def test_bad_arguments_leave_no_ssd_folder(args, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["demo", *args])
    assert list(tmp_path.iterdir()) == []


def test_the_ssd_folder_goes_after_a_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--sessions", "4", "--memory", "2MiB", *SMALL]) == 0
    assert str(tmp_path) in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------- 3: lookup misses
def test_lookup_misses_are_counted(capsys):
    """The store's own miss count stays 0 (exists() is not counted): the summary printed '0 misses'."""
    assert main(["demo", "--sessions", "6", "--memory", "2MiB", *SMALL]) == 0
    n = _numbers(capsys.readouterr().out)
    assert n["lookup_misses"] > 0
    assert n["lookup_hits"] + n["lookup_misses"] == n["blocks"]
    assert n["lookup_misses"] == n["computed"] and n["lookup_hits"] == n["reused"]


# ----------------------------------------------------------------------------------------- 4: totals add up
class _FailingLoads:
    """A client whose mget_h2d fails the first key of every call (as if evicted between lookup and load)."""

    def __init__(self, kv):
        self.kv = kv

    def __getattr__(self, name):
        return getattr(self.kv, name)

    def mget_h2d(self, keys, dst, **options):
        results = self.kv.mget_h2d(keys, dst, **options)
        return [kvstrata.errors.KeyNotFound(keys[0]), *results[1:]]


def _model():
    return demo.Model(1, 8, 64, 4, "cpu")


def test_a_block_that_fails_to_load_is_computed_and_counted():
    model = _model()
    tally = demo.Tally()
    with kvstrata.connect(embedded=True, memory_bytes=8 << 20) as kv:
        demo.serve(_FailingLoads(kv), model, 6, random.Random(0), tally)
    assert tally.load_failed > 0
    assert tally.blocks == tally.hit_blocks + tally.computed
    assert tally.computed == tally.offloaded + tally.store_full + tally.already_stored
    # the failed block is still in the store: its offload finds it there (write-once)
    assert tally.already_stored == tally.load_failed
    assert tally.lookup_hits == tally.hit_blocks + tally.load_failed
    assert tally.mismatches == 0


def test_a_block_cached_after_a_missing_one_is_computed_not_offloaded_again():
    from kvstrata.integrations import PrefixKVCache

    model = _model()
    tokens = list(range(4 * model.block_tokens))
    tally = demo.Tally()
    with kvstrata.connect(embedded=True, memory_bytes=8 << 20) as kv:
        cache = PrefixKVCache(kv, model.kv_caches, model="demo-model")
        keys = cache.block_keys(tokens)
        assert kv.mset_d2h([keys[1]], [[model.compute_block(keys[1])]]) == [None]
        demo.request(cache, model, tokens, tally)
        assert all(kv.exists(keys))
    assert (tally.lookup_hits, tally.lookup_misses) == (0, 4)
    assert (tally.computed, tally.offloaded, tally.already_stored) == (4, 3, 1)


def test_reused_blocks_land_where_the_engine_placed_them():
    """A second turn's prefix loads into other cache blocks than the first turn computed it in, bit for bit."""
    from kvstrata.integrations import PrefixKVCache

    model = _model()
    tokens = list(range(6 * model.block_tokens))
    with kvstrata.connect(embedded=True, memory_bytes=8 << 20) as kv:
        cache = PrefixKVCache(kv, model.kv_caches, model="demo-model")
        first, second = demo.Tally(), demo.Tally()
        demo.request(cache, model, tokens[: 4 * model.block_tokens], first)
        for c in model.kv_caches:
            c.zero_()
        demo.request(cache, model, tokens, second)
    assert (first.offloaded, second.hit_blocks, second.offloaded, second.mismatches) == (4, 4, 2, 0)
    keys = cache.block_keys(tokens)
    filled = [b for b in range(model.num_blocks) if any(c[:, b].any() for c in model.kv_caches)]
    assert len(filled) == 6
    assert sorted(model.mismatches(b, model.compute_block(k)) == 0 for b in filled for k in keys).count(True) == 6


# ----------------------------------------------------------------------------------------- 5: Ctrl-C, devices
def _interrupt_at(monkeypatch, calls: int) -> None:
    real = demo.Model.compute_block
    count = [0]

    def compute_block(self, key):
        count[0] += 1
        if count[0] == calls:
            raise KeyboardInterrupt
        return real(self, key)

    monkeypatch.setattr(demo.Model, "compute_block", compute_block)


def test_ctrl_c_prints_a_partial_summary_and_exits_130(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _interrupt_at(monkeypatch, 200)
    assert main(["demo", "--sessions", "40", "--memory", "2MiB", *SMALL]) == 130
    captured = capsys.readouterr()
    assert re.search(r"interrupted after \d+ of 80 requests", captured.out)
    _adds_up(_numbers(captured.out))
    assert "Traceback" not in captured.out + captured.err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_the_first_request_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _interrupt_at(monkeypatch, 1)
    assert main(["demo", "--sessions", "4", "--memory", "2MiB", *SMALL]) == 130
    assert capsys.readouterr().out.rstrip().endswith("kvstrata demo: interrupted")
    assert list(tmp_path.iterdir()) == []


def test_sigint_from_outside(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(Path(demo.__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata.cli.main", "demo", "--sessions", "3000", "--layers", "1", "--memory", "4MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for line in proc.stdout:
            if "SSD tier" in line:
                break
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert "interrupted" in out
    assert list(tmp_path.iterdir()) == []


def test_meta_device_is_an_argument_error():
    with pytest.raises(SystemExit, match="--device 'meta': KV tensors must be on cpu or cuda"):
        main(["demo", "--device", "meta"])


def test_a_cuda_index_past_the_devices_is_an_argument_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match=r"--device cuda:1: there is 1 CUDA device here \(cuda:0\)"):
        main(["demo", "--device", "cuda:1"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match=r"--device cuda:7: there are 2 CUDA devices here \(cuda:0..cuda:1\)"):
        main(["demo", "--device", "cuda:7"])


@pytest.mark.gpu
def test_a_cuda_index_past_the_devices_on_a_gpu_host():
    n = torch.cuda.device_count()
    with pytest.raises(SystemExit, match=f"--device cuda:{n}: there"):
        main(["demo", "--device", f"cuda:{n}"])
