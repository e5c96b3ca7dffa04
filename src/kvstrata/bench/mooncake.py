"""Mooncake Store as a baseline for ``kvstrata bench store``, fenced off in a network namespace.

Mooncake Store runs as its own processes: ``mooncake_master`` (with its HTTP metadata server) and a
``mooncake_client`` "real client" that holds the store's memory; each benchmark client process is a
Mooncake "dummy client" (``MooncakeDistributedStore.setup_dummy``) that talks to the real client over
its RPC port and shared memory, protocol TCP. Mooncake's processes listen on every interface, so all
of them, the benchmark's own Mooncake clients included, run inside a network namespace made for the
run that holds only a loopback interface; it is deleted, with every process in it, when the run ends.

Needs: ``pip install mooncake-transfer-engine-non-cuda`` (the ``bench`` extra), Debian's
``libibverbs1`` (the wheel links it even for TCP), ``ip`` from iproute2, and root (``ip netns add``).
Without any of them the Mooncake rows are skipped with the reason printed.

Run as ``python -m kvstrata.bench.mooncake OP SIZE N ME [KEYS]`` inside the namespace, it is one client
process: it connects, warms up, prints ``ready``, waits for a start time on stdin, runs N ops on KEYS keys
(default 4) round-robin and prints, as JSON, the per-op seconds, the loop's wall seconds and whether the
last value read (after ``set``: read back) was the one written (None after ``get_buffers``: its bytes are
not read).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

KEYS_PER_CLIENT = 4
MASTER_PORT = 50051  # fixed ports are safe: nothing else lives in the run's own namespace
METADATA_PORT = 8080
CLIENT_PORT = 50052
# The transfer engine looks for a LAN address unless told to bind here; the namespace has only lo.
NS_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def unavailable() -> str | None:
    """Why Mooncake rows cannot run here, or None when they can."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None:
        return "mooncake not installed (pip install mooncake-transfer-engine-non-cuda)"
    if _binary("mooncake_master") is None or _binary("mooncake_client") is None:
        return "mooncake_master/mooncake_client not found in the mooncake package"
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs missing (apt-get install libibverbs1)"
    if shutil.which("ip") is None:
        return "'ip' not found (apt-get install iproute2): no network namespace to fence Mooncake in"
    if os.geteuid() != 0:
        return "not root: cannot create the network namespace Mooncake must run in"
    return None


def _binary(name: str) -> str | None:
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return "mooncake (version unknown)"


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or f'exit status {out.returncode}'}")


class MooncakeStore:
    """Master and real client in a fresh loopback-only namespace; ``close()`` removes all of it.

    >>> with MooncakeStore(segment_size=1 << 30, log_dir=Path("/tmp")) as mc:  # doctest: +SKIP
    ...     times = mc.run_clients("set", 4096, clients=1, n=100)
    """

    def __init__(self, segment_size: int, log_dir: Path) -> None:
        self.ns = f"kvstrata-mc-{os.getpid()}"
        self.version = _version()
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []
        _ip("netns", "add", self.ns)
        try:
            _ip("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            self._spawn(
                "master",
                [
                    _binary("mooncake_master"),
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={METADATA_PORT}",
                    f"--rpc_port={MASTER_PORT}",
                    "--logtostderr",
                ],
            )
            self._wait_listening([MASTER_PORT, METADATA_PORT], "mooncake_master")
            self._spawn(
                "client",
                [
                    _binary("mooncake_client"),
                    "--host=127.0.0.1",
                    "--protocol=tcp",
                    f"--port={CLIENT_PORT}",
                    f"--metadata_server=http://127.0.0.1:{METADATA_PORT}/metadata",
                    f"--master_server_address=127.0.0.1:{MASTER_PORT}",
                    f"--global_segment_size={segment_size}",
                    f"--local_buffer_size={64 << 20}",
                    "--logtostderr",
                ],
            )
            self._wait_listening([CLIENT_PORT], "mooncake_client")
        except BaseException:
            self.close()
            raise

    def _exec(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, "env", *(f"{k}={v}" for k, v in NS_ENV.items()), *argv]

    def _spawn(self, name: str, argv: list[Any]) -> None:
        log = open(self.log_dir / f"mooncake_{name}.log", "wb")  # noqa: SIM115 -- closed in close()
        self._logs.append(log)
        self.procs.append(subprocess.Popen(self._exec([str(a) for a in argv]), stdout=log, stderr=log))

    def _wait_listening(self, ports: list[int], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{what} exited early; see its log in {self.log_dir}")
            out = subprocess.run(
                ["ip", "netns", "exec", self.ns, "ss", "-Hltn"], capture_output=True, text=True, timeout=10
            ).stdout
            listening = {line.split()[3].rsplit(":", 1)[-1] for line in out.splitlines() if line.split()}
            if all(str(p) in listening for p in ports):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{what} not listening on {ports} after {timeout:.0f} s")

    def run_clients(
        self, op: str, size: int, clients: int, n: int, timeout: float = 300.0, *, keys: int = KEYS_PER_CLIENT
    ) -> list[dict[str, Any]]:
        """What each of ``clients`` processes, all started at the same moment, measured on ``keys`` keys of its own:
        ``{"times": per-op seconds, "wall": the loop's seconds, "correct": bool or None}``."""
        src = str(Path(__file__).resolve().parents[2])  # so the namespace's python finds kvstrata
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
        argv = [sys.executable, "-m", "kvstrata.bench.mooncake", op, str(size), str(n)]
        procs = []
        deadline = time.monotonic() + timeout
        try:
            for me in range(clients):
                log = open(self.log_dir / f"mooncake_job{me}.log", "ab")  # noqa: SIM115 -- closed below
                self._logs.append(log)
                procs.append(
                    subprocess.Popen(
                        self._exec([*argv, str(me), str(keys)]),
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        env=env,
                    )
                )
            for p in procs:  # connected and warmed up
                line = _readline(p, deadline)
                if line != b"ready\n":
                    raise RuntimeError(f"Mooncake client process not ready ({line!r}); see {self.log_dir}")
            start_at = time.time() + 0.1
            for p in procs:
                p.stdin.write(f"{start_at}\n".encode())
                p.stdin.close()
            results = []
            for p in procs:
                line = _readline(p, deadline)
                p.wait(max(1.0, deadline - time.monotonic()))
                if p.returncode != 0 or not line:
                    raise RuntimeError(f"Mooncake client process failed (rc {p.returncode}); see {self.log_dir}")
                results.append(json.loads(line))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)

    def close(self) -> None:
        """Stop every process in the namespace, then delete it. Safe to call twice."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs = []
        try:  # anything else left in our namespace (it is ours alone) goes too
            pids = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=10).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "delete", self.ns], capture_output=True, timeout=10)
        finally:
            for log in self._logs:
                log.close()
            self._logs = []

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _readline(p: subprocess.Popen, deadline: float) -> bytes:
    """One line of a child's stdout, or RuntimeError at the deadline (the child is killed)."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(max(0.0, deadline - time.monotonic())):
            p.kill()
            raise RuntimeError("Mooncake client process timed out")
    return p.stdout.readline()


# ------------------------------------------------------------------------------------- client process
def _client(op: str, size: int, n: int, me: int, nkeys: int = KEYS_PER_CLIENT) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # Shared-memory pool and local buffer must each hold a value; 64 MiB covers the 16 MiB rows.
    pool = max(64 << 20, 2 * size)
    if store.setup_dummy(pool, pool, f"127.0.0.1:{CLIENT_PORT}") != 0:
        raise RuntimeError("setup_dummy failed")
    value = os.urandom(size)
    keys = [f"bench/{me}/{i}" for i in range(nkeys)]

    def put(k: str) -> None:
        rc = store.upsert(k, value)  # put() leaves an existing key as it is: upsert is Redis's SET
        if rc != 0:
            raise RuntimeError(f"upsert {k}: rc {rc}")

    def get(k: str) -> bytes:
        return store.get(k)

    def get_buffer(k: str) -> None:
        # the handle is dropped (its buffer freed) within the op, as kvstrata's view is released within its op
        if store.get_buffer(k).size() != size:
            raise RuntimeError(f"get_buffer {k}: wrong size")

    do = {"set": put, "get": get, "get_cached": get, "get_buffers": get_buffer}[op]
    for k in keys:
        put(k)
        do(k)
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    while time.time() < start_at:
        time.sleep(0.001)
    times = []
    last = None
    loop_start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        last = do(keys[i % nkeys])
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - loop_start
    if op == "set":
        last = store.get(keys[(n - 1) % nkeys])
    correct = None if op == "get_buffers" else last == value
    for k in keys:  # best effort (a key read within Mooncake's lease time stays): later rows' values need the room
        try:
            store.remove(k)
        except Exception:
            pass
    store.close()
    return {"times": times, "wall": wall, "correct": correct}


if __name__ == "__main__":
    op_, size_, n_, me_ = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    keys_ = int(sys.argv[5]) if len(sys.argv) > 5 else KEYS_PER_CLIENT
    print(json.dumps(_client(op_, size_, n_, me_, keys_)), flush=True)
