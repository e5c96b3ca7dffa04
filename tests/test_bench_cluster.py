"""``kvstrata bench cluster`` at a tiny size: workers over a real etcd, every row, the failover and join rows, the
ratios."""

from __future__ import annotations

import json
import shutil

import pytest

from kvstrata.cli.main import main


@pytest.mark.skipif(shutil.which("etcd") is None, reason="no etcd binary (apt-get install etcd-server)")
def test_a_short_run_writes_every_row_and_the_failover(tmp_path, capsys):
    args = ["bench", "cluster", "--workers", "2", "--sizes", "4KiB", "--batch", "8", "--seconds", "0.05"]
    args += ["--join-bytes", "8MiB"]
    assert main([*args, "--ttl", "1", "--name", "c", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["correct"] is True and record["environment"]["command"]
    rows = {(r["system"], r["op"]) for r in record["rows"]}
    assert rows == {(s, op) for s in ("direct", "cluster", "cluster-r2", "cluster-tcp") for op in ("mset", "mget")}
    assert all(r["keys_per_s"] > 0 and r["vs_direct"] > 0 for r in record["rows"])
    assert all(r["vs_direct"] == 1.0 for r in record["rows"] if r["system"] == "direct")
    failover = record["failover"]
    assert failover["all_keys_read"] is True and 0 < failover["dropped_from_list_after_s"] < 30
    join = record["join"]
    assert join["all_keys_read"] is True and join["bytes_in_cluster"] == 8 << 20
    assert 0 < join["keys_moved"] < 8 and join["bytes_moved"] == join["keys_moved"] << 20
    assert join["moved_s"] > 0 and join["vs_client_write"] is not None  # (a few MiB: GB/s may round to 0)
    assert join["old_copies_dropped_s"] >= join["moved_s"]
    assert "failover" in capsys.readouterr().out


def test_one_worker_is_refused():
    assert main(["bench", "cluster", "--workers", "1"]) == 2
