"""``kvstrata bench store``: kvstrata's node-local clients beside Redis and Mooncake Store, same run.

All servers run as local processes: a ``kvstrata worker`` on a Unix socket, Debian's
``redis-server`` on 127.0.0.1 (persistence off), driven by redis-py with hiredis, and Mooncake Store
(``mooncake_master`` with its HTTP metadata server plus a ``mooncake_client`` holding the memory, TCP)
inside a loopback-only network namespace of its own (see ``kvstrata.bench.mooncake``; needs
``pip install mooncake-transfer-engine-non-cuda``, Debian ``libibverbs1`` and ``iproute2``, and root).
For each value size and number of client processes, every client process sets (then gets) values in
a loop; the table shows aggregate ops/s and GB/s and the single-client median latency. kvstrata's
gets appear twice: ``get`` (a copy into bytes, like Redis) and ``get_buffers`` (a zero-copy leased
view, timed until the view is in hand; its release, a one-way message, follows untimed). Mooncake's
``set`` is ``upsert`` (its ``put`` leaves an existing key unchanged), ``get`` is ``get`` (bytes) and
its ``get_buffers`` row is ``get_buffer`` (a handle on the value copied into the client's buffer).
With CUDA, ``mget_h2d`` / ``mset_d2h`` of 64 keys x 1 MiB are measured against the pinned-memory
DMA ceiling (one 64 MiB ``copy_``) in the same run, and beside the same copy from the worker's
shared segment (see ``_device_rows``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstrata.bench._common import gbps, print_table, write_result

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
KEYS_PER_CLIENT = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB", help="value sizes (default 4KiB,1MiB,16MiB)")
    parser.add_argument("--clients", default="1,8", help="client process counts (default 1,8)")
    parser.add_argument("--seconds", type=float, default=1.0, help="target seconds per measurement (default 1)")
    parser.add_argument("--no-redis", action="store_true", help="skip Redis")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store")


def _ops_for(size: int, seconds: float) -> int:
    per_op = {4 << 10: 60e-6, 1 << 20: 600e-6, 16 << 20: 8e-3}.get(size, size / 2e9 + 50e-6)
    return max(8, int(seconds / per_op))


# ------------------------------------------------------------------------------------- client jobs
def _job(system: str, address: str, op: str, me: int, size: int, n: int, ready: Any) -> list[float]:
    """One client process: n ops of ``op`` on its own keys, started once every client of the row is connected
    and warmed up (``ready``: a barrier of them all); returns per-op seconds."""
    value = os.urandom(size)
    keys = [f"bench/{me}/{i}" for i in range(KEYS_PER_CLIENT)]
    if system == "redis":
        import redis

        host, port = address.rsplit(":", 1)
        r = redis.Redis(host=host, port=int(port))
        do = {"set": lambda k: r.set(k, value), "get": lambda k: r.get(k)}[op]
        close = r.close
    else:
        import kvstrata

        kv = kvstrata.connect(address, timeout=30)

        def zero_copy(k: str) -> Any:
            buf = kv.get_buffers([k])[0]
            buf.memoryview()
            return buf.release  # timed: until the view is in hand; the release happens after

        do = {"set": lambda k: kv.set(k, value), "get": kv.get, "get_buffers": zero_copy}[op]
        close = kv.close
    if op != "set":
        for k in keys:
            (r.set(k, value) if system == "redis" else kv.set(k, value))
    for k in keys:  # warm-up
        after = do(k)
        if callable(after):
            after()
    # A fresh pool process imports kvstrata (and torch) first, for longer than a row takes: without the barrier,
    # a row's clients could run one after another and report each one's solo rate as concurrent.
    ready.wait(120)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        after = do(keys[i % KEYS_PER_CLIENT])
        times.append(time.perf_counter() - t0)
        if callable(after):
            after()
    close()
    return times


def _measure(
    pool: Any, manager: Any, system: str, address: str, op: str, size: int, clients: int, n: int
) -> dict[str, Any]:
    ready = manager.Barrier(clients)  # every client starts its loop at the same moment
    results = pool.starmap(_job, [(system, address, op, me, size, n, ready) for me in range(clients)])
    return _row(system, op, size, clients, results)


def _row(system: str, op: str, size: int, clients: int, results: list[list[float]]) -> dict[str, Any]:
    """Aggregate throughput of ``clients`` processes' per-op seconds, and their median latency."""
    n = len(results[0])
    walls = [sum(t) for t in results]
    total_ops = clients * n
    wall = max(walls)
    return {
        "system": system,
        "op": op,
        "size": size,
        "clients": clients,
        "ops_per_s": round(total_ops / wall),
        "GB/s": gbps(total_ops * size, wall),
        "p50_us": round(statistics.median([x for t in results for x in t]) * 1e6, 1),
    }


# ------------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(tmp: Path) -> tuple[subprocess.Popen, str, str] | None:
    """redis-server on a free local port: (process, address, versions), or None (reason printed)."""
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis-server not found (apt-get install redis-server): Redis rows skipped")
        return None
    try:
        import hiredis  # noqa: F401
        import redis
    except ImportError as exc:
        print(f"redis-py/hiredis missing ({exc}; pip install redis hiredis): Redis rows skipped")
        return None
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            versions = f"redis-server {r.info('server')['redis_version']}, redis-py {redis.__version__}"
            r.close()
            return proc, f"127.0.0.1:{port}", versions
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    print("redis-server did not come up: Redis rows skipped")
    return None


def _start_worker(tmp: Path, memory: int) -> tuple[subprocess.Popen, str]:
    sock = tmp / "kvstrata.sock"
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", str(memory)]
    cmd += ["--disk-dir", "", "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    import kvstrata

    kvstrata.connect(f"unix://{sock}", timeout=60).close()  # waits (with retries) until it listens
    return proc, f"unix://{sock}"


# ------------------------------------------------------------------------------------- device rows
IN_FLIGHT = 4  # async calls in flight for the streamed device rows
READ_ROUNDS = 40  # timed rounds of the four mget_h2d rows and the mset_d2h row (after 3 untimed)
CEILING_ITERS = 30  # timed copies per ceiling measurement (two measurements: before the rows and after)


def _device_rows(address: str) -> list[dict[str, Any]]:
    """``mget_h2d`` / ``mset_d2h`` of 64 x 1 MiB beside two DMA ceilings measured here: one pinned
    ``copy_`` of 64 MiB (``ceiling``) and the same copy from the worker's shared segment as this client
    registered it (``seg_ceiling``: what DMA from that memory allows). ``mget_h2d`` four ways and ``mset_d2h`` of
    fresh keys, in turn round by round: keys read before and unchanged since (leases kept by the client: no round
    trip), the same with another key written before each call (still no round trip: see
    kvstrata.server.validity), right after the keys themselves were rewritten, and right after another client
    rewrote them (both cold: the worker's placement table lets the copies start before the leases come back:
    kvstrata.store.placements)."""
    import torch

    import kvstrata
    from kvstrata.bench._common import device_time, python_loop_us
    from kvstrata.client import batching
    from kvstrata.ops import tensor_runs

    # The copy planner's native module: built (first use on a machine) or loaded before the timing, not during it.
    # "copies": its passes queue their own copies; "lists": cuda-bindings queues the runs they answer; False: none.
    native: str | bool = False
    if tensor_runs.native(wait=True) is not None:
        native = "copies" if batching.NATIVE_COPIES and tensor_runs.batch_entry() is not None else "lists"
    n, size = 64, 1 << 20
    host = torch.empty(n * size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n * size, dtype=torch.uint8, device="cuda")

    def ceilings() -> list[float]:
        """Seconds of one 64 MiB copy H2D and D2H, then of the same streamed: IN_FLIGHT back-to-back copies per
        sample, what an engine issuing transfers continuously sees (the async calls below are timed the same way:
        one call's host work overlaps another's DMA)."""
        h2d, d2h = (lambda: dev.copy_(host, non_blocking=True)), (lambda: host.copy_(dev, non_blocking=True))
        return [
            device_time(h2d, iters=CEILING_ITERS),
            device_time(d2h, iters=CEILING_ITERS),
            device_time(h2d, iters=CEILING_ITERS, calls=IN_FLIGHT),
            device_time(d2h, iters=CEILING_ITERS, calls=IN_FLIGHT),
        ]

    # Measured before the rows and again after them; the faster of the two is the ceiling (the stricter one). One
    # measurement before the rows once read 45 GB/s against the usual 54-55 (session 27), which put a row at 1.13
    # of it.
    first_ceilings = ceilings()
    seg_h2d = seg_d2h = None
    with kvstrata.connect(address) as kv:
        src = [[torch.randn(size // 4, device="cuda")] for _ in range(n)]
        keys = [f"h2d/{i}" for i in range(n)]
        assert kv.mset_d2h(keys, src) == [None] * n
        dst = [[torch.empty_like(t[0])] for t in src]
        # The four reads and the write in turn, round by round, so each sees the same host state (the GPU host's
        # Python speed drifts within a run, and a call right after a spell of heavy calls runs slower: measured one
        # row after the other, a row could read 0.05-0.15 of the ceiling off another).
        cases = ("kept", "other key", "own rewrite", "written", "write")
        times: dict[str, list[float]] = {c: [] for c in cases}
        loops: list[float] = []  # the host's speed round by round (python_loop_us)
        with kvstrata.connect(address) as writer:  # another process's objects: a decode engine reading prefill's
            kv.mget_h2d(keys, dst)
            for it in range(READ_ROUNDS + 3):
                for case in cases:
                    if case == "other key":
                        kv.set(f"h2d/other/{it}", b"x")  # writes to other keys leave the kept leases good
                    elif case == "own rewrite":
                        # the host's speed this round, measured where requests still come between it and the next
                        # timed call (as before every timed call)
                        loops.append(python_loop_us())
                        kv.delete(keys)  # rewritten: the kept leases are stale, this read leases through the worker
                        assert kv.mset_d2h(keys, src) == [None] * n
                    elif case == "written":
                        writer.delete(keys)
                        assert writer.mset_d2h(keys, src) == [None] * n
                        # the writer's next request: its objects are visible to all by its answer
                        writer.exists(keys[:1])
                    if case == "write":  # write-once keys: fresh ones every time, deleted outside the timing
                        ks = [f"d2h/{it}/{i}" for i in range(n)]
                        t0 = time.perf_counter()
                        assert kv.mset_d2h(ks, src) == [None] * n
                        times[case].append(time.perf_counter() - t0)
                        kv.delete(ks)
                        continue
                    t0 = time.perf_counter()
                    kv.mget_h2d(keys, dst)
                    times[case].append(time.perf_counter() - t0)
                    if it == 0:
                        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst)), case
        kv.delete([f"h2d/other/{it}" for it in range(READ_ROUNDS + 3)])
        t_get, t_get_other, t_get_rt, t_get_written, t_put = (statistics.median(times[c][3:]) for c in cases)
        try:
            t_get_async, t_put_async = _streamed(kv, keys, src, n)
        except Exception as exc:  # reported in the table, the other rows stand
            print(f"streamed device rows failed: {exc!r}")
            t_get_async = t_put_async = float("nan")
        seg_h2d, seg_d2h = _segment_ceilings(kv, keys[0], n * size, dev)
        kv.delete(keys)
    last_ceilings = ceilings()
    h2d_ceiling, d2h_ceiling, h2d_streamed, d2h_streamed = map(min, first_ceilings, last_ceilings)
    spread = [[gbps(n * size, a), gbps(n * size, b)] for a, b in zip(first_ceilings, last_ceilings)]
    rows = []
    for op, t, ceiling, both_ways, seg in (
        ("mget_h2d 64x1MiB", t_get, h2d_ceiling, spread[0], seg_h2d),
        ("mget_h2d 64x1MiB, another key written before each", t_get_other, h2d_ceiling, spread[0], seg_h2d),
        ("mget_h2d 64x1MiB right after its keys were rewritten", t_get_rt, h2d_ceiling, spread[0], seg_h2d),
        ("mget_h2d 64x1MiB of keys another client just wrote", t_get_written, h2d_ceiling, spread[0], seg_h2d),
        ("mset_d2h 64x1MiB", t_put, d2h_ceiling, spread[1], seg_d2h),
        (f"async_mget_h2d 64x1MiB, {IN_FLIGHT} in flight", t_get_async, h2d_streamed, spread[2], None),
        (f"async_mset_d2h 64x1MiB, {IN_FLIGHT} in flight", t_put_async, d2h_streamed, spread[3], None),
    ):
        rows.append(
            {
                "system": "kvstrata",
                "op": op,
                "size": n * size,
                "clients": 1,
                "GB/s": gbps(n * size, t),
                "ceiling_GB/s": gbps(n * size, ceiling),
                "ceiling_before_after_GB/s": both_ways,  # the ceiling is the faster
                "of_ceiling": round(ceiling / t, 3),
                "seg_ceiling_GB/s": None if seg is None else gbps(n * size, seg),
                # this process's CPU speed over the timed rounds (the same rounds for every row)
                "host_loop_us": round(statistics.median(loops[3:]), 1),
                "native_planner": native,  # how kvstrata.ops.tensor_runs planned the calls (False: in Python)
            }
        )
    return rows


def _streamed(kv: Any, keys: list[str], src: list[list[Any]], n: int) -> tuple[float, float]:
    """Seconds per call of ``async_mget_h2d`` / ``async_mset_d2h`` with IN_FLIGHT calls issued back to back."""
    import torch

    dsts = [[[torch.empty_like(t[0])] for t in src] for _ in range(IN_FLIGHT)]
    times = []
    for _ in range(13):
        t0 = time.perf_counter()
        futs = [kv.async_mget_h2d(keys, d) for d in dsts]
        assert all(f.result() == [None] * n for f in futs)
        times.append((time.perf_counter() - t0) / IN_FLIGHT)
    t_get_async = statistics.median(times[3:])
    assert all(torch.equal(a[0], b[0]) for d in dsts for a, b in zip(src, d))
    times = []
    for it in range(13):
        batches = [[f"a2h/{it}/{j}/{i}" for i in range(n)] for j in range(IN_FLIGHT)]
        t0 = time.perf_counter()
        futs = [kv.async_mset_d2h(ks, src) for ks in batches]
        assert all(f.result() == [None] * n for f in futs)
        times.append((time.perf_counter() - t0) / IN_FLIGHT)
        for ks in batches:
            kv.delete(ks)
    t_put_async = statistics.median(times[3:])
    return t_get_async, t_put_async


def _segment_ceilings(kv: Any, key: str, nbytes: int, dev: Any) -> tuple[float | None, float | None]:
    """Seconds of one ``nbytes`` H2D and D2H ``copy_`` between ``dev`` and the worker's segment holding
    ``key`` (registered with CUDA by the client's device calls), or None where the segment is too small.
    The D2H overwrites that stretch of the segment: ``key`` and its neighbours are garbage afterwards."""
    from kvstrata.bench._common import device_time

    backend = kv._backend
    lease = backend.acquire([key], 0.0)[0]
    try:
        loc = lease.location
        seg = backend.segment_tensor(loc.segment)
        start = min(loc.offset, seg.numel() - nbytes)
        if start < 0:
            return None, None
        view = seg[start : start + nbytes]
        return (
            device_time(lambda: dev.copy_(view, non_blocking=True)),
            device_time(lambda: view.copy_(dev, non_blocking=True)),
        )
    finally:
        backend.release([lease.lease_id])


# ------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    sizes = [SIZES[s.strip()] for s in args.sizes.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-"))
    memory = max(client_counts) * KEYS_PER_CLIENT * max(sizes) * 3 + (256 << 20)
    if _cuda():  # one client may keep leases on memory / 16 (the device rows' 64 MiB read without round trips)
        memory = max(memory, 2 << 30)
    worker, kv_address = _start_worker(tmp, memory)
    redis_srv = None
    mooncake = None
    rows: list[dict[str, Any]] = []
    ctx = multiprocessing.get_context("spawn")
    finished = False
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupted)  # SIGTERM tears down like Ctrl-C
    try:
        redis_srv = None if args.no_redis else _start_redis(tmp)
        mooncake = None if args.no_mooncake else _start_mooncake(tmp, memory)
        with ctx.Manager() as manager, ctx.Pool(max(client_counts)) as pool:
            for size in sizes:
                n = _ops_for(size, args.seconds)
                for clients in client_counts:
                    systems = [("kvstrata", kv_address)] + ([("redis", redis_srv[1])] if redis_srv else [])
                    for op in ("set", "get", "get_buffers"):
                        for system, address in systems:
                            if system == "redis" and op == "get_buffers":
                                continue
                            row = _measure(pool, manager, system, address, op, size, clients, n)
                            rows.append(row)
                            print(f"  {system:8} {op:11} {size:>9} B x{clients}: {row['ops_per_s']} ops/s", flush=True)
                        if mooncake:
                            row = _row("mooncake", op, size, clients, mooncake.run_clients(op, size, clients, n))
                            rows.append(row)
                            print(f"  mooncake {op:11} {size:>9} B x{clients}: {row['ops_per_s']} ops/s", flush=True)
        _add_ratios(rows)
        if _cuda():
            rows += _device_rows(kv_address)
        finished = True
    finally:
        try:  # Mooncake first: its namespace must go even if another server hangs on the way down
            if mooncake:
                mooncake.close()
                if finished:  # its logs are kept only when something went wrong
                    shutil.rmtree(mooncake.log_dir, ignore_errors=True)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
            if redis_srv:
                redis_srv[0].terminate()
                redis_srv[0].wait(30)
            shutil.rmtree(tmp, ignore_errors=True)
            signal.signal(signal.SIGTERM, previous_sigterm)
    baselines = {"redis": redis_srv[2] if redis_srv else None, "mooncake": mooncake.version if mooncake else None}
    path = write_result("store", {"rows": rows, "baselines": baselines}, args.out)
    print(f"results: {path}")
    columns = [
        "system",
        "op",
        "size",
        "clients",
        "ops_per_s",
        "GB/s",
        "p50_us",
        "x_redis",
        "x_mooncake",
        "ceiling_GB/s",
        "of_ceiling",
        "seg_ceiling_GB/s",
        "host_loop_us",
        "native_planner",
    ]
    print_table(rows, columns)
    return 0


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _start_mooncake(tmp: Path, memory: int) -> Any:
    """Mooncake Store in its own namespace (a ``kvstrata.bench.mooncake.MooncakeStore``), or None (reason printed)."""
    from kvstrata.bench import mooncake

    reason = mooncake.unavailable()
    if reason:
        print(f"{reason}: Mooncake rows skipped")
        return None
    log_dir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-mooncake-"))  # kept: read it when Mooncake fails
    try:
        store = mooncake.MooncakeStore(segment_size=memory, log_dir=log_dir)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # e.g. no netns support here
        logs = f"; logs: {log_dir}" if any(log_dir.iterdir()) else ""
        if not logs:
            log_dir.rmdir()
        print(f"Mooncake Store did not start ({exc}{logs}): Mooncake rows skipped")
        return None
    print(f"Mooncake Store up in network namespace {store.ns} (logs: {log_dir})")
    return store


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """kvstrata's throughput over Redis's and Mooncake's for the same op (Redis: get_buffers against get)."""
    base = {(r["system"], r["op"], r["size"], r["clients"]): r for r in rows}
    for r in rows:
        if r["system"] != "kvstrata":
            continue
        redis = base.get(("redis", "get" if r["op"] == "get_buffers" else r["op"], r["size"], r["clients"]))
        if redis:
            r["x_redis"] = round(r["ops_per_s"] / redis["ops_per_s"], 2)
        mooncake = base.get(("mooncake", r["op"], r["size"], r["clients"]))
        if mooncake:
            r["x_mooncake"] = round(r["ops_per_s"] / mooncake["ops_per_s"], 2)
