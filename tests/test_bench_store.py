"""`kvstrata bench store` end to end at a tiny size: a real worker process, a client, a result file."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvstrata.bench import mooncake, store
from kvstrata.bench.store import KEYS_PER_CLIENT, _add_ratios, _start_mooncake
from kvstrata.client.local_reads import MAX_ENTRIES

MOONCAKE_MISSING = mooncake.unavailable()


def _bench(tmp_path, *extra, timeout=240):
    """Run ``kvstrata bench store`` to its end. Past ``timeout`` it is sent SIGTERM, so that it tears its Mooncake
    namespace and processes down before the test fails (``subprocess.run``'s kill left them for the next tests)."""
    argv = ["bench", "store", "--no-redis", "--sizes", "4KiB", "--clients", "1", "--seconds", "0.1", *extra]
    cmd = [sys.executable, "-m", "kvstrata.cli.main", *argv, "--out", str(tmp_path)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _our_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("kvstrata-mc-")}


def test_bench_store_runs_and_records(tmp_path):
    out = _bench(tmp_path, "--no-mooncake")
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "store.json").read_text())
    assert record["environment"]["command"].endswith(f"--out {tmp_path}")
    rows = {r["op"]: r for r in record["rows"] if r["system"] == "kvstrata" and r["size"] == 4096}
    assert set(rows) == {"set", "get_cached", "get", "get_buffers"}
    assert all(r["system"] == "kvstrata" for r in record["rows"])
    assert record["baselines"] == {"redis": None, "mooncake": None}
    assert record["baselines_skipped"] == {"redis": "--no-redis", "mooncake": "--no-mooncake"}
    assert record["interrupted"] is False
    assert all(r["ops_per_s"] > 0 and r["ops"] > 0 and r["correct"] is True for r in record["rows"])
    # get_cached: every timed get a local read; get: keys past what the local-read cache holds, read by the worker
    assert rows["get_cached"]["keys"] == KEYS_PER_CLIENT and rows["get_cached"]["local_reads"] >= 0.99
    assert rows["get"]["keys"] == store.get_keys(4096, record["worker_memory"]) > MAX_ENTRIES
    assert rows["get"]["local_reads"] <= 2 / store.UNCACHED_FACTOR
    assert rows["get_buffers"]["GB/s"] is None  # a view's bytes are never read


def test_ratios_pair_the_same_op_size_clients_and_keys():
    rows = [
        {"system": "kvstrata", "op": "get_buffers", "size": 4096, "clients": 1, "keys": 4, "ops_per_s": 900},
        {"system": "kvstrata", "op": "set", "size": 4096, "clients": 8, "keys": 4, "ops_per_s": 600},
        {"system": "kvstrata", "op": "get", "size": 4096, "clients": 1, "keys": 8192, "ops_per_s": 500},
        {"system": "kvstrata", "op": "get_buffers", "size": 1 << 20, "clients": 1, "keys": 4, "ops_per_s": 800},
        {"system": "redis", "op": "get_cached", "size": 4096, "clients": 1, "keys": 4, "ops_per_s": 300},
        {"system": "redis", "op": "get", "size": 4096, "clients": 1, "keys": 8192, "ops_per_s": 250},
        {"system": "redis", "op": "get", "size": 1 << 20, "clients": 1, "keys": 4, "ops_per_s": 200},
        {"system": "mooncake", "op": "get_buffers", "size": 4096, "clients": 1, "keys": 4, "ops_per_s": 100},
        {"system": "mooncake", "op": "set", "size": 4096, "clients": 1, "keys": 4, "ops_per_s": 7},  # other clients
        {"system": "mooncake", "op": "get", "size": 4096, "clients": 1, "keys": 4, "ops_per_s": 7},  # other keys
    ]
    _add_ratios(rows)
    assert rows[0]["x_redis"] == 3.0 and rows[0]["x_mooncake"] == 9.0
    assert "x_redis" not in rows[1] and "x_mooncake" not in rows[1]
    assert rows[2]["x_redis"] == 2.0 and "x_mooncake" not in rows[2]  # Redis on the same 8192 keys, not on 4
    assert rows[3]["x_redis"] == 4.0  # no get_cached row for 1 MiB values: Redis's get of the same 4 keys
    assert all("x_mooncake" not in r and "x_redis" not in r for r in rows[4:])


def _parse(*argv):
    parser = argparse.ArgumentParser()
    store.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_arguments_any_size_and_counts():
    args = _parse("--sizes", "4K,8KiB, 1MiB,100", "--clients", "1,3", "--seconds", "0.5")
    assert (args.sizes, args.clients, args.seconds) == ([4096, 8192, 1 << 20, 100], [1, 3], 0.5)
    default = _parse()
    assert (default.sizes, default.clients, default.seconds) == ([4096, 1 << 20, 16 << 20], [1, 8], 1.0)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--sizes", "garbage"], "argument --sizes: size: expected a size"),
        (["--sizes", "4KiB,0"], "argument --sizes: sizes must be > 0"),
        (["--clients", "abc"], "argument --clients: expected integers > 0"),
        (["--clients", "0"], "argument --clients: every value must be > 0, got 0"),
        (["--clients", "1,0"], "argument --clients: every value must be > 0, got 0"),
        (["--seconds", "nan"], "argument --seconds: must be a finite number > 0"),
        (["--seconds", "-5"], "argument --seconds: must be a finite number > 0"),
        (["--seconds", "inf"], "argument --seconds: must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_argparse_errors_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        _parse(*argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_a_row_counts_its_ops_and_times_whole_loops():
    results = [
        {"times": [1e-6] * 10, "wall": 1e-4, "correct": True, "local_hits": 10},
        {"times": [2e-6] * 10, "wall": 2e-4, "correct": True, "local_hits": 5},
    ]
    row = store._row("kvstrata", "get", 1000, 2, results, keys=8)
    assert row["ops"] == 20 and row["keys"] == 8
    assert row["ops_per_s"] == 100_000  # 20 ops over the slower loop's wall time, not over the sum of its ops
    assert row["GB/s"] == 0.1 and row["p50_us"] == 1.5
    assert row["local_reads"] == 0.75 and row["correct"] is True
    view = store._row("kvstrata", "get_buffers", 1000, 2, results)
    assert view["GB/s"] is None  # its bytes are never read
    results[1]["correct"] = False
    assert store._row("redis", "get", 1000, 2, [dict(r, local_hits=None) for r in results])["correct"] is False
    assert "local_reads" not in store._row("redis", "get", 1000, 2, [dict(r, local_hits=None) for r in results])


class _Barrier:
    def wait(self, timeout=None):
        return 0


@pytest.mark.parametrize("op", ["set", "get_cached", "get", "get_buffers"])
def test_a_job_checks_the_value_it_reads_last(worker, op, monkeypatch):
    out = store._job("kvstrata", worker.address, op, 0, 4096, 20, 4, _Barrier())
    assert out["correct"] is True and len(out["times"]) == 20 and out["wall"] >= sum(out["times"])
    assert out["local_hits"] == (20 if op in ("get_cached", "get", "get_buffers") else 0)
    from kvstrata.client.client import Client

    monkeypatch.setattr(Client, "get", lambda self, key, **kw: b"not what was written")
    monkeypatch.setattr(Client, "get_buffers", lambda self, keys, **kw: [_WrongView() for _ in keys])
    assert store._job("kvstrata", worker.address, op, 0, 4096, 20, 4, _Barrier())["correct"] is False


class _WrongView:
    def memoryview(self):
        return memoryview(b"not what was written")

    def release(self):
        pass


def test_read_back_compares_what_mset_d2h_wrote():
    import torch

    import kvstrata

    src = [[torch.full((64,), float(i))] for i in range(4)]
    keys = [f"rb/{i}" for i in range(4)]
    with kvstrata.connect(embedded=True, memory_bytes=8 << 20) as kv:
        assert kv.mset_d2h(keys, src) == [None] * 4
        store.read_back(kv, keys, src)
        wrong = [[t.clone() for t in ts] for ts in src]
        wrong[2][0][5] = -1.0
        with pytest.raises(AssertionError, match="1 of 4 keys written by mset_d2h read back wrong, first 'rb/2'"):
            store.read_back(kv, keys, wrong)
        with pytest.raises(AssertionError, match="1 of 5 keys"):
            store.read_back(kv, [*keys, "rb/missing"], [*src, src[0]])


def test_worker_memory_holds_every_row():
    memory = store.worker_memory([4096, 1 << 20, 16 << 20], [1, 8], cuda=False)
    for size in (4096, 1 << 20, 16 << 20):
        assert 8 * store.get_keys(size, memory) * size < memory
    assert store.get_keys(4096, memory) == store.UNCACHED_FACTOR * MAX_ENTRIES
    assert store.get_keys(16 << 20, memory) == KEYS_PER_CLIENT  # never cached: no more keys needed
    assert [op for op, _ in store._ops(1 << 20, memory)] == ["set", "get", "get_buffers"]


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kvstrata_workers(pid: int) -> list[psutil.Process]:
    out = []
    for child in _children(pid):
        try:
            if "worker" in child.cmdline():
                out.append(child)
        except psutil.Error:
            pass
    return out


def _start_bench(tmp_path, *argv):
    return subprocess.Popen(
        [sys.executable, "-m", "kvstrata.cli.main", "bench", "store", "--no-redis", "--no-mooncake", *argv,
         "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def test_sigterm_while_the_worker_starts_leaves_no_worker(tmp_path):
    proc = _start_bench(tmp_path, "--sizes", "4KiB", "--clients", "1", "--seconds", "0.1")
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not workers and time.monotonic() < deadline and proc.poll() is None:
            workers = _kvstrata_workers(proc.pid)
            time.sleep(0.005)
        assert workers, "no worker process seen"
        time.sleep(0.1)  # past the bench's Popen (its child execs first); the worker still imports, not listening
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err[-2000:]
        assert "nothing written" in out
        alive = psutil.wait_procs(workers, timeout=10)[1]
        assert alive == [], "the worker outlived the bench"
        assert not (tmp_path / "store.json").exists()
    finally:
        for w in workers:
            if w.is_running():
                w.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sigterm_after_a_row_writes_the_rows_so_far(tmp_path):
    proc = _start_bench(tmp_path, "--sizes", "4KiB,1MiB", "--clients", "1", "--seconds", "2")
    try:
        for line in proc.stdout:
            if line.strip().startswith("kvstrata set"):
                break
        workers = _kvstrata_workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    record = json.loads((tmp_path / "store.json").read_text())
    assert record["interrupted"] is True
    assert record["rows"] and record["rows"][0]["op"] == "set" and record["rows"][0]["ops_per_s"] > 0
    assert "interrupted" in out
    assert psutil.wait_procs(workers, timeout=10)[1] == []


def test_mooncake_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mooncake, "unavailable", lambda: "libibverbs missing (apt-get install libibverbs1)")
    skipped = {}
    assert _start_mooncake(tmp_path, 1 << 30, skipped) is None
    assert "libibverbs missing (apt-get install libibverbs1): Mooncake rows skipped" in capsys.readouterr().out
    assert skipped == {"mooncake": "libibverbs missing (apt-get install libibverbs1)"}  # kept for the JSON

    def no_netns(**kwargs):
        raise RuntimeError("ip netns add kvstrata-mc-1: Operation not permitted")

    monkeypatch.setattr(mooncake, "unavailable", lambda: None)
    monkeypatch.setattr(mooncake, "MooncakeStore", no_netns)
    assert _start_mooncake(tmp_path, 1 << 30, skipped) is None
    out = capsys.readouterr().out
    assert "did not start (ip netns add kvstrata-mc-1: Operation not permitted): Mooncake rows skipped" in out
    assert skipped["mooncake"].endswith("did not start (ip netns add kvstrata-mc-1: Operation not permitted)")


@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=f"Mooncake rows cannot run: {MOONCAKE_MISSING}")
def test_bench_store_mooncake_rows_and_teardown(tmp_path):
    before = _our_namespaces()
    out = _bench(tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "store.json").read_text())
    assert record["baselines"]["mooncake"].startswith("mooncake")
    assert "mooncake" not in record["baselines_skipped"]
    rows = record["rows"]
    mc = {r["op"]: r for r in rows if r["system"] == "mooncake"}
    assert set(mc) == {"set", "get_cached", "get", "get_buffers"}
    assert all(r["ops_per_s"] > 0 and r["correct"] for r in mc.values())
    assert mc["get_buffers"]["GB/s"] is None  # its handle's bytes are not read, as kvstrata's view's
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
    record = json.loads((tmp_path / "store.json").read_text())  # the rows finished before the signal
    assert record["interrupted"] is True and [r["op"] for r in record["rows"]] == ["set"]
    assert proc.returncode == 130
    assert Path(log_dir, "mooncake_master.log").exists()  # kept after an interrupted run
    shutil.rmtree(log_dir)


def test_bench_help_names_every_baseline_of_the_store_job(capsys):
    from kvstrata.cli.main import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "vs Redis and Mooncake Store" in out
