"""`kvstrata bench store` end to end at a tiny size: a real worker process, a client, a result file."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstrata.bench import mooncake
from kvstrata.bench.store import _add_ratios, _start_mooncake

MOONCAKE_MISSING = mooncake.unavailable()


def _bench(tmp_path, *extra, timeout=240):
    argv = ["bench", "store", "--no-redis", "--sizes", "4KiB", "--clients", "1", "--seconds", "0.1", *extra]
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _our_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("kvstrata-mc-")}


def test_bench_store_runs_and_records(tmp_path):
    out = _bench(tmp_path, "--no-mooncake")
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "store.json").read_text())
    assert record["environment"]["command"].endswith(f"--out {tmp_path}")
    ops = {(r["op"], r["system"]) for r in record["rows"]}
    assert {("set", "kvstrata"), ("get", "kvstrata"), ("get_buffers", "kvstrata")} <= ops
    assert all(r["system"] == "kvstrata" for r in record["rows"])
    assert record["baselines"] == {"redis": None, "mooncake": None}
    assert all(r["ops_per_s"] > 0 for r in record["rows"])


def test_ratios_pair_the_same_op_size_and_clients():
    rows = [
        {"system": "kvstrata", "op": "get_buffers", "size": 4096, "clients": 1, "ops_per_s": 900},
        {"system": "kvstrata", "op": "set", "size": 4096, "clients": 8, "ops_per_s": 600},
        {"system": "redis", "op": "get", "size": 4096, "clients": 1, "ops_per_s": 300},
        {"system": "mooncake", "op": "get_buffers", "size": 4096, "clients": 1, "ops_per_s": 100},
        {"system": "mooncake", "op": "set", "size": 4096, "clients": 1, "ops_per_s": 7},  # other client count
    ]
    _add_ratios(rows)
    assert rows[0]["x_redis"] == 3.0 and rows[0]["x_mooncake"] == 9.0
    assert "x_redis" not in rows[1] and "x_mooncake" not in rows[1]
    assert all("x_mooncake" not in r and "x_redis" not in r for r in rows[2:])


def test_mooncake_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mooncake, "unavailable", lambda: "libibverbs missing (apt-get install libibverbs1)")
    assert _start_mooncake(tmp_path, 1 << 30) is None
    assert "libibverbs missing (apt-get install libibverbs1): Mooncake rows skipped" in capsys.readouterr().out

    def no_netns(**kwargs):
        raise RuntimeError("ip netns add kvstrata-mc-1: Operation not permitted")

    monkeypatch.setattr(mooncake, "unavailable", lambda: None)
    monkeypatch.setattr(mooncake, "MooncakeStore", no_netns)
    assert _start_mooncake(tmp_path, 1 << 30) is None
    out = capsys.readouterr().out
    assert "did not start (ip netns add kvstrata-mc-1: Operation not permitted): Mooncake rows skipped" in out


@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"Mooncake rows cannot run: {MOONCAKE_MISSING}")
def test_bench_store_mooncake_rows_and_teardown(tmp_path):
    before = _our_namespaces()
    out = _bench(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "store.json").read_text())
    assert record["baselines"]["mooncake"].startswith("mooncake")
    rows = record["rows"]
    mc = {r["op"]: r for r in rows if r["system"] == "mooncake"}
    assert set(mc) == {"set", "get", "get_buffers"}
    assert all(r["ops_per_s"] > 0 for r in mc.values())
    assert all("x_mooncake" in r for r in rows if r["system"] == "kvstrata")
    assert _our_namespaces() == before  # namespace and its processes gone


def _processes_in(netns_inode: int) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns" / "net") == f"net:[{netns_inode}]":
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"Mooncake rows cannot run: {MOONCAKE_MISSING}")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_tears_mooncake_down(tmp_path, signum):
    """SIGINT or SIGTERM while Mooncake's clients measure: namespace deleted, nothing left running in it."""
    before = _our_namespaces()
    argv = ["bench", "store", "--no-redis", "--sizes", "4KiB", "--clients", "1", "--seconds", "0.5"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstrata.cli.main", *argv, "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        inode = None
        for line in proc.stdout:
            if "Mooncake Store up" in line:
                log_dir = line.rsplit("logs: ", 1)[1].rstrip(")\n")
                (ns,) = _our_namespaces() - before
                inode = os.stat(f"/run/netns/{ns}").st_ino
            if line.strip().startswith("kvstrata set"):  # Mooncake's set row is next
                break
        assert inode is not None and _processes_in(inode), "Mooncake not running"
        time.sleep(0.5)
        proc.send_signal(signum)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert _our_namespaces() == before
    assert _processes_in(inode) == []
    assert not (tmp_path / "store.json").exists()
    assert Path(log_dir, "mooncake_master.log").exists()  # kept after an interrupted run
    shutil.rmtree(log_dir)
