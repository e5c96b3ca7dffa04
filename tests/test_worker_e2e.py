"""End to end: a real ``kvstrata worker`` process, client processes, kills and restarts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvstrata
from kvstrata.errors import ConnectionLost, KeyNotFound, ServerError

sys.path.insert(0, str(Path(__file__).parent))
import _e2e_jobs as jobs
from _stages import stages_of
from kv_helpers import wait_until

SRC = str(Path(kvstrata.__file__).resolve().parents[1])


def start_worker(tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    sock = tmp / "w.sock"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", "48MiB"]
    cmd += [
        "--numa-node",
        "none",
        "--segment-size",
        "16MiB",
        "--disk-dir",
        str(tmp / "disk"),
        "--disk-size",
        "256MiB",
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"unix://{sock}"
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"worker did not start: {proc.communicate()[0]}")
        time.sleep(0.02)
    return proc, address


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> str:
    if proc.poll() is None:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    return out


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    proc, address = start_worker(tmp_path_factory.mktemp("e2e"), "--log-level", "info")
    yield address
    log = stop(proc)
    assert proc.returncode == 0, log


def test_many_client_processes_read_and_write(worker):
    n_proc, n_keys = 4, 10
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(n_proc) as pool:
        checked = pool.starmap(jobs.writer_reader, [(worker, me, n_proc, n_keys) for me in range(n_proc)])
    assert checked == [n_proc * n_keys] * n_proc
    with kvstrata.connect(worker) as kv:
        assert kv.stats()["leases"] == 0
        kv.delete([f"p{p}/{i}" for p in range(n_proc) for i in range(n_keys)])


def test_the_worker_found_by_a_bare_socket_path_in_the_environment(worker, monkeypatch):
    path = worker.split("://", 1)[1]
    monkeypatch.setenv("KVSTRATA_WORKER", path)  # a path, as --socket takes it: no unix:// in front
    with kvstrata.connect() as kv:
        kv.set("env-path", b"x")
        assert kv.get("env-path") == b"x"
        kv.delete(["env-path"])


def test_client_killed_mid_write_leaves_nothing_behind(worker, tmp_path):
    ready = tmp_path / "ready"
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=jobs.die_mid_write, args=(worker, str(ready)))
    child.start()
    with kvstrata.connect(worker) as kv:
        assert wait_until(ready.exists, 30), "victim never got ready"
        assert not kv.exists("victim")
        stats = kv.stats()
        assert stats["leases"] >= 1 and stats["creates_in_progress"] >= 1 and stats["clients"] == 2
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert wait_until(lambda: kv.stats()["clients"] == 1, 10), "worker did not notice the dead client"
        stats = kv.stats()
        assert stats["leases"] == 0 and stats["creates_in_progress"] == 0
        assert not kv.exists("victim")
        with pytest.raises(KeyNotFound):
            kv.get("victim")
        kv.set("victim", b"clean", nx=True)  # nothing of the dead write stands in the way
        assert kv.get("victim") == b"clean"
        kv.delete(["victim", "held"])


def test_waits_really_wait_across_processes(worker):
    with kvstrata.connect(worker) as waiter, kvstrata.connect(worker) as writer:
        t0 = time.monotonic()
        with pytest.raises(kvstrata.Timeout):
            waiter.get("slow-key", timeout=0.4)
        assert time.monotonic() - t0 >= 0.38
        import threading

        threading.Timer(0.3, lambda: writer.set("slow-key", b"v" * 100_000)).start()
        t0 = time.monotonic()
        assert waiter.get("slow-key", timeout=10) == b"v" * 100_000
        assert 0.25 < time.monotonic() - t0 < 5
        writer.delete("slow-key")


def test_bad_peers_do_not_hurt_others(worker):
    path = worker.removeprefix("unix://")
    with kvstrata.connect(worker) as good:
        good.set("steady", b"ok")
        for junk in (b"\x00" * 3, b"GET / HTTP/1.1\r\n\r\n", b"\xff\xff\xff\xff\x00\x00\x00\x00"):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(junk)
            s.close()
        from kvstrata.transport import connect as raw_connect

        with raw_connect(worker, timeout=5) as raw:
            raw.send({"op": "put", "key": "x", "v": "not bytes"})
            assert raw.recv(timeout=5)[0]["err"][0] == "InvalidType"
            raw.send({"op": ["not", "a", "name"]})
            assert raw.recv(timeout=5)[0]["err"][0] == "ServerError"
            raw.send({"op": "mget", "keys": "x" * 5000})
            assert raw.recv(timeout=5)[0]["err"][0] == "InvalidValue"
        with pytest.raises(ServerError):
            good._backend.request({"op": "nonsense"})
        assert good.get("steady") == b"ok"
        assert wait_until(lambda: good.stats()["clients"] == 1, 10)


def test_status_command(worker):
    env = {**os.environ, "PYTHONPATH": SRC}
    base = [sys.executable, "-m", "kvstrata.cli.main", "status", "--address", worker]
    out = subprocess.run(base, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "memory" in out.stdout and "hits" in out.stdout and "clients" in out.stdout
    assert "client pid " in out.stdout and "(kvstrata status): connected" in out.stdout  # each client, by name
    assert "device objects" not in out.stdout  # no device-object client yet
    # The command neither maps the worker's memory nor imports the client SDK (torch): it answers at once.
    code = f"import sys; from kvstrata.cli.main import main; rc = main(['status', '--address', {worker!r}]); "
    code += "print(rc, sorted(m for m in ('torch', 'numpy', 'kvstrata.client') if m in sys.modules))"
    lean = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert lean.stdout.splitlines()[-1] == "0 []", lean.stdout + lean.stderr
    # A device-object hand-off between two CPU clients of this process: the broker's counts show up.
    import torch

    from kvstrata.devobj import DeviceObjectConfig

    cfg = DeviceObjectConfig(allow_cpu=True)
    with kvstrata.connect(worker) as a, kvstrata.connect(worker) as b:
        a.device_objects(device="cpu", config=cfg)
        b.device_objects(device="cpu", config=cfg)
        dst = torch.zeros(8)
        (f,) = b.dev_subscribe(["h"], [[dst]], timeout=30)
        a.dev_publish(["h"], [[torch.ones(8)]])[0].result(30)
        f.result(30)
        assert b.stats()["device_objects"]["received"] == 1
    out = subprocess.run(base, env=env, capture_output=True, text=True, timeout=30)
    assert "device objects 0 (0 receives waiting, 0 copies in flight)   published 1   received 1" in out.stdout
    prom = subprocess.run([*base, "--prometheus"], env=env, capture_output=True, text=True, timeout=30)
    assert prom.returncode == 0
    assert 'kvstrata_tier_capacity_bytes{tier="memory"} 50331648' in prom.stdout
    assert "# TYPE kvstrata_hits_total counter" in prom.stdout
    assert "kvstrata_device_objects_received_total 1" in prom.stdout.splitlines()
    assert "# TYPE kvstrata_device_objects_waiters gauge" in prom.stdout
    missing = subprocess.run(
        [*base[:-1], worker + ".nope", "--timeout", "0.2"], env=env, capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 1 and "no worker" in missing.stderr


def test_stats_name_each_client_and_what_it_holds(worker):
    with kvstrata.connect(worker, name="holder") as holder, kvstrata.connect(worker) as other:
        other.set("held", os.urandom(1 << 20))
        (view,) = holder.get_buffers(["held"])
        buf = holder.create("being-written", 4096)

        def mine(stats):
            return [c for c in stats["client_list"] if c["name"].endswith("(holder)")]

        (me,) = mine(other.stats())
        assert me["pid"] == os.getpid() and me["leases"] >= 1 and me["open_writes"] == 1
        buf.seal()
        view.release()
        assert wait_until(lambda: mine(other.stats())[0]["open_writes"] == 0, 10)
        assert len(other.stats()["client_list"]) == other.stats()["clients"]


def test_device_object_clients_in_status_and_log_and_a_frozen_worker(tmp_path):
    from kvstrata.devobj import DeviceObjectConfig

    proc, address = start_worker(tmp_path)
    child = None
    try:
        kv = kvstrata.connect(address)
        kv.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True))
        stats = kv.stats()  # one process: one client (its device-object link's two connections apart)
        assert stats["clients"] == 1 and stats["device_object_connections"] == 2
        code = (
            "import sys, time, torch, kvstrata; from kvstrata.devobj import DeviceObjectConfig\n"
            f"kv = kvstrata.connect({address!r})\n"
            "kv.device_objects(device='cpu', config=DeviceObjectConfig(allow_cpu=True))\n"
            "kv.dev_mset(['owned'], [[torch.ones(4)]]); print('ready', flush=True); time.sleep(60)\n"
        )
        env = {**os.environ, "PYTHONPATH": SRC}
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        child.kill()  # its key vanishes; the worker's log says so
        child.wait(30)
        assert wait_until(lambda: kv.stats()["device_objects"]["objects"] == 0, 10)
        proc.send_signal(signal.SIGSTOP)  # a frozen worker: close() gives up on its goodbye instead of hanging
        try:
            t0 = time.monotonic()
            kv.close()
            took = time.monotonic() - t0
        finally:
            proc.send_signal(signal.SIGCONT)
        assert took < 8, took
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        out = stop(proc)
    assert "1 device-object key vanished" in out, out


def test_worker_serves_prometheus_metrics_over_http(tmp_path):
    import socket
    import urllib.error
    import urllib.request

    with socket.socket() as s:  # a port free now (the worker binds it just after)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, address = start_worker(tmp_path, "--metrics-address", f"127.0.0.1:{port}")
    try:
        with kvstrata.connect(address) as kv:
            kv.set("k", b"v")
            assert kv.get("k") == b"v"
            with pytest.raises(kvstrata.KeyNotFound):
                kv.get("gone")
            url = f"http://127.0.0.1:{port}/metrics"
            reply = urllib.request.urlopen(url, timeout=10)
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            lines = reply.read().decode().splitlines()
            assert "kvstrata_objects 1" in lines and "kvstrata_misses_total 1" in lines
            assert "kvstrata_clients 1" in lines and "# TYPE kvstrata_hits_total counter" in lines
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
            assert kv.get("k") == b"v"  # scrapes leave the clients' service alone
    finally:
        out = stop(proc)
    assert f"Prometheus metrics at http://127.0.0.1:{port}/metrics" in out
    # A port that is taken: the worker says which setting and exits, it does not run half set up.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        sock = tmp_path / "again.sock"
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstrata.cli.main",
                "worker",
                "--socket",
                str(sock),
                "--memory",
                "16MiB",
                "--disk-dir",
                "",
                "--metrics-address",
                f"127.0.0.1:{taken}",
            ],
            env={**os.environ, "PYTHONPATH": SRC},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert bad.returncode == 1 and "metrics_address" in bad.stderr, bad.stderr
    assert not sock.exists()


def test_worker_killed_keeps_write_through_and_sigterm_flushes_write_back(tmp_path):
    proc, address = start_worker(tmp_path)
    big = os.urandom(3 << 20)
    kv = kvstrata.connect(address)
    kv.set("wt-small", b"durable", write_mode="write_through")
    kv.set("wt-big", big, write_mode="write_through")
    kv.set("mem-only", b"volatile")
    stop(proc, signal.SIGKILL)
    with pytest.raises(ConnectionLost):
        kv.get("wt-small")
    with pytest.raises(ConnectionLost):
        kv.get("wt-small")
    kv.close()

    proc, address = start_worker(tmp_path)
    with kvstrata.connect(address) as kv:
        assert kv.get("wt-small") == b"durable"
        assert kv.get("wt-big") == big
        assert kv.exists("mem-only") is False
        kv.set("wb", b"written back", write_mode="write_back")
    log = stop(proc, signal.SIGTERM)
    assert proc.returncode == 0 and "shutting down" in log, log

    proc, address = start_worker(tmp_path)
    with kvstrata.connect(address) as kv:
        assert kv.get("wb") == b"written back"
    stop(proc)


def test_worker_killed_in_a_pipelined_device_call_raises_connection_lost(tmp_path, monkeypatch):
    """A worker that dies while requests are in flight (pipelined stages): the call raises ConnectionLost,
    nothing hangs, and the client keeps saying so."""
    import torch

    from kvstrata.client import device

    monkeypatch.setattr(device, "stages", stages_of(2))  # a GPU call's stages, without a GPU
    proc, address = start_worker(tmp_path)
    kv = kvstrata.connect(address, reserve_bytes=0)  # every call creates (a reserved one asks nothing first)
    src = [[torch.arange(100, dtype=torch.int32) + i] for i in range(6)]
    assert kv.mset_d2h([f"pipe/{i}" for i in range(6)], src) == [None] * 6
    real = kv._backend.mcreate_finish

    def finish_after_death(token):
        stop(proc, signal.SIGKILL)  # two creates in flight, the worker gone
        return real(token)

    monkeypatch.setattr(kv._backend, "mcreate_finish", finish_after_death)
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost):
        kv.mset_d2h([f"late/{i}" for i in range(6)], src)
    with pytest.raises(ConnectionLost):
        kv.mget_h2d([f"pipe/{i}" for i in range(6)], [[torch.empty(100, dtype=torch.int32)] for _ in range(6)])
    assert time.monotonic() - t0 < 30
    kv.close()


@pytest.mark.parametrize("mode", ["memory", "write_back"])
def test_churn_under_memory_pressure_never_shows_a_torn_stale_or_foreign_value(tmp_path, mode):
    """Two processes overwrite, batch-write, device-write and delete 100 shared keys of up to 1 MiB in 16 MiB of
    memory (so values are evicted, spilled and promoted all the time) while two others read them every way; each
    value read is whole and its key's, and the worker ends with no lease left."""
    proc, address = start_worker(tmp_path, "--memory", "16MiB")
    try:
        keys = [f"churn/{i}" for i in range(100)]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4) as pool:
            # every job goes on until all have done their share (jobs.ChurnEnd), however late each one starts
            w_flags = [str(tmp_path / f"writer-{w}.done") for w in range(2)]
            r_flags = [str(tmp_path / f"reader-{r}.done") for r in range(2)]
            flags = w_flags + r_flags
            writers = [
                pool.apply_async(jobs.churn_writer, (address, w, keys, 3.0, mode, flags, w_flags[w])) for w in range(2)
            ]
            readers = [
                pool.apply_async(jobs.churn_reader, (address, r, keys, 3.0, flags, r_flags[r])) for r in range(2)
            ]
            made = [w.get(90) for w in writers]
            reads = [r.get(90) for r in readers]
        for checked, bad in reads:
            assert not bad, bad
            assert all(n > 0 for n in checked.values()), checked  # every way of reading was exercised
        assert min(made) >= jobs.CHURN_MIN_WRITES, made
        with kvstrata.connect(address) as kv:
            stats = kv.stats()
            assert stats["evictions"] + stats["spills"] > 0, stats  # the pressure was real
            assert wait_until(lambda: kv.stats()["leases"] == 0, 10)
            for key in keys:  # what is left is whole too (one at a time: 100 values of 1 MiB exceed the memory)
                if kv.exists(key):
                    assert jobs.churn_check(key, kv.get(key)) is None
    finally:
        log = stop(proc)
    assert proc.returncode == 0, log
