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
    at = {r["method"]: r for r in record["rows"] if r["rows"] == 1024}
    # the target's ratio: isolated calls, wall clock, both; the streamed figure beside it
    assert at["kvstrata"]["x_to_cuda"] == round(at["to_cuda"]["wall_us"] / at["kvstrata"]["wall_us"], 1)
    assert at["kvstrata"]["streamed_us"] > 0 and at["to_cuda"]["streamed_us"] is None
    assert speedup["value"] == at["kvstrata"]["x_to_cuda"] and speedup["streamed_x_to_cuda"] > 0


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


def _case(kvstrata_correct=True):
    def row(method, wall_us, streamed_us=None, gbps=1.0, correct=True):
        return {"row_bytes": 1024, "rows": 1024, "method": method, "wall_us": wall_us, "streamed_us": streamed_us,
                "GBps": gbps, "correct": correct}  # fmt: skip

    return [
        row("kvstrata", 40.0, streamed_us=20.0, gbps=50.0, correct=kvstrata_correct),
        row("dma_same_bytes", 35.0, streamed_us=19.0, gbps=52.0),
        row("to_cuda", 200.0, gbps=5.0),
    ]


def test_x_to_cuda_compares_isolated_wall_times():
    """The ratio set the gather's streamed CUDA-event time (20 us) against to_cuda's isolated wall time (200 us)."""
    from kvstrata.bench import gather

    case = _case()
    gather.add_ratios(case, ceiling=55.0)
    kv, floor, base = case
    assert kv["x_to_cuda"] == 5.0  # 200 / 40, not 200 / 20
    assert floor["x_to_cuda"] == 5.7 and base["x_to_cuda"] == 1.0
    assert kv["of_ceiling"] == round(50.0 / 55.0, 3)  # streamed against the streamed ceiling
    (target,) = gather._targets(case)
    assert target["value"] == 5.0 and target["status"] == "missed"
    assert target["streamed_x_to_cuda"] == 10.0  # reported beside it, labeled, not judged
    assert target["of_dma_same_bytes"] == round(35.0 / 40.0, 3)


def test_a_wrong_gather_meets_no_target():
    from kvstrata.bench import gather

    case = _case(kvstrata_correct=False)
    case[2]["wall_us"] = 4000.0  # 100x faster than to_cuda, but wrong
    gather.add_ratios(case, ceiling=55.0)
    (target,) = gather._targets(case)
    assert target["value"] >= gather.TARGET_SPEEDUP and target["status"] == "missed (wrong results)"
    big = [dict(r, rows=16384, of_ceiling=0.99) for r in case]
    assert gather._targets(big)[0]["status"] == "missed (wrong results)"


def test_bad_row_counts_are_argparse_errors(capsys):
    import argparse

    from kvstrata.bench import gather

    parser = argparse.ArgumentParser()
    gather.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--rows", "1024,abc"])
    assert "argument --rows: expected integers > 0" in capsys.readouterr().err
