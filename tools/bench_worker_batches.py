"""Per-key cost of the worker's batch requests behind the store's device calls (``mget_h2d`` / ``mset_d2h``).

Two tables, medians of many runs in microseconds (and per key):

(a) the engine calls alone, as the handlers call them: ``ObjectStore.commit`` of 1/16/64 items carved
    from a reservation (the keys rewritten each time, as a device call's stages are), ``lease_many`` of
    16/64 keys right after they were rewritten, ``release_many`` of 64 leases, ``create_many`` +
    ``seal_many`` of 64, ``delete`` of 64;
(b) the same requests end to end through a real worker process (a ``kvstrata worker`` subprocess, the
    client's pipelined ``commit`` / ``acquire`` / ``mcreate`` + ``mseal`` / ``delete``; ``acquire`` of 4/16/64
    keys right after a rewrite, as a cold ``mget_h2d`` asks it: the client's local-read entries gone stale,
    the worker's leases, ``acquire_finish`` building the leases and judging them for local reads; ``release`` is
    one-way, so it is timed followed by a ``ping``, and the ``ping`` alone is shown beside it).

(c) a cold ``acquire`` (keys rewritten since the client's local-read entries were taken) side by side in one
    process, the client's ``RemoteBackend`` and the worker's handler joined by a loopback connection that
    encodes and decodes every message as the socket does: the client's ``acquire_start`` (stale entries
    dropped, request encoded), the worker's ``handle`` (decode, lease, reply encoded), the client's
    ``acquire_finish`` (reply decoded, leases built, judged for local reads), ``settle`` (the local-read
    entries made: a device call does it while its copies run) and the call's ``release`` (both sides). No
    scheduling or wake-ups in it: on a busy machine it shows the CPU cost the changes act on.

CPU only; values are small (the cost measured is metadata, not bytes)::

    PYTHONPATH=src python3 tools/bench_worker_batches.py [--iters 300] [--only engine|e2e|sides]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VALUE = 4096  # bytes per object: the cost per key is metadata, whatever the size
_clock = time.perf_counter


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _row(rows: list, name: str, n: int, samples: list[float]) -> None:
    us = _median_us(samples)
    rows.append((name, n, us, us / n))


def bench_engine(iters: int) -> list:
    from kvstrata.store import ObjectStore, StoreConfig

    rows: list = []
    store = ObjectStore(StoreConfig(memory_bytes=256 << 20, segment_bytes=256 << 20, numa_node=None, hugepages="off"))
    owner = "bench"
    try:
        for n in (1, 16, 64):
            keys = [f"c{n}/{i}" for i in range(n)]
            samples = []
            for it in range(iters + 20):
                loc = store.reserve(owner, n * VALUE)
                items = [(k, VALUE, loc.offset + i * VALUE) for i, k in enumerate(keys)]
                t0 = _clock()
                out = store.commit(owner, items)
                t1 = _clock()
                assert out.count(None) == n, out
                if it >= 20:
                    samples.append(t1 - t0)
            _row(rows, "commit", n, samples)
        for n in (16, 64):
            keys = [f"a{n}/{i}" for i in range(n)]
            samples = []
            for it in range(iters + 20):
                loc = store.reserve(owner, n * VALUE)
                store.commit(owner, [(k, VALUE, loc.offset + i * VALUE) for i, k in enumerate(keys)])  # rewritten
                t0 = _clock()
                ids, _, _, _, errors = store.lease_many(keys, owner=owner, timeout=0.0)
                t1 = _clock()
                assert not errors
                store.release_many(ids)
                if it >= 20:
                    samples.append(t1 - t0)
            _row(rows, "acquire (lease_many)", n, samples)
        keys = [f"a64/{i}" for i in range(64)]
        samples = []
        for it in range(iters + 20):
            ids, _, _, _, _ = store.lease_many(keys, owner=owner, timeout=0.0)
            t0 = _clock()
            store.release_many(ids)
            t1 = _clock()
            if it >= 20:
                samples.append(t1 - t0)
        _row(rows, "release_many", 64, samples)
        keys = [f"m/{i}" for i in range(64)]
        samples = []
        for it in range(iters + 20):
            t0 = _clock()
            locs = store.create_many([(k, VALUE) for k in keys], owner=owner)
            errs = store.seal_many(keys, owner=owner)
            t1 = _clock()
            assert errs.count(None) == 64 and not any(isinstance(x, Exception) for x in locs)
            if it >= 20:
                samples.append(t1 - t0)
        _row(rows, "create_many+seal_many", 64, samples)
        samples = []
        for it in range(iters + 20):
            loc = store.reserve(owner, 64 * VALUE)
            store.commit(owner, [(k, VALUE, loc.offset + i * VALUE) for i, k in enumerate(keys)])
            t0 = _clock()
            out = store.delete(keys)
            t1 = _clock()
            assert all(out)
            if it >= 20:
                samples.append(t1 - t0)
        _row(rows, "delete", 64, samples)
    finally:
        store.close()
    return rows


def bench_e2e(iters: int) -> list:
    import kvstrata

    rows: list = []
    opts = {"ttl": None, "nx": False, "mode": "memory"}
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "kvstrata.sock"
        cmd = [sys.executable, "-m", "kvstrata.cli.main", "worker", "--socket", str(sock), "--memory", str(1 << 30)]
        proc = subprocess.Popen([*cmd, "--disk-dir", "", "--log-level", "warning"], env=dict(os.environ))
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the worker did not start")
                time.sleep(0.05)
            with kvstrata.connect(f"unix://{sock}", timeout=60) as kv:
                b = kv._backend

                def commit(keys: list[str]) -> float:
                    loc = b.reserve_finish(b.reserve_start(len(keys) * VALUE))
                    items = [(k, VALUE, loc.offset + i * VALUE) for i, k in enumerate(keys)]
                    t0 = _clock()
                    out, _ = b.commit_finish(b.commit_start(items, opts))
                    t1 = _clock()
                    assert out.count(None) == len(keys), out
                    return t1 - t0

                for n in (1, 16, 64):
                    keys = [f"c{n}/{i}" for i in range(n)]
                    _row(rows, "commit", n, [commit(keys) for _ in range(iters + 20)][20:])
                for n in (4, 16, 64):
                    keys = [f"a{n}/{i}" for i in range(n)]
                    samples = []
                    for it in range(iters + 20):
                        commit(keys)  # rewritten: kept leases go stale, the acquire goes to the worker
                        t0 = _clock()
                        leases = b.acquire_finish(b.acquire_start(keys, 0, cache="fit", carry=False))
                        t1 = _clock()
                        kv._release_leases([x.lease_id for x in leases])
                        if it >= 20:
                            samples.append(t1 - t0)
                    _row(rows, "acquire (after rewrite)", n, samples)
                keys = [f"a64/{i}" for i in range(64)]
                ping, samples = [], []
                for it in range(iters + 20):
                    leases = b.acquire_finish(b.acquire_start(keys, 0, carry=False))
                    ids = [x.lease_id for x in leases]
                    t0 = _clock()
                    b._conn.send({"op": "release", "ids": ids})
                    b.request({"op": "ping"})
                    t1 = _clock()
                    b.request({"op": "ping"})
                    t2 = _clock()
                    if it >= 20:
                        samples.append(t1 - t0)
                        ping.append(t2 - t1)
                _row(rows, "release + ping", 64, samples)
                _row(rows, "ping alone", 1, ping)
                keys = [f"m/{i}" for i in range(64)]
                samples = []
                for it in range(iters + 20):
                    t0 = _clock()
                    b.mcreate_finish(b.mcreate_start([(k, VALUE) for k in keys], opts))
                    errs = b.mseal_finish(b.mseal_start(keys))
                    t1 = _clock()
                    assert errs.count(None) == 64, errs
                    if it >= 20:
                        samples.append(t1 - t0)
                _row(rows, "mcreate+mseal", 64, samples)
                samples = []
                for it in range(iters + 20):
                    commit(keys)
                    t0 = _clock()
                    out = b.request({"op": "delete", "keys": keys})["r"]
                    t1 = _clock()
                    assert all(out)
                    if it >= 20:
                        samples.append(t1 - t0)
                _row(rows, "delete", 64, samples)
        finally:
            proc.terminate()
            proc.wait()
    return rows


class _Loopback:
    """A connection between a client and a worker session in one process: each message is encoded on send
    and decoded when the other side takes it, as over the socket."""

    closed = False
    can_pass_fds = True

    def __init__(self) -> None:
        self._r, self._w = os.pipe()  # never written: select() on fileno() finds the 'worker' alive
        self.to_worker: list[bytes] = []
        self.to_client: list[bytes] = []

    def fileno(self) -> int:
        return self._r

    def send(self, msg: dict, fds: tuple = ()) -> None:
        from kvstrata.transport.stream import pack

        self.to_worker.append(pack(msg))

    def recv(self, timeout: float | None = None, *, spin: float = 0.0) -> tuple[dict, list]:
        from kvstrata.transport.stream import unpack

        return unpack(self.to_client.pop(0)), []

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def bench_sides(iters: int) -> list:
    """Table (c): see the module docstring."""
    import collections
    import threading

    from kvstrata.client.local_reads import LocalReads
    from kvstrata.client.remote import RemoteBackend
    from kvstrata.memory.shm import SharedSegment
    from kvstrata.server.handlers import HANDLERS
    from kvstrata.server.validity import SLOTS_OFFSET, TABLE_BYTES, Validity
    from kvstrata.server.worker import Session
    from kvstrata.store import ObjectStore, StoreConfig
    from kvstrata.transport.stream import pack, unpack

    store = ObjectStore(StoreConfig(memory_bytes=256 << 20, segment_bytes=256 << 20, numa_node=None, hugepages="off"))
    validity = Validity()
    conn = _Loopback()
    worker = type("W", (), {"store": store, "validity": validity, "counters": collections.Counter()})()
    session = Session(worker, conn, {"shm": True})
    session.sent_segments.update(range(len(store.segments)))
    b = object.__new__(RemoteBackend)  # the client's state, as WorkerConnection.__init__ leaves it
    b.address, b._conn, b._lock, b._pid, b._broken, b._closed = (
        "loopback",
        conn,
        threading.Lock(),
        os.getpid(),
        "",
        False,
    )
    b._deferred, b._deferred_aborts, b._holders, b._stash, b._tag = collections.deque(), collections.deque(), {}, {}, 0
    b._lane, b._segments, b._tensors, b.segment_limits, b.placements = None, {}, {}, {}, None
    b._read_lock, b._untagged, b._untagged_due, b._read_tag, b._landing_last = threading.Lock(), [], False, 0, 0
    b._pins, b._pin_epoch, b._parked, b._there_until = {}, 0, collections.deque(), 0.0
    page = SharedSegment.attach(os.dup(validity.fd), TABLE_BYTES)
    b._local = LocalReads(page, max_entries=256, max_bytes=1 << 30, slots_offset=SLOTS_OFFSET)

    def serve() -> None:
        while conn.to_worker:
            reply = session.handle(unpack(conn.to_worker.pop(0)))
            if reply is not None:
                conn.to_client.append(pack(reply))

    rows: list = []
    try:
        for n in (4, 16, 64):
            keys = [f"s{n}/{i}" for i in range(n)]
            names = ("client start", "worker", "client finish", "client settle", "release")
            cols: dict[str, list[float]] = {k: [] for k in names}
            settle = getattr(b, "settle", lambda: None)  # the cache's entries made later (none before session 7)
            for it in range(iters + 20):
                HANDLERS["mput"](session, {"op": "mput", "items": [(k, b"v" * 64) for k in keys]})  # rewritten
                t0 = _clock()
                token = b.acquire_start(keys, 0, cache="fit", carry=False)
                t1 = _clock()
                serve()
                t2 = _clock()
                leases = b.acquire_finish(token)
                t3 = _clock()
                settle()
                t4 = _clock()
                b.release([x.lease_id for x in leases])
                serve()
                t5 = _clock()
                assert len(leases) == n and not any(isinstance(x, BaseException) for x in leases), leases
                if it >= 20:
                    for name, dt in zip(cols, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                        cols[name].append(dt)
            _row(rows, "cold acquire: start+worker+finish", n, [sum(x) for x in zip(*list(cols.values())[:3])])
            _row(rows, "  all 5 phases", n, [sum(x) for x in zip(*cols.values())])
            for name, samples in cols.items():
                _row(rows, f"  {name}", n, samples)
    finally:
        b._local.close()
        conn.close()
        validity.close()
        store.close()
    return rows


def _print(title: str, rows: list) -> None:
    print(f"\n{title}")
    print(f"{'request':26s}{'keys':>6s}{'median us':>12s}{'us/key':>10s}")
    for name, n, us, per in rows:
        print(f"{name:26s}{n:6d}{us:12.1f}{per:10.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--only", choices=("engine", "e2e", "sides"))
    args = ap.parse_args()
    if args.only in (None, "engine"):
        _print("(a) engine calls alone", bench_engine(args.iters))
    if args.only in (None, "e2e"):
        _print("(b) end to end through a worker process", bench_e2e(args.iters))
    if args.only in (None, "sides"):
        _print("(c) a cold acquire, client and worker in one process (CPU cost per side)", bench_sides(args.iters))


if __name__ == "__main__":
    main()
