"""``kvstrata bench checkpoint`` at a tiny size: every row, the bit-for-bit check, the ratios."""

from __future__ import annotations

import json

from kvstrata.cli.main import main


def test_a_tiny_run_writes_every_row(tmp_path, capsys):
    args = ["bench", "checkpoint", "--layers", "1", "--hidden", "64", "--iters", "2", "--name", "c"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["correct"] is True and record["environment"]["command"] and record["first_save_ms"] > 0
    rows = {r["row"]: r for r in record["rows"]}
    assert {"kvstrata save", "kvstrata load", "torch.save file", "torch.load file"} <= set(rows)
    assert all(r["ms"] > 0 and r["GBps"] > 0 for r in rows.values())
    assert rows["torch.load file"]["vs_torch"] == 1.0
    assert "bit for bit: True" in capsys.readouterr().out
