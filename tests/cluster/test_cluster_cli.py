"""Cluster mode from the command line: ``kvstrata worker --cluster`` processes join a real etcd, a client's keys
outlive a SIGKILLed worker (replicas), ``kvstrata status --cluster`` shows the workers, and bad settings are named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kvstrata
from kv_helpers import wait_until
from kvstrata.cluster import open_membership
from kvstrata.errors import InvalidValue
from kvstrata.server import WorkerConfig

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def kvstrata_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )


def start_worker(folder: Path, i: int, url: str, ttl: float = 2, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable, "-m", "kvstrata.cli.main", "worker",
            "--socket", str(folder / f"w{i}.sock"), "--memory", "16MiB", "--disk-dir", "",
            "--cluster", url, "--cluster-listen", "tcp://127.0.0.1:0", "--cluster-ttl", str(ttl), "--node-id", f"w{i}",
            *more,
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=(folder / f"w{i}.log").open("w"),
    )  # fmt: skip


def test_workers_join_and_a_killed_one_loses_no_replicated_key(etcd_cluster_url, tmp_path):
    """--cluster-replicas 2: a SIGKILLed worker's keys are read from their other copy at once, the workers left make
    two copies again (a rebalance), so a second worker stopping without a drain loses none either."""
    procs = [start_worker(tmp_path, i, etcd_cluster_url, 2, "--cluster-replicas", "2") for i in range(3)]
    try:
        with open_membership(etcd_cluster_url) as membership:
            assert wait_until(lambda: len(membership.members()) == 3, 60), (tmp_path / "w0.log").read_text()
            shown = kvstrata_cli("status", "--cluster", etcd_cluster_url)
            assert shown.returncode == 0, shown.stderr
            assert "3 workers listed" in shown.stdout and all(f"w{i} " in shown.stdout for i in range(3))
            with kvstrata.connect(cluster=etcd_cluster_url) as kv:
                assert kv.replicas == 2  # (the workers' setting)
                items = {f"shard{i}": os.urandom(1000 + i) for i in range(30)}
                assert kv.mset(items) == [None] * 30
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait()
                assert kv.mget(list(items)) == list(items.values())  # (at once: w1 is skipped, its replicas read)
                assert wait_until(lambda: set(membership.members()) == {"w0", "w2"}, 15), "w1 stayed listed"
                assert kv.mget(list(items)) == list(items.values())
                assert kv.mset({"after": b"a"}) == [None]
                w2 = kv.client("w2")
                assert wait_until(lambda: all(w2.exists(list(items))), 20), (tmp_path / "w0.log").read_text()

                def settled() -> bool:  # (each worker's rebalance done: past its grace, nothing running)
                    shown = kvstrata_cli("status", "--cluster", etcd_cluster_url).stdout
                    return shown.count("last rebalance") == 2 and "rebalancing" not in shown

                assert wait_until(settled, 30), kvstrata_cli("status", "--cluster", etcd_cluster_url).stdout
            procs[0].send_signal(signal.SIGTERM)  # a clean stop leaves the list at once (no drain: w2 has them all)
            assert procs[0].wait(timeout=30) == 0
            assert set(membership.members()) == {"w2"}
            with kvstrata.connect(cluster=etcd_cluster_url) as kv:
                assert kv.mget(list(items)) == list(items.values())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_worker_whose_etcd_is_out_of_reach_does_not_start(tmp_path):
    done = kvstrata_cli(
        "worker", "--socket", str(tmp_path / "w.sock"), "--memory", "16MiB", "--disk-dir", "",
        "--cluster", "etcd://127.0.0.1:1/x",
    )  # fmt: skip
    assert done.returncode == 1
    assert "cannot reach etcd" in done.stderr and "127.0.0.1:1" in done.stderr
    assert not (tmp_path / "w.sock").exists()


def test_a_node_id_taken_by_a_live_worker_is_refused(etcd_cluster_url, tmp_path):
    first = start_worker(tmp_path, 0, etcd_cluster_url)
    try:
        with open_membership(etcd_cluster_url) as membership:
            assert wait_until(lambda: "w0" in membership.members(), 60), (tmp_path / "w0.log").read_text()
        done = kvstrata_cli(
            "worker", "--socket", str(tmp_path / "again.sock"), "--memory", "16MiB", "--disk-dir", "",
            "--cluster", etcd_cluster_url, "--cluster-listen", "tcp://127.0.0.1:0", "--node-id", "w0",
        )  # fmt: skip
        assert done.returncode == 1 and "'w0' is already a member" in done.stderr, done.stderr
    finally:
        first.kill()
        first.wait()


def test_status_of_a_cluster_out_of_reach_or_empty(etcd_cluster_url):
    gone = kvstrata_cli("status", "--cluster", "etcd://127.0.0.1:1/x", "--timeout", "1")
    assert gone.returncode == 1 and "cannot reach etcd" in gone.stderr
    empty = kvstrata_cli("status", "--cluster", etcd_cluster_url)
    assert empty.returncode == 0 and "0 workers listed" in empty.stdout and "no worker has joined" in empty.stdout
    bad = kvstrata_cli("status", "--cluster", "redis://h:1")
    assert bad.returncode == 2 and "unknown scheme" in bad.stderr
    both = kvstrata_cli("status", "--cluster", etcd_cluster_url, "--prometheus")
    assert both.returncode == 2


def test_a_worker_stopped_with_sigterm_hands_its_keys_on(etcd_cluster_url, tmp_path):
    """--cluster-drain: the keys of a worker stopped on purpose stay readable; it logs what it handed on."""
    procs = [start_worker(tmp_path, i, etcd_cluster_url, 2, "--cluster-drain", "20") for i in range(2)]
    try:
        with open_membership(etcd_cluster_url) as membership:
            assert wait_until(lambda: len(membership.members()) == 2, 60), (tmp_path / "w0.log").read_text()
            with kvstrata.connect(cluster=etcd_cluster_url) as kv:
                items = {f"k{i}": os.urandom(100 + 997 * i) for i in range(40)}
                assert kv.mset(items) == [None] * 40
                procs[0].send_signal(signal.SIGTERM)
                assert procs[0].wait(30) == 0
                assert wait_until(lambda: set(membership.members()) == {"w1"}, 15)
                assert kv.mget(list(items)) == list(items.values())
        assert "handed on" in (tmp_path / "w0.log").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"cluster": "redis://h:1"}, r"cluster \(--cluster\)"),
        ({"cluster": "inproc://x", "cluster_listen": "unix:///tmp/s"}, r"cluster_listen \(--cluster-listen\)"),
        ({"cluster": "inproc://x", "cluster_advertise": "h:1"}, r"cluster_advertise \(--cluster-advertise\)"),
        ({"cluster": "inproc://x", "node_id": "has space"}, r"node_id \(--node-id\)"),
        ({"cluster": "inproc://x", "cluster_ttl": 0.5}, r"cluster_ttl \(--cluster-ttl\)"),
        ({"cluster": "inproc://x", "cluster_drain": -1}, r"cluster_drain \(--cluster-drain\)"),
        ({"cluster": "inproc://x", "cluster_drain": float("nan")}, r"cluster_drain \(--cluster-drain\)"),
    ],
)
def test_bad_cluster_settings_are_named(settings, named):
    with pytest.raises(InvalidValue, match=named):
        WorkerConfig.load({"memory": "16MiB", "disk_dir": "", **settings}, environ={})


def test_a_worker_restarted_under_its_node_id_waits_for_its_dead_predecessors_lease(etcd_cluster_url, tmp_path):
    """systemd restarts a crashed worker at once: the old entry (a dead pid of this host) is waited out, not refused."""
    first = start_worker(tmp_path, 0, etcd_cluster_url, ttl=8)  # (longer than a restart takes)
    second = None
    try:
        with open_membership(etcd_cluster_url) as membership:
            assert wait_until(lambda: "w0" in membership.members(), 60), (tmp_path / "w0.log").read_text()
            old_pid = membership.members()["w0"].info["pid"]
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            (tmp_path / "w0.sock").unlink(missing_ok=True)
            second = start_worker(tmp_path, 0, etcd_cluster_url, ttl=8)
            relisted = lambda: (m := membership.members().get("w0")) is not None and m.info["pid"] != old_pid
            assert wait_until(relisted, 30), (tmp_path / "w0.log").read_text()
            assert second.poll() is None
            assert "waiting for its lease" in (tmp_path / "w0.log").read_text()
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
