"""``kvstrata bench prefix`` on the CPU (--smoke): the plumbing, its rows and its check of the loaded blocks."""

from __future__ import annotations

import json

from kvstrata.cli.main import main


def test_smoke_run_writes_every_row_and_checks_the_blocks(tmp_path, capsys):
    assert main(["bench", "prefix", "--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loaded blocks match the saved ones bit for bit: True" in out
    record = json.loads((tmp_path / "prefix_cache_cpu.json").read_text())
    assert record["correct"] is True and record["environment"]["command"]
    rows = {r["row"]: r for r in record["rows"]}
    expected = {f"{op} {v} ({d})" for v in ("packed", "pieces") for op, d in (("save", "d2h"), ("load cold", "h2d"))}
    expected |= {f"load kept {v} (h2d)" for v in ("packed", "pieces")} | {"lookup packed", "lookup pieces"}
    expected |= {"torch per piece d2h", "torch per piece h2d", "dma d2h", "dma h2d"}
    assert set(rows) == expected
    assert all(r["ms"] > 0 for r in rows.values())
    assert (
        rows["dma h2d"]["of_dma"] == 1.0 and rows["save packed (d2h)"]["bytes"] == 8 * record["geometry"]["block_bytes"]
    )
