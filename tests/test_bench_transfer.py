"""``kvstrata bench transfer --smoke`` runs on CPU, checks every method and writes its JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata
from kvstrata.bench import transfer

SRC = str(Path(kvstrata.__file__).resolve().parents[1])


def test_smoke(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    args = parser.parse_args(["--smoke"])
    args.out = str(tmp_path)
    assert transfer.run(args) == 0
    data = json.loads((tmp_path / "transfer-smoke.json").read_text())
    assert {r["method"] for r in data["rows"]} == {"torch", "copy_engine", "zero_copy", "staging", "auto"}
    assert all(r["correct"] is True for r in data["rows"])
    assert "d2h_MBps" in capsys.readouterr().out


def test_smoke_from_the_command_line_of_a_shell_without_triton_interpret(tmp_path):
    """It failed with Triton's ``0 active drivers``: the interpreter was asked for after the kernels were defined."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", "bench", "transfer", "--smoke", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert all(r["correct"] is True for r in json.loads((tmp_path / "transfer-smoke.json").read_text())["rows"])


# ------------------------------------------------------------------------------------- the audit's findings
def _point(auto_d2h, correct_auto=True):
    return {
        "layers": 32,
        "chunk": 32 * 1024,
        "correct": {"auto": correct_auto, "zero_copy": True, "staging": True, "copy_engine": True},
        "d2h": {"auto": auto_d2h, "zero_copy": 50.0, "staging": "error: RuntimeError('x')"},
        "h2d": {"auto": 53.0, "zero_copy": 51.0},
        "auto_chooses": {"d2h": "staging", "h2d": "zero_copy"},
        "mlbt_auto_chooses": {"d2h": "staging", "h2d": "zero_copy"},
        "mlbt_auto_d2h": "WRONG",
        "mlbt_auto_h2d": 53.0,
    }


def test_table_rows_of_a_point_whose_method_failed_its_check():
    """A "WRONG" rate was divided by the ceiling: TypeError, and the whole sweep lost, exactly when a check failed."""
    rows = transfer.point_rows(_point("WRONG", correct_auto=False), {"d2h": 55.0, "h2d": 55.0})
    d2h, h2d = rows
    assert d2h["auto"] == "WRONG" and d2h["auto/ceil"] == "WRONG" and d2h["zero_copy"] == "50.0"
    assert d2h["staging"].startswith("error:")
    assert h2d["auto/ceil"] == "0.96" and h2d["auto_is"] == "zero_copy"
    rows = transfer.point_rows({**_point(50.0), "d2h": {"zero_copy": 50.0}}, {"d2h": 55.0, "h2d": 55.0})
    assert rows[0]["auto/ceil"] == "-"  # auto not measured at all


def _result(point):
    latency = {"d2h@16Kx64": {"auto_us": 10.0, "zero_copy_graph_us": 10.0, "target_us": 40.0}}
    return {
        "ceiling": {"d2h": 55.0, "h2d": 55.0, "both": 100.0},
        "points": [point],
        "store_and_load": {"vs_both_ceiling": 0.95},
        "under_gemm": {"auto@32K": {"gemm_kept": 0.99, "GBps": 50.0}},
        "latency": latency,
    }


def test_a_method_that_failed_its_check_meets_no_target():
    good = {v["target"]: v["ok"] for v in transfer._verdicts(_result(_point(54.0)))}
    assert all(ok for target, ok in good.items() if "mlbt" not in target)
    bad = transfer._verdicts(_result(_point(54.0, correct_auto=False)))
    auto = [v for v in bad if "auto" in v["target"] or "store+load" in v["target"] or "GEMM" in v["target"]]
    assert auto and not any(v["ok"] for v in auto if "mlbt" not in v["target"])
    assert all("failed its check" in str(v["measured"]) for v in bad if "GEMM" in v["target"])
    assert {v["target"]: v["ok"] for v in bad}["mlbt auto d2h L=32 32K >= 0.95 ceiling"] is False  # "WRONG"


def _mlbt_setup(n_layers=2, t=4, d=128):
    """Host block and layers as the bench makes them: on the GPU where there is one (pinned host block), else CPU
    tensors under the Triton interpreter."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    host = torch.empty(t, n_layers, 1, d, dtype=torch.bfloat16, pin_memory=device == "cuda")
    layers = [torch.randn(1, t, d, dtype=torch.bfloat16, device=device) for _ in range(n_layers)]
    ptrs = torch.tensor([x.data_ptr() for x in layers], dtype=torch.int64, device=device)
    return host, layers, ptrs


def test_mlbt_check_fails_a_method_that_moves_nothing():
    """The check compared the host block with the layers after each call: a no-op passed once a real method ran."""
    from kvstrata.ops import multi_layer_block_transfer

    host, layers, ptrs = _mlbt_setup()
    saved = [x.clone() for x in layers]
    real = lambda dr: multi_layer_block_transfer(ptrs, host, direction=dr, method="auto")
    assert transfer.mlbt_check(real, host, layers) == {"d2h": True, "h2d": True}
    assert transfer.mlbt_check(lambda dr: None, host, layers) == {"d2h": False, "h2d": False}
    one_way = lambda dr: real(dr) if dr == "d2h" else None
    assert transfer.mlbt_check(one_way, host, layers) == {"d2h": True, "h2d": False}
    assert all(x.equal(s) for x, s in zip(layers, saved))  # the layers hold their values again after each check


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--layers", "abc"], "argument --layers: expected integers > 0"),
        (["--layers", "32,0"], "argument --layers: every value must be > 0"),
        (["--chunks-kib", "2,x"], "argument --chunks-kib: expected integers > 0"),
        (["--total-mib", "0"], "argument --total-mib: must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_argparse_errors(argv, says, capsys):
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert says in capsys.readouterr().err
    assert parser.parse_args(["--layers", "2,80", "--chunks-kib", "4"]).layers == [2, 80]
