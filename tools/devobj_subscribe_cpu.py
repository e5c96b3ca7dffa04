"""Per-call host cost of ``dev_subscribe`` with many keys, on CPU: where the broker's and client's time goes.

A real worker in this process; a publisher and a subscriber process, each a :class:`DeviceObjects` client
with CPU tensors (``allow_cpu``). Records carry fake CUDA IPC exports of the real size (one per tensor),
and the subscriber's ``_sources`` returns a tensor of its own (no IPC on CPU), so the broker, the reply's
encoding, the client's matching and settling run as on the GPU machine. Per round: the publisher
publishes K keys, the subscriber subscribes to them (publisher first) and waits for all futures.

Run: ``PYTHONPATH=src python tools/devobj_subscribe_cpu.py [--keys 32 256] [--rounds 40] [--profile]
[--nbytes 4096] [--stage-bytes N]`` (``--nbytes 8388608 --stage-bytes 0`` against the default stages: the
first copies overlapping the broker's answer for the rest)
(``--profile``: cProfile of the worker's request thread(s) over the timed rounds, top entries).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

NBYTES = int(os.environ.get("DEVOBJ_TOOL_NBYTES", "4096"))  # per key (--nbytes; children read it here)
STAGE_BYTES = os.environ.get("DEVOBJ_TOOL_STAGE_BYTES")  # --stage-bytes (None: DeviceObjectConfig's)
FAKE_BLOB = {
    "size": [NBYTES],
    "stride": [1],
    "offset": 0,
    "handle": bytes(range(64)),
    "storage_bytes": 1 << 26,
    "storage_offset": 0,
    "rc_handle": b"/torch_12345_67890_1234" + bytes(8),
    "rc_offset": 96,
    "ev_handle": bytes(64),
}


def _client(address: str):
    import torch

    import kvstrata
    from kvstrata.devobj import DeviceObjectConfig, api

    src = torch.ones(NBYTES, dtype=torch.uint8)
    export = api.DeviceObjects._export

    def fake_export(self, key, tensors, mode, ready):  # GPU-sized records: one IPC export per tensor
        item, owned = export(self, key, tensors, mode, ready)
        item["handles"] = [dict(FAKE_BLOB) for _ in tensors]
        return item, owned

    def sources(self, rec, peer, reuse=False):
        return [src] * len(rec["tensors"]), []

    api.DeviceObjects._export = fake_export
    api.DeviceObjects._sources = sources
    c = kvstrata.connect(address)
    extra = {} if STAGE_BYTES is None else {"stage_bytes": int(STAGE_BYTES)}
    c.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True, **extra))
    return c


def publisher(address: str, keys: list[int], rounds: int, ctl) -> None:
    import torch

    c = _client(address)
    t = torch.ones(NBYTES, dtype=torch.uint8)
    for k in keys:
        for r in range(rounds):
            futs = c.dev_publish([f"s{k}/{r}/{i}" for i in range(k)], [[t]] * k)
            ctl.send(r)
            for f in futs:
                f.result(60)
            ctl.recv()
    c.close()


def subscriber(address: str, keys: list[int], rounds: int, ctl, res) -> None:
    import torch

    c = _client(address)
    out = {}
    profs = None
    if os.environ.get("KVSTRATA_PROFILE_SUBSCRIBER"):  # the subscriber's call and its copy batch, each thread apart
        import cProfile
        import pstats

        from kvstrata.devobj import api

        profs = {"call": cProfile.Profile(), "copy batch": cProfile.Profile()}
        orig = api.DeviceObjects._copy_batch

        def copy_batch(self, items):
            profs["copy batch"].enable()
            try:
                return orig(self, items)
            finally:
                profs["copy batch"].disable()

        api.DeviceObjects._copy_batch = copy_batch
    for k in keys:
        bufs = [[torch.zeros(NBYTES, dtype=torch.uint8)] for _ in range(k)]
        times, cpu = [], []
        for r in range(rounds):
            ctl.recv()
            time.sleep(0.002)
            names = [f"s{k}/{r}/{i}" for i in range(k)]
            c0 = time.process_time()  # all of this process's threads: less moved by the machine's load than wall time
            t0 = time.perf_counter()
            if profs is not None:
                profs["call"].enable()
            futs = c.dev_subscribe(names, bufs, timeout=60)
            if profs is not None:
                profs["call"].disable()
            for f in futs:
                f.result(60)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            ctl.send(r)
        out[k] = times
        out[("cpu", k)] = cpu
    if profs is not None:
        for name, prof in profs.items():
            print(f"--- subscriber: {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    res.send(out)
    c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--nbytes", type=int, default=4096, help="bytes per key (copied on CPU: big ones show staging)")
    ap.add_argument("--stage-bytes", type=int, default=None, help="DeviceObjectConfig.stage_bytes (0: one request)")
    args = ap.parse_args(argv)
    os.environ["DEVOBJ_TOOL_NBYTES"] = str(args.nbytes)  # for the spawned processes
    if args.stage_bytes is not None:
        os.environ["DEVOBJ_TOOL_STAGE_BYTES"] = str(args.stage_bytes)
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(WorkerConfig(socket=str(Path(tmp) / "kv.sock"), memory=64 << 20, disk_dir="")).start()
        if prof is not None:  # profile the broker's entry (runs on the worker's session threads)
            from kvstrata.devobj import broker as B

            orig = B.DeviceBroker.handle

            def handle(self, *a, **kw):
                prof.enable()
                try:
                    return orig(self, *a, **kw)
                finally:
                    prof.disable()

            B.DeviceBroker.handle = handle
        a, b = ctx.Pipe()
        here, there = ctx.Pipe()
        procs = [
            ctx.Process(target=publisher, args=(worker.address, args.keys, args.rounds, a)),
            ctx.Process(target=subscriber, args=(worker.address, args.keys, args.rounds, b, there)),
        ]
        for p in procs:
            p.start()
        w0 = time.process_time()
        try:
            if not here.poll(600):
                raise RuntimeError("the subscriber hung")
            out = here.recv()
        finally:
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.kill()
            worker_cpu = (time.process_time() - w0) * 1e6 / (args.rounds * sum(args.keys))
            worker.stop()
    skip = min(5, args.rounds // 5)
    print(f"worker process CPU per key moved (publish, subscribe, completions; with startup): {worker_cpu:.1f} us")
    for k, times in out.items():
        if isinstance(k, tuple):
            continue
        xs = sorted(times[skip:])
        med = statistics.median(xs) * 1e6
        cpu = statistics.median(out[("cpu", k)][skip:]) * 1e6
        print(
            f"subscribe {k:4d} keys (publisher first): median {med:8.1f} us  {med / k:6.1f} us/key  "
            f"p10 {xs[len(xs) // 10] * 1e6:8.1f}  p90 {xs[len(xs) * 9 // 10] * 1e6:8.1f}  "
            f"subscriber CPU {cpu / k:5.1f} us/key"
        )
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
