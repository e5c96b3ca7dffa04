"""`kvstrata bench store` end to end at a tiny size: a real worker process, a client, a result file."""

import json
import subprocess
import sys


def test_bench_store_runs_and_records(tmp_path):
    argv = ["bench", "store", "--no-redis", "--sizes", "4KiB", "--clients", "1", "--seconds", "0.1"]
    out = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "store.json").read_text())
    assert record["environment"]["command"].endswith(f"--out {tmp_path}")
    ops = {(r["op"], r["system"]) for r in record["rows"]}
    assert {("set", "kvstrata"), ("get", "kvstrata"), ("get_buffers", "kvstrata")} <= ops
    assert all(r["ops_per_s"] > 0 for r in record["rows"] if r["system"] == "kvstrata")
