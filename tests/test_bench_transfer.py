"""``kvstrata bench transfer --smoke`` runs on CPU, checks every method and writes its JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

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
