"""``kvstrata bench transfer --smoke`` runs on CPU, checks every method and writes its JSON."""

from __future__ import annotations

import argparse
import json

from kvstrata.bench import transfer


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
