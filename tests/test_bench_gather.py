import json

import pytest
import torch

from kvstrata.cli.main import main


def test_bench_gather_smoke_writes_checked_results(tmp_path, capsys):
    assert main(["bench", "gather", "--smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gather_smoke.json").read_text())
    assert record["environment"]["command"]
    methods = {(r["rows"], r["method"]) for r in record["rows"]}
    assert methods == {(16, "kvstrata"), (16, "reference"), (64, "kvstrata"), (64, "reference")}
    assert all(r["correct"] for r in record["rows"])
    assert "kvstrata" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_gather_quick_on_gpu(tmp_path):
    assert torch.cuda.is_available()
    assert main(["bench", "gather", "--quick", "--rows", "1024", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gather_quick.json").read_text())
    methods = {r["method"] for r in record["rows"]}
    assert {"kvstrata", "to_cuda", "dma_ceiling", "dma_same_bytes", "index_select_uva", "cpu_gather_pinned"} <= methods
    assert all(r["correct"] for r in record["rows"] if "correct" in r)
    (speedup,) = [t for t in record["targets"] if t["name"] == "speedup_vs_to_cuda_at_1024_rows_1KiB"]
    assert speedup["dma_same_bytes_x_to_cuda"] > 0 and 0 < speedup["of_dma_same_bytes"] <= 1.5


def _tune_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "tune_gather.py"
    spec = importlib.util.spec_from_file_location("tune_gather", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_gather_sweeps_every_schedule_within_its_budget():
    from kvstrata.ops.gather import SCHEDULES

    configs = _tune_tool()._sweep(quick=False)
    assert {c[0] for c in configs} == set(SCHEDULES)
    assert len(configs) == len(set(configs)) <= 56  # x 3 row counts: timing stays a few seconds
    compiled = {(tile, warps, schedule == "prefetch") for schedule, tile, warps, _ in configs}
    assert len(compiled) <= 16  # kernel variants to compile: much of the tool's run time


@pytest.mark.gpu
def test_tune_gather_quick_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["tune_gather.py", "--quick", "--rows", "1024", "--out", str(tmp_path)])
    assert _tune_tool().main() == 0
    record = json.loads((tmp_path / "tune_gather.json").read_text())
    assert all(r["correct"] for r in record["results"])
    assert record["host_us_per_call_1024_rows"]["kvstrata_plan_hit_device_ids"] > 0
