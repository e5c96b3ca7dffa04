"""A running worker and the CLI around it: the audit of `kvstrata worker`'s configuration, its shutdown and
`kvstrata status`. Each test failed before its fix (the audit's item is in its docstring)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvstrata
from kv_helpers import wait_until
from kvstrata.cli.main import main
from kvstrata.server import Worker, WorkerConfig
from kvstrata.server import config as C

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _config(tmp_path, **settings):
    base = {"socket": str(tmp_path / "w.sock"), "memory": "16MiB", "disk_dir": "", "numa_node": "none"}
    return WorkerConfig.load({**base, **settings}, environ={})


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    return {**env, "PYTHONPATH": SRC + os.pathsep + env.get("PYTHONPATH", "")}


def _start_cli_worker(tmp_path, *args: str) -> tuple[subprocess.Popen, Path]:
    sock = tmp_path / "w.sock"
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", "32MiB"]
    cmd += ["--numa-node", "none", "--segment-size", "8MiB", *args]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"worker did not start: {proc.communicate()[0]}")
        time.sleep(0.05)
    return proc, sock


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"worker did not stop on signal {sig}: {out}") from None
    return proc.returncode, out


# 4. write-back data lost at shutdown ---------------------------------------------------------------------------------
def test_stop_reports_the_write_back_objects_it_lost(tmp_path):
    """Item 4: stop() logged the loss and returned None; nothing told a caller data was lost."""
    config = _config(tmp_path, disk_dir=str(tmp_path / "ssd"), disk_size="64MiB")
    worker = Worker(config).start()
    try:
        shutil.rmtree(tmp_path / "ssd")  # the SSD folder went (or its file system failed) under the worker
        with kvstrata.connect(worker.address, timeout=5) as kv:
            for i in range(3):
                kv.set(f"wb/{i}", b"x" * 10000, write_mode="write_back")
    finally:
        lost = worker.stop()
    assert lost == 3 and worker.unflushed == 3
    assert worker.stop() == 3  # (idempotent)
    with Worker(_config(tmp_path, socket=str(tmp_path / "ok.sock"))).start() as clean:
        pass
    assert clean.unflushed == 0


def test_kvstrata_worker_exits_non_zero_when_write_back_data_is_lost(tmp_path):
    """Item 4: `kvstrata worker` exited 0 after losing acknowledged write-back data."""
    proc, sock = _start_cli_worker(tmp_path, "--disk-dir", str(tmp_path / "ssd"), "--disk-size", "64MiB")
    try:
        shutil.rmtree(tmp_path / "ssd")
        with kvstrata.connect(str(sock), timeout=5) as kv:
            kv.set("wb", b"x" * 10000, write_mode="write_back")
    finally:
        rc, out = _stop(proc)
    from kvstrata.cli.worker import EXIT_WRITE_BACK_LOST

    assert rc == EXIT_WRITE_BACK_LOST == 3, out
    assert "1 write-back objects could not be written to SSD and are lost" in out


# 10. SIGHUP ----------------------------------------------------------------------------------------------------------
def test_sighup_shuts_the_worker_down_cleanly(tmp_path):
    """Item 10: SIGHUP killed the worker at once: no flush (write-back data lost), its socket left behind."""
    proc, sock = _start_cli_worker(tmp_path, "--disk-dir", str(tmp_path / "ssd"), "--disk-size", "64MiB")
    try:
        with kvstrata.connect(str(sock), timeout=5) as kv:
            for i in range(5):
                kv.set(f"wb/{i}", bytes([i]) * 100000, write_mode="write_back")
    finally:
        rc, out = _stop(proc, signal.SIGHUP)
    assert rc == 0, out
    assert "received SIGHUP: shutting down" in out and "write-back data flushed" in out
    assert not sock.exists()
    assert len(list((tmp_path / "ssd").glob("*.kvs"))) == 5


# 5, 14. `kvstrata status --prometheus`: no torch, and not a client --------------------------------------------------
def test_status_prometheus_loads_no_torch_and_is_no_client(tmp_path):
    """Item 5: the command imported torch (server.metrics -> store.config -> the store package -> the engine).
    Item 14: it counted itself: kvstrata_clients 1 with no client connected (its human summary still lists it,
    "this one included")."""
    code = (
        "import sys\n"
        "from kvstrata.cli.main import main\n"
        "rc = main(['status', '--prometheus', '--address', sys.argv[1]])\n"
        "print('TORCH', 'torch' in sys.modules, 'RC', rc)\n"
    )
    with Worker(_config(tmp_path)).start() as worker:
        done = subprocess.run(
            [sys.executable, "-c", code, worker.address], env=_env(), capture_output=True, text=True, timeout=60
        )
        assert "TORCH False RC 0" in done.stdout, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert "kvstrata_clients 0" in lines and "kvstrata_hits_total 0" in lines
        with kvstrata.connect(worker.address, timeout=5):
            # a real client counts (the probe's own connection, closed, may be listed a moment longer: wait for it)
            assert wait_until(lambda: worker.stats()["clients"] == 1), worker.stats()["clients"]
            done = subprocess.run(
                [sys.executable, "-c", code, worker.address], env=_env(), capture_output=True, text=True, timeout=60
            )
            assert "kvstrata_clients 1" in done.stdout.splitlines()  # that one, not the command


def test_a_client_is_counted_as_soon_as_its_connect_returned(tmp_path, monkeypatch):
    """The welcome went before the session was listed (by the thread that then serves it): under load, a client whose
    connect() had returned was missing from stats and status for a moment (the test above failed that way)."""
    serve = Worker._serve

    def late_serve(self, conn):  # the serving thread comes late, as on a loaded machine
        time.sleep(0.3)
        serve(self, conn)

    monkeypatch.setattr(Worker, "_serve", late_serve)
    with Worker(_config(tmp_path)).start() as worker:
        with kvstrata.connect(worker.address, timeout=5) as kv:
            assert worker.stats()["clients"] == 1
            kv.set("k", b"v")
        deadline = time.monotonic() + 10
        while worker.stats()["clients"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.stats()["clients"] == 0


# 15. status's own arguments ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["--timeout", "nan"], "--timeout: seconds to wait for the worker, a number > 0, got nan"),
        (["--timeout", "0"], "--timeout: seconds to wait for the worker, a number > 0, got 0.0"),
        (["--timeout", "inf"], "--timeout"),
        (["--address", ""], "address: empty"),
    ],
)
def test_status_refuses_bad_arguments_at_once(args, says, capsys):
    """Item 15: --timeout nan ended in a traceback, --timeout 0 said "no worker reachable", --address '' waited for
    a worker in the current folder."""
    t0 = time.monotonic()
    assert main(["status", *args]) == 2
    assert says in capsys.readouterr().err
    assert time.monotonic() - t0 < 1


# 11. the memory tier against the machine's memory --------------------------------------------------------------------
def test_a_memory_tier_over_the_cgroup_limit_or_ram_is_warned_about(tmp_path, monkeypatch, caplog):
    """Item 11: nothing said that --memory was more than the container could have (the SSD tier's size was)."""
    monkeypatch.setattr(C, "cgroup_memory_limit", lambda: 8 << 20)
    with caplog.at_level(logging.WARNING, logger="kvstrata.worker"), Worker(_config(tmp_path)).start():
        pass
    said = [r.getMessage() for r in caplog.records if "memory tier of" in r.getMessage()]
    assert len(said) == 1 and "cgroup memory limit is 8.0 MiB" in said[0] and "--memory" in said[0]
    caplog.clear()
    monkeypatch.setattr(C, "cgroup_memory_limit", lambda: None)
    monkeypatch.setattr(C, "physical_memory_bytes", lambda: 4 << 20)
    with caplog.at_level(logging.WARNING, logger="kvstrata.worker"), Worker(_config(tmp_path)).start():
        pass
    assert any("physical RAM is 4.0 MiB" in r.getMessage() for r in caplog.records)


# 9. the metrics endpoint over IPv6 -----------------------------------------------------------------------------------
def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_metrics_over_ipv6(tmp_path):
    """Item 9: --metrics-address '[::1]:0' could not bind (an AF_INET server was given an IPv6 host)."""
    import urllib.request

    with Worker(_config(tmp_path, metrics_address="[::1]:0")).start() as worker:
        url = worker.metrics_server.url
        assert url.startswith("http://[::1]:")
        assert "kvstrata_clients 0" in urllib.request.urlopen(url, timeout=5).read().decode().splitlines()
