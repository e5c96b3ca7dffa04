"""``kvstrata bench store``: kvstrata's node-local clients beside Redis and Mooncake Store, same run.

All servers run as local processes: a ``kvstrata worker`` on a Unix socket, Debian's
``redis-server`` on 127.0.0.1 (persistence off), driven by redis-py with hiredis, and Mooncake Store
(``mooncake_master`` with its HTTP metadata server plus a ``mooncake_client`` holding the memory, TCP)
inside a loopback-only network namespace of its own (see ``kvstrata.bench.mooncake``; needs
``pip install mooncake-transfer-engine-non-cuda``, Debian ``libibverbs1`` and ``iproute2``, and root).
A baseline that cannot run is skipped, its reason printed and recorded (``baselines_skipped``).

For each value size and number of client processes, every client process runs one op in a loop on
keys of its own, round-robin, all clients of a row starting together. A row gives ``ops`` (every
client's timed ops), ``ops_per_s`` (those over the slowest client's loop, wall clock) and GB/s, and
``p50_us``: the median latency of every timed op of every client of the row. The ops, each system on
the same keys:

* ``set``: ``KEYS_PER_CLIENT`` keys per client. Mooncake's is ``upsert`` (its ``put`` leaves an
  existing key unchanged).
* ``get_cached``: a get (a copy into bytes) of those ``KEYS_PER_CLIENT`` keys, for values the worker lets a
  client keep a get's lease of (under ``INLINE_MAX``). kvstrata's client answers every one of them from its
  local-read cache (:mod:`kvstrata.client.local_reads`: shared memory, no round trip to the worker); Redis and
  Mooncake have no such cache.
* ``get``: a get of more keys per client than that cache holds: ``UNCACHED_FACTOR`` times its ``MAX_ENTRIES``
  (fewer where its byte budget, the worker's memory / ``CACHE_SHARE``, binds), round-robin; larger values, which
  the cache never holds, on ``KEYS_PER_CLIENT`` keys. Nearly every kvstrata get asks the worker (the cache keeps
  serving the keys it holds rather than churn: about 1/``UNCACHED_FACTOR`` of the gets).
* ``get_buffers``: kvstrata's zero-copy leased view of one of ``KEYS_PER_CLIENT`` keys (local reads),
  timed from the call to the view's ``release()``. The view's bytes are not read, so the row gives no
  GB/s; nor does Mooncake's row, ``get_buffer`` (a handle on the value copied into the client's buffer,
  freed within the op, its bytes not read). Redis's ratio is to its ``get_cached`` row (the same keys).

kvstrata rows give ``local_reads``: the share of the timed ops its local-read cache answered (measured).
After its timed loop every client checks the last value it read (after sets: reads back the last key
it wrote) against what it wrote; a row where one differs says ``correct: false`` and the run exits 1.
With CUDA, ``mget_h2d`` / ``mset_d2h`` of 64 keys x 1 MiB are measured against the pinned-memory
DMA ceiling (one 64 MiB ``copy_``) in the same run, and beside the same copy from the worker's
shared segment (see ``_device_rows``); one round of their writes is read back and compared.
An interrupted run (Ctrl-C, SIGTERM) stops its servers and writes the rows finished so far with
``"interrupted": true``, exit status 130.
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

from kvstrata.bench._common import gbps, positive, positive_ints, print_table, size_list, write_result
from kvstrata.client.local_reads import MAX_ENTRIES

KEYS_PER_CLIENT = 4
UNCACHED_FACTOR = 32  # the get row's keys: this many times what the local-read cache holds (get_keys)
BASE_MEMORY = 256 << 20  # the worker's memory beyond what the rows' values take


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        type=size_list,
        default="4KiB,1MiB,16MiB",
        help="value sizes, any (e.g. 4K,100KB,1MiB; default 4KiB,1MiB,16MiB)",
    )
    parser.add_argument("--clients", type=positive_ints, default="1,8", help="client process counts (default 1,8)")
    parser.add_argument(
        "--seconds", type=positive(float), default=1.0, help="target seconds per measurement (default 1)"
    )
    parser.add_argument("--no-redis", action="store_true", help="skip Redis")
    parser.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store")


def _ops_for(size: int, seconds: float) -> int:
    per_op = {4 << 10: 60e-6, 1 << 20: 600e-6, 16 << 20: 8e-3}.get(size, size / 2e9 + 50e-6)
    return max(8, int(seconds / per_op))


def cache_bytes(memory: int) -> int:
    """What one client's local-read cache may pin of a worker with ``memory`` (the worker says so at connect)."""
    from kvstrata.server.worker import CACHE_SHARE

    return memory // CACHE_SHARE


def get_cacheable(size: int) -> bool:
    """Whether the worker lets a client keep a ``get``'s lease of a ``size``-byte value for local reads (it does
    for values sent inline: :mod:`kvstrata.server.handlers`); larger gets always ask the worker."""
    from kvstrata.server.protocol import INLINE_MAX

    return size < INLINE_MAX


def get_keys(size: int, memory: int) -> int:
    """Keys per client of the ``get`` row: UNCACHED_FACTOR times what a client's local-read cache holds of
    ``size``-byte values (MAX_ENTRIES, or fewer where its byte budget binds), read round-robin. The cache admits
    a key that missed only over one read more often lately (:meth:`kvstrata.client.local_reads.LocalReads.admits`),
    so it keeps serving the keys it holds: about 1/UNCACHED_FACTOR of the gets (the row's ``local_reads`` says
    how many). A value the cache never holds needs no more than KEYS_PER_CLIENT keys."""
    if not get_cacheable(size):
        return KEYS_PER_CLIENT
    return UNCACHED_FACTOR * max(1, min(MAX_ENTRIES, cache_bytes(memory) // size))


def _row_bytes(size: int, clients: int, memory: int) -> int:
    """The worker memory one size's rows of ``clients`` clients take, with half as much again to spare."""
    return clients * max(KEYS_PER_CLIENT, get_keys(size, memory)) * size * 3 // 2


def worker_memory(sizes: list[int], client_counts: list[int], cuda: bool) -> int:
    """The worker's memory: every row's values with room to spare, beside BASE_MEMORY. (The ``get`` row's keys
    follow the local-read cache's budget, a share of the memory: the size is found by repeating until it holds
    them.)"""
    memory = max(client_counts) * KEYS_PER_CLIENT * max(sizes) * 3 + BASE_MEMORY
    if cuda:  # one client may keep leases on memory / 16 (the device rows' 64 MiB read without round trips)
        memory = max(memory, 2 << 30)
    for _ in range(16):
        need = max(_row_bytes(s, c, memory) for s in sizes for c in client_counts) + BASE_MEMORY
        if need <= memory:
            break
        memory = need
    return memory


def _ops(size: int, memory: int) -> list[tuple[str, int]]:
    """(op, keys per client) of one size's rows, in order (``get_cached`` only where a get can be a local read)."""
    out = [("set", KEYS_PER_CLIENT)]
    if get_cacheable(size):
        out.append(("get_cached", KEYS_PER_CLIENT))
    out += [("get", get_keys(size, memory)), ("get_buffers", KEYS_PER_CLIENT)]
    return out


# ------------------------------------------------------------------------------------- client jobs
def _ignore_sigint() -> None:
    """Pool processes leave Ctrl-C to the parent, which stops them (no traceback from each)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _job(system: str, address: str, op: str, me: int, size: int, n: int, nkeys: int, ready: Any) -> dict[str, Any]:
    """One client process: n ops of ``op`` on ``nkeys`` keys of its own, round-robin, started once every client of
    the row is connected and warmed up (``ready``: a barrier of them all). Returns the per-op seconds, the loop's
    wall seconds, whether the last value read was the one written, and (kvstrata) the local-read cache's hits."""
    value = os.urandom(size)
    keys = [f"bench/{me}/{i}" for i in range(nkeys)]
    local = None
    if system == "redis":
        import redis

        host, port = address.rsplit(":", 1)
        r = redis.Redis(host=host, port=int(port))
        put = lambda k: r.set(k, value)
        do = {"set": put, "get": r.get, "get_cached": r.get}[op]
        read_back = r.get

        def close() -> None:
            r.delete(*keys)
            r.close()

    else:
        import kvstrata

        kv = kvstrata.connect(address, timeout=30)
        local = getattr(kv._backend, "_local", None)  # the local-read cache, whose hits the row reports

        def zero_copy(k: str) -> None:
            buf = kv.get_buffers([k])[0]
            buf.memoryview()
            buf.release()

        def read_back(k: str) -> bytes:
            if op != "get_buffers":
                return kv.get(k)
            buf = kv.get_buffers([k])[0]
            try:
                return bytes(buf.memoryview())
            finally:
                buf.release()

        put = lambda k: kv.set(k, value)
        do = {"set": put, "get": kv.get, "get_cached": kv.get, "get_buffers": zero_copy}[op]

        def close() -> None:
            kv.delete(keys)
            kv.close()

    if op != "set":
        for k in keys:
            put(k)
    for k in keys:  # warm-up
        do(k)
    # A fresh pool process imports kvstrata (and torch) first, for longer than a row takes: without the barrier,
    # a row's clients could run one after another and report each one's solo rate as concurrent.
    ready.wait(120)
    hits = local.hits if local is not None else None
    times = []
    last = None
    loop_start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        last = do(keys[i % nkeys])
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - loop_start
    if hits is not None:
        hits = local.hits - hits
    # a get's last value, else (a set, a view) the last key read back, untimed
    got = last if op in ("get", "get_cached") else read_back(keys[(n - 1) % nkeys])
    correct = got == value
    close()
    return {"times": times, "wall": wall, "correct": correct, "local_hits": hits}


def _measure(
    pool: Any, manager: Any, system: str, address: str, op: str, size: int, clients: int, n: int, nkeys: int
) -> dict[str, Any]:
    ready = manager.Barrier(clients)  # every client starts its loop at the same moment
    results = pool.starmap(_job, [(system, address, op, me, size, n, nkeys, ready) for me in range(clients)])
    return _row(system, op, size, clients, results, nkeys)


def _row(
    system: str, op: str, size: int, clients: int, results: list[dict[str, Any]], keys: int = KEYS_PER_CLIENT
) -> dict[str, Any]:
    """Aggregate throughput of ``clients`` processes' loops (``results``: each one's per-op ``times``, its loop's
    ``wall`` seconds, ``correct``, and ``local_hits`` or None), and the median latency of all their ops."""
    total_ops = sum(len(r["times"]) for r in results)
    wall = max(r["wall"] for r in results)
    row: dict[str, Any] = {
        "system": system,
        "op": op,
        "size": size,
        "clients": clients,
        "keys": keys,
        "ops": total_ops,
        "ops_per_s": round(total_ops / wall),
        # a view's bytes are never read: no bytes moved to give a rate for
        "GB/s": None if op == "get_buffers" else gbps(total_ops * size, wall),
        "p50_us": round(statistics.median([x for r in results for x in r["times"]]) * 1e6, 1),
        "correct": all(r.get("correct") is not False for r in results),
    }
    hits = [r.get("local_hits") for r in results]
    if all(h is not None for h in hits):
        row["local_reads"] = round(sum(hits) / total_ops, 3)
    return row


# ------------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(tmp: Path, skipped: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str] | None:
    """redis-server on a free local port: (process, address, versions), or None (reason printed, and kept in
    ``skipped["redis"]``)."""

    def skip(reason: str) -> None:
        print(f"{reason}: Redis rows skipped")
        if skipped is not None:
            skipped["redis"] = reason

    exe = shutil.which("redis-server")
    if exe is None:
        skip("redis-server not found (apt-get install redis-server)")
        return None
    try:
        import hiredis  # noqa: F401
        import redis
    except ImportError as exc:
        skip(f"redis-py/hiredis missing ({exc}; pip install redis hiredis)")
        return None
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        r = redis.Redis(port=port)
        for _ in range(200):
            try:
                r.ping()
                versions = f"redis-server {r.info('server')['redis_version']}, redis-py {redis.__version__}"
                r.close()
                return proc, f"127.0.0.1:{port}", versions
            except redis.ConnectionError:
                time.sleep(0.05)
    except BaseException:  # interrupted while it starts: it goes too
        _stop(proc)
        raise
    _stop(proc)
    skip("redis-server did not come up")
    return None


def _start_worker(tmp: Path, memory: int) -> tuple[subprocess.Popen, str]:
    """A ``kvstrata worker`` on a socket in ``tmp``, listening: (process, address). Stopped again when anything
    (an interrupt included) ends the wait for it."""
    sock = tmp / "kvstrata.sock"
    cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", str(memory)]
    cmd += ["--disk-dir", "", "--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    try:
        import kvstrata

        kvstrata.connect(f"unix://{sock}", timeout=60).close()  # waits (with retries) until it listens
    except BaseException:
        _stop(proc)
        raise
    return proc, f"unix://{sock}"


def _stop(proc: subprocess.Popen, how: int = signal.SIGTERM) -> None:
    """Stop a server process: ``how``, then SIGKILL if it is still there after 30 s."""
    if proc.poll() is None:
        proc.send_signal(how)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------------------------- device rows
IN_FLIGHT = 4  # async calls in flight for the streamed device rows
READ_ROUNDS = 40  # timed rounds of the four mget_h2d rows and the mset_d2h row (after 3 untimed)
STREAMED_ROUNDS = 13  # rounds of IN_FLIGHT async calls (the first 3 untimed in the median)
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
                        if it == 0:  # one round of writes read back (untimed)
                            read_back(kv, ks, src)
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
    streamed_ops = (STREAMED_ROUNDS - 3) * IN_FLIGHT
    for op, t, ceiling, both_ways, seg, ops in (
        ("mget_h2d 64x1MiB", t_get, h2d_ceiling, spread[0], seg_h2d, READ_ROUNDS),
        (
            "mget_h2d 64x1MiB, another key written before each",
            t_get_other,
            h2d_ceiling,
            spread[0],
            seg_h2d,
            READ_ROUNDS,
        ),
        (
            "mget_h2d 64x1MiB right after its keys were rewritten",
            t_get_rt,
            h2d_ceiling,
            spread[0],
            seg_h2d,
            READ_ROUNDS,
        ),
        (
            "mget_h2d 64x1MiB of keys another client just wrote",
            t_get_written,
            h2d_ceiling,
            spread[0],
            seg_h2d,
            READ_ROUNDS,
        ),
        ("mset_d2h 64x1MiB", t_put, d2h_ceiling, spread[1], seg_d2h, READ_ROUNDS),
        (f"async_mget_h2d 64x1MiB, {IN_FLIGHT} in flight", t_get_async, h2d_streamed, spread[2], None, streamed_ops),
        (f"async_mset_d2h 64x1MiB, {IN_FLIGHT} in flight", t_put_async, d2h_streamed, spread[3], None, streamed_ops),
    ):
        rows.append(
            {
                "system": "kvstrata",
                "op": op,
                "size": n * size,
                "clients": 1,
                "ops": ops,  # timed calls, of which the median is taken
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


def read_back(kv: Any, keys: list[str], src: list[list[Any]]) -> None:
    """Read ``keys`` back with ``mget_h2d`` into fresh tensors like ``src`` (each key's list, as written) and compare:
    AssertionError naming how many keys, and the first, came back different or not at all."""
    import torch

    dst = [[torch.empty_like(t) for t in tensors] for tensors in src]
    results = kv.mget_h2d(keys, dst)
    bad = [
        key
        for key, r, a, b in zip(keys, results, src, dst)
        if r is not None or not all(torch.equal(x, y) for x, y in zip(a, b))
    ]
    if bad:
        raise AssertionError(f"{len(bad)} of {len(keys)} keys written by mset_d2h read back wrong, first {bad[0]!r}")


def _streamed(kv: Any, keys: list[str], src: list[list[Any]], n: int) -> tuple[float, float]:
    """Seconds per call of ``async_mget_h2d`` / ``async_mset_d2h`` with IN_FLIGHT calls issued back to back."""
    import torch

    dsts = [[[torch.empty_like(t[0])] for t in src] for _ in range(IN_FLIGHT)]
    times = []
    for _ in range(STREAMED_ROUNDS):
        t0 = time.perf_counter()
        futs = [kv.async_mget_h2d(keys, d) for d in dsts]
        assert all(f.result() == [None] * n for f in futs)
        times.append((time.perf_counter() - t0) / IN_FLIGHT)
    t_get_async = statistics.median(times[3:])
    assert all(torch.equal(a[0], b[0]) for d in dsts for a, b in zip(src, d))
    times = []
    for it in range(STREAMED_ROUNDS):
        batches = [[f"a2h/{it}/{j}/{i}" for i in range(n)] for j in range(IN_FLIGHT)]
        t0 = time.perf_counter()
        futs = [kv.async_mset_d2h(ks, src) for ks in batches]
        assert all(f.result() == [None] * n for f in futs)
        times.append((time.perf_counter() - t0) / IN_FLIGHT)
        if it == 0:  # one round of writes read back (untimed)
            for ks in batches:
                read_back(kv, ks, src)
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
COLUMNS = [
    "system",
    "op",
    "size",
    "clients",
    "keys",
    "ops",
    "ops_per_s",
    "GB/s",
    "p50_us",
    "local_reads",
    "x_redis",
    "x_mooncake",
    "correct",
    "ceiling_GB/s",
    "of_ceiling",
    "seg_ceiling_GB/s",
    "host_loop_us",
    "native_planner",
]


def run(args: argparse.Namespace) -> int:
    sizes, client_counts = args.sizes, args.clients
    cuda = _cuda()
    memory = worker_memory(sizes, client_counts, cuda)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}  # baseline -> why it did not run
    worker = redis_srv = mooncake = tmp = None
    ctx = multiprocessing.get_context("spawn")
    finished = interrupted = False
    # First, before any process is started: SIGTERM tears down like Ctrl-C (a worker started before it was
    # installed outlived a SIGTERM during start-up).
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupted)
    try:
        tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-"))
        worker, kv_address = _start_worker(tmp, memory)
        if args.no_redis:
            skipped["redis"] = "--no-redis"
        else:
            redis_srv = _start_redis(tmp, skipped)
        if args.no_mooncake:
            skipped["mooncake"] = "--no-mooncake"
        else:
            mooncake = _start_mooncake(tmp, memory, skipped)
        with ctx.Manager() as manager, ctx.Pool(max(client_counts), initializer=_ignore_sigint) as pool:
            for size in sizes:
                n = _ops_for(size, args.seconds)
                for clients in client_counts:
                    systems = [("kvstrata", kv_address)] + ([("redis", redis_srv[1])] if redis_srv else [])
                    for op, nkeys in _ops(size, memory):
                        for system, address in systems:
                            if system == "redis" and op == "get_buffers":
                                continue
                            rows.append(_measure(pool, manager, system, address, op, size, clients, n, nkeys))
                            _progress(rows[-1])
                        if mooncake:
                            results = mooncake.run_clients(op, size, clients, n, keys=nkeys)
                            rows.append(_row("mooncake", op, size, clients, results, nkeys))
                            _progress(rows[-1])
        _add_ratios(rows)
        if cuda:
            rows += _device_rows(kv_address)
        finished = True
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the rows so far are written, marked
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the teardown itself runs to its end (bounded waits)
        try:  # Mooncake first: its namespace must go even if another server hangs on the way down
            if mooncake:
                mooncake.close()
                if finished:  # its logs are kept only when something went wrong
                    shutil.rmtree(mooncake.log_dir, ignore_errors=True)
        finally:
            if worker is not None:
                _stop(worker)
            if redis_srv:
                _stop(redis_srv[0])
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            signal.signal(signal.SIGTERM, previous_sigterm)
    if interrupted and not rows:
        print("kvstrata bench store: interrupted before any row finished: nothing written", flush=True)
        return 130
    if interrupted:
        _add_ratios(rows)
    baselines = {"redis": redis_srv[2] if redis_srv else None, "mooncake": mooncake.version if mooncake else None}
    record = {
        "rows": rows,
        "interrupted": interrupted,
        "worker_memory": memory,
        "baselines": baselines,
        "baselines_skipped": {k: v for k, v in skipped.items() if baselines.get(k) is None},
    }
    path = write_result("store", record, args.out)
    print(f"results: {path}" + (" (interrupted: the rows finished before it)" if interrupted else ""))
    print_table(rows, COLUMNS)
    if interrupted:
        return 130
    wrong = [r for r in rows if r.get("correct") is False]
    for r in wrong:
        print(f"WRONG VALUES: {r['system']} {r['op']} {r['size']} B x{r['clients']}: a value read back differed")
    return 1 if wrong else 0


def _progress(row: dict[str, Any]) -> None:
    note = "" if row["correct"] else "  WRONG VALUE READ"
    print(
        f"  {row['system']:8} {row['op']:11} {row['size']:>9} B x{row['clients']} ({row['keys']} keys):"
        f" {row['ops_per_s']} ops/s{note}",
        flush=True,
    )


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _start_mooncake(tmp: Path, memory: int, skipped: dict[str, str] | None = None) -> Any:
    """Mooncake Store in its own namespace (a ``kvstrata.bench.mooncake.MooncakeStore``), or None (reason printed,
    and kept in ``skipped["mooncake"]``)."""
    from kvstrata.bench import mooncake

    def skip(reason: str) -> None:
        print(f"{reason}: Mooncake rows skipped")
        if skipped is not None:
            skipped["mooncake"] = reason

    reason = mooncake.unavailable()
    if reason:
        skip(reason)
        return None
    log_dir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-mooncake-"))  # kept: read it when Mooncake fails
    try:
        store = mooncake.MooncakeStore(segment_size=memory, log_dir=log_dir)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # e.g. no netns support here
        logs = f"; logs: {log_dir}" if any(log_dir.iterdir()) else ""
        if not logs:
            log_dir.rmdir()
        skip(f"Mooncake Store did not start ({exc}{logs})")
        return None
    print(f"Mooncake Store up in network namespace {store.ns} (logs: {log_dir})")
    return store


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """kvstrata's throughput over Redis's and Mooncake's for the same op on the same keys. Redis has no zero-copy
    view: kvstrata's ``get_buffers`` is set against Redis's get of the same keys (``get_cached``, or ``get`` where
    the values are too large to be cached and that row reads KEYS_PER_CLIENT keys)."""
    base = {(r["system"], r["op"], r["size"], r["clients"], r.get("keys")): r for r in rows}
    for r in rows:
        if r["system"] != "kvstrata" or "ops_per_s" not in r:
            continue
        same = (r["size"], r["clients"], r.get("keys"))
        redis_ops = ("get_cached", "get") if r["op"] == "get_buffers" else (r["op"],)
        redis = next((base[k] for k in (("redis", op, *same) for op in redis_ops) if k in base), None)
        if redis:
            r["x_redis"] = round(r["ops_per_s"] / redis["ops_per_s"], 2)
        mooncake = base.get(("mooncake", r["op"], *same))
        if mooncake:
            r["x_mooncake"] = round(r["ops_per_s"] / mooncake["ops_per_s"], 2)
