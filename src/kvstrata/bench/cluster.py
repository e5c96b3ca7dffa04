"""``kvstrata bench cluster``: a cluster of worker processes over etcd, beside one worker reached directly.

Starts etcd (``--etcd``, or the ``etcd`` binary on a free port) and ``--workers`` ``kvstrata worker --cluster``
processes on this host, then, from this process, times batches of ``--batch`` keys:

* ``direct``: a plain client of one of those workers (its Unix socket): the baseline, one worker's speed;
* ``cluster``: a :class:`~kvstrata.client.cluster.ClusterClient` (each worker through its Unix socket, as on the
  workers' own hosts), with ``replicas`` 1 and 2;
* ``cluster-tcp``: the same over TCP (``prefer_local=False``), as a client on another host reaches them.

Each row gives batches per second, keys per second, GB/s and the median batch latency, and ``vs_direct``: its keys
per second over the ``direct`` row's of the same op and size (measured in the same run). Every read is checked
against what was written. Then the failover: with ``replicas=2``, one worker is SIGKILLed; the row gives how long
the first read of every key took after it (the dead worker's connections failing over to the replicas), whether
every key came back, and how long until the worker dropped out of the member list (its lease, ``--ttl``).
Then a join: ``--join-bytes`` of 1 MiB values are written through a TCP cluster client (timed: the baseline, the
rate a client gets into the cluster), a new worker joins, and the row gives how long until every key it now owns
was at it (the other workers' rebalance, :mod:`kvstrata.server.rebalance`), that as GB/s and over the rate one TCP
client writes the same bytes into the newcomer (``vs_client_write``, timed after), how long until the copies they
no longer own were dropped (after the rebalance's grace), and whether every key then reads back from its one owner.
All of it runs on one host (loopback): it measures kvstrata's routing and its cost, not a network.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvstrata.bench._common import gbps, positive, print_table, size_list, write_result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=positive(int), default=3, help="worker processes (default 3)")
    parser.add_argument("--sizes", type=size_list, default="4KiB,256KiB", help="value sizes (default 4KiB,256KiB)")
    parser.add_argument("--batch", type=positive(int), default=32, help="keys per mset/mget call (default 32)")
    parser.add_argument("--seconds", type=positive(float), default=1.0, help="seconds per row (default 1)")
    parser.add_argument("--ttl", type=positive(float), default=2.0, help="the workers' --cluster-ttl (default 2)")
    parser.add_argument("--etcd", default=None, help="HOST:PORT of an etcd to use (default: start one)")
    parser.add_argument("--name", default="cluster", help="the result file's name (default cluster)")
    parser.add_argument(
        "--join-bytes", type=_one_size, default="256MiB", help="bytes in the cluster when a worker joins (256MiB)"
    )


def _one_size(text: str) -> int:
    sizes = size_list(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"one size, got {text!r}")
    return sizes[0]


def _start_workers(n: int, url: str, folder: Path, ttl: float, memory: int, first: int = 0) -> list[subprocess.Popen]:
    procs = []
    for i in range(first, first + n):
        command = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(folder / f"w{i}.sock")]
        command += ["--memory", str(memory), "--disk-dir", "", "--cluster", url, "--node-id", f"w{i}"]
        command += ["--cluster-listen", "tcp://127.0.0.1:0", "--cluster-ttl", str(ttl)]
        log = (folder / f"w{i}.log").open("w")
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log))
        log.close()  # (the worker has its own copy)
    return procs


def _wait(predicate: Any, seconds: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > seconds:
            raise RuntimeError(f"timed out after {seconds:g} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - start


def _time_batches(kv: Any, op: str, size: int, batch: int, seconds: float, tag: str) -> dict[str, Any]:
    """Batches of ``op`` for ``seconds``, over 8 rotating key sets; every read checked."""
    sets = 8
    keys = [[f"{tag}/{s}/{i}" for i in range(batch)] for s in range(sets)]
    values = [[bytes([(s * batch + i) % 251]) * size for i in range(batch)] for s in range(sets)]
    for s in range(sets):  # (the reads' keys exist, and the writes' first round is no cold start)
        results = kv.mset(list(zip(keys[s], values[s])))
        if any(r is not None for r in results):
            raise RuntimeError(f"{tag}: mset refused: {next(r for r in results if r is not None)!r}")
    latencies, n, correct = [], 0, True
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or n < 3:
        s = n % sets
        start = time.perf_counter()
        if op == "mset":
            results = kv.mset(list(zip(keys[s], values[s])))
            correct &= all(r is None for r in results)
        else:
            results = kv.mget(keys[s])
            correct &= results == values[s]
        latencies.append(time.perf_counter() - start)
        n += 1
    total = sum(latencies)
    return {
        "batches_per_s": round(n / total, 1),
        "keys_per_s": round(n * batch / total),
        "GBps": round(gbps(n * batch * size, total), 3),
        "p50_ms": round(statistics.median(latencies) * 1e3, 3),
        "batches": n,
        "correct": bool(correct),
    }


def _failover(kv: Any, membership: Any, victim: subprocess.Popen, node: str, batch: int) -> dict[str, Any]:
    """SIGKILL ``victim`` (``node``) under a ``replicas=2`` client holding 256 keys: the first full read's time and
    result, and how long until the member list dropped it."""
    items = {f"failover/{i}": os.urandom(1024) for i in range(256)}
    for start in range(0, len(items), batch):
        chunk = list(items.items())[start : start + batch]
        if any(r is not None for r in kv.mset(chunk)):
            raise RuntimeError("failover: the keys were not all written")
    kv.mget(list(items))  # (connections to every worker open, as in steady serving)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    killed = time.monotonic()
    got = kv.mget(list(items))
    first_read_s = time.monotonic() - killed
    dropped_s = _wait(lambda: node not in membership.members(), 60, f"{node} to leave the member list")
    dropped_s += first_read_s
    return {
        "keys": len(items),
        "first_read_after_kill_ms": round(first_read_s * 1e3, 1),
        "all_keys_read": got == list(items.values()),
        "dropped_from_list_after_s": round(dropped_s, 2),
    }


def _join(url: str, folder: Path, ttl: float, memory: int, index: int, total: int, membership: Any) -> dict[str, Any]:
    """Fill the cluster with ``total`` bytes of 1 MiB values through a TCP cluster client (timed), start worker
    ``w{index}``, and time the rebalance that hands it its keys (see the module)."""
    import numpy as np

    import kvstrata
    from kvstrata.client.cluster import ClusterClient
    from kvstrata.cluster.placement import Placement

    value = 1 << 20
    n = max(1, total // value)
    rng = np.random.default_rng(0)
    items = {f"join/{i}": rng.integers(0, 255, value, dtype=np.uint8).tobytes() for i in range(n)}
    old = sorted(membership.members())
    with ClusterClient(url, prefer_local=False, replicas=1) as kv:
        t0 = time.perf_counter()
        for start in range(0, n, 32):
            if any(r is not None for r in kv.mset(list(items.items())[start : start + 32])):
                raise RuntimeError("join: the keys were not all written")
        write_s = time.perf_counter() - t0
    node = f"w{index}"
    placement = Placement([*old, node])
    theirs = [k for k in items if placement.owners(k)[0] == node]
    (proc,) = _start_workers(1, url, folder, ttl, memory, first=index)
    try:
        _wait(lambda: node in membership.members(), 120, f"{node} to join")
        listed = time.monotonic()
        with kvstrata.connect(address=str(folder / f"{node}.sock")) as newcomer:
            _wait(lambda: all(newcomer.exists(theirs)), 300, f"{node} to hold its keys")
        moved_s = time.monotonic() - listed
        olds = [kvstrata.connect(address=str(folder / f"{w}.sock")) for w in old]
        try:

            def dropped() -> bool:
                return not any(any(c.exists(theirs)) for c in olds)

            settled_s = _wait(dropped, 300, "the old copies to be dropped") + moved_s
        finally:
            for c in olds:
                c.close()
        with kvstrata.connect(cluster=url) as kv:
            correct = kv.mget(list(items)) == list(items.values())
        # the baseline for the hand-off: the same bytes written into the newcomer by one client over TCP
        with kvstrata.connect(address=membership.members()[node].address) as direct:
            t0 = time.perf_counter()
            for start in range(0, len(theirs), 32):
                direct.mset({k: items[k] for k in theirs[start : start + 32]})
            direct_s = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    moved = len(theirs) * value
    direct_gbps = gbps(moved, direct_s)
    return {
        "workers_before": len(old),
        "bytes_in_cluster": n * value,
        "value_bytes": value,
        "client_write_GBps": gbps(n * value, write_s),
        "keys_moved": len(theirs),
        "bytes_moved": moved,
        "moved_s": round(moved_s, 3),
        "moved_GBps": gbps(moved, moved_s),
        "client_write_to_newcomer_GBps": direct_gbps,
        "vs_client_write": round(gbps(moved, moved_s) / direct_gbps, 2) if direct_gbps else None,
        "old_copies_dropped_s": round(settled_s, 3),
        "all_keys_read": correct,
    }


def run(args: argparse.Namespace) -> int:
    import kvstrata
    from kvstrata.bench._etcd import LocalEtcd
    from kvstrata.cluster import open_membership

    if args.workers < 2:
        print("kvstrata bench cluster: --workers: at least 2 (the failover kills one)", file=sys.stderr)
        return 2
    join_bytes = args.join_bytes
    memory = max(64 << 20, 3 * 8 * args.batch * max(args.sizes) * 2 + (32 << 20)) + 2 * join_bytes
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-cluster-") as tmp:
        folder = Path(tmp)
        etcd = None if args.etcd else LocalEtcd(folder / "etcd")
        if etcd is not None:
            try:
                etcd.__enter__()
            except FileNotFoundError as exc:
                print(f"kvstrata bench cluster: {exc}; or pass --etcd HOST:PORT", file=sys.stderr)
                return 2
        endpoint = args.etcd or etcd.endpoint
        url = f"etcd://{endpoint}/bench-{uuid.uuid4().hex[:8]}"
        procs = _start_workers(args.workers, url, folder, args.ttl, memory)
        rows: list[dict[str, Any]] = []
        try:
            membership = open_membership(url)
            joined = _wait(lambda: len(membership.members()) == args.workers, 120, "the workers to join")
            print(f"{args.workers} workers joined {url} in {joined:.1f} s", flush=True)
            clients = {
                "direct": kvstrata.connect(address=str(folder / "w0.sock")),
                "cluster": kvstrata.connect(cluster=url),
                "cluster-r2": kvstrata.connect(cluster=url, replicas=2),
                "cluster-tcp": kvstrata.client.cluster.ClusterClient(url, prefer_local=False),
            }
            for size in args.sizes:
                for op in ("mset", "mget"):
                    for system, kv in clients.items():
                        row = {"system": system, "op": op, "size": size, "batch": args.batch}
                        row.update(_time_batches(kv, op, size, args.batch, args.seconds, f"{system}/{size}"))
                        rows.append(row)
                        print(
                            f"  {system:<12} {op} {size:>8} B x {args.batch}: {row['keys_per_s']:>8} keys/s  "
                            f"p50 {row['p50_ms']} ms",
                            flush=True,
                        )
            for row in rows:
                base = next(
                    r for r in rows if r["system"] == "direct" and (r["op"], r["size"]) == (row["op"], row["size"])
                )
                row["vs_direct"] = round(row["keys_per_s"] / base["keys_per_s"], 2)
            failover = _failover(clients["cluster-r2"], membership, procs[1], "w1", args.batch)
            print(f"  failover: {failover}", flush=True)
            join = _join(url, folder, args.ttl, memory, args.workers, join_bytes, membership)
            print(f"  join: {join}", flush=True)
            for kv in clients.values():
                kv.close()
            membership.close()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if etcd is not None:
                etcd.__exit__(None, None, None)
    correct = all(r["correct"] for r in rows) and failover["all_keys_read"] and join["all_keys_read"]
    print_table(rows, ["system", "op", "size", "batch", "keys_per_s", "GBps", "p50_ms", "vs_direct", "correct"])
    path = write_result(
        args.name,
        {
            "benchmark": "cluster",
            "workers": args.workers,
            "batch": args.batch,
            "ttl_s": args.ttl,
            "rows": rows,
            "failover": failover,
            "join": join,
            "correct": correct,
            "note": "one host, loopback: routing cost, not a network",
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0 if correct else 1
