"""The 4 KiB device-object hand-off between two processes, on CPU: where the protocol's time goes.

Same shape as ``kvstrata bench device``'s latency step, with no GPU: this process hosts a real worker
(as the benchmark does), an owner and a reader process each run a :class:`DeviceObjects` client with
CPU tensors. Only the CUDA IPC import is replaced (CPU tensors cannot be mapped across processes):
the reader's ``_sources`` returns a tensor it holds for the owner's key, so the broker, the matching,
the event thread, settling and completions all run as on the GPU machine.

* subscriber first: the reader subscribes, asks the owner to publish; time from the owner's publish
  call to the reader's future done (the clock is the node's monotonic clock, shared by processes);
  also the owner's own future (the broker released its tensors).
* publisher first: the owner publishes, the reader subscribes 2 ms later; time of the subscribe call
  to its future done.

Run: ``PYTHONPATH=src python tools/devobj_latency_cpu.py [--iters 300] [--trace]``
(``--trace`` sets ``KVSTRATA_DEVOBJ_TRACE=1`` and prints both processes' steps of the last round).
A/B of the leading waiter (:mod:`kvstrata.devobj.lead`): ``--ab`` alternates rounds with and without it in the
same processes (robust to a noisy host); or runs with ``KVSTRATA_DEVOBJ_LEAD=0`` and ``=1`` in turn.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

NBYTES = 4096


def _usage() -> tuple[float, int]:
    """This process's CPU seconds (user + system, all threads) and context switches so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw + r.ru_nivcsw


def _pattern():
    import torch

    return (torch.arange(NBYTES, dtype=torch.int64) % 251).to(torch.uint8)


def _client(address: str):
    import kvstrata
    from kvstrata.devobj import DeviceObjectConfig, api

    src = _pattern()

    def sources(self, rec, peer, reuse=False):  # stands in for the (cached) CUDA IPC import
        if rec.get("pid") == os.getpid():
            return api._LOCAL[rec["local"]][0], []
        return [src], []

    api.DeviceObjects._sources = sources
    c = kvstrata.connect(address)
    c.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True))
    return c


def owner(address: str, iters: int, ctl, res) -> None:
    from kvstrata.devobj import debug

    c = _client(address)
    src = _pattern()
    t_pub, t_rel, traces = [], [], []
    u0 = _usage()
    for _ in range(iters):  # subscriber first
        i = ctl.recv()
        debug.trace_take()
        t0 = time.perf_counter()
        (f,) = c.dev_publish([f"lat/{i}"], [[src]])
        t_pub.append(t0)
        f.result(30)
        t_rel.append(time.perf_counter() - t0)
        traces.append([(t, f"owner {th}", s) for t, th, s in debug.trace_take()])
    trace = traces[-1]
    u1 = _usage()
    for _ in range(iters):  # publisher first
        i = ctl.recv()
        (f,) = c.dev_publish([f"latp/{i}"], [[src]])
        ctl.send(i)
        f.result(30)
    u2 = _usage()
    res.send({"usage": [u0, u1, u2], "t_pub": t_pub, "t_rel": t_rel, "trace": trace, "traces": traces})
    res.recv()  # the reader is done too
    c.close()


def reader(address: str, iters: int, ctl, res, ab: bool = False) -> None:
    import torch

    from kvstrata.devobj import debug

    c = _client(address)
    objs = c.device_objects()
    want = _pattern()
    d = torch.zeros(NBYTES, dtype=torch.uint8)
    t_done, traces = [], []
    u0 = _usage()
    for i in range(iters):
        if ab:  # even rounds with the leading waiter, odd ones without (same processes, same minutes)
            objs.lead_waiters = i % 2 == 0
        (f,) = c.dev_subscribe([f"lat/{i}"], [[d]], timeout=30)
        debug.trace_take()
        ctl.send(i)
        f.result(30)
        t_done.append(time.perf_counter())
        traces.append([(t, f"reader {th}", s) for t, th, s in debug.trace_take()])
    for tr, t in zip(traces, t_done):
        tr.append((t, "reader main", "future done"))
    trace1 = traces[-1]
    u1 = _usage()
    pub_first, traces2 = [], []
    for i in range(iters):
        if ab:
            objs.lead_waiters = i % 2 == 0
        d.zero_()
        ctl.send(i)
        ctl.recv()
        time.sleep(0.002)  # let the publish land in the broker
        debug.trace_take()
        t0 = time.perf_counter()
        c.dev_subscribe([f"latp/{i}"], [[d]], timeout=30)[0].result(30)
        pub_first.append(time.perf_counter() - t0)
        traces2.append([*debug.trace_take(), (t0 + pub_first[-1], "main", "future done")])
    trace2 = traces2[-1]
    u2 = _usage()
    if not torch.equal(d, want):
        raise AssertionError("the hand-off delivered wrong bytes")
    res.send(
        {
            "usage": [u0, u1, u2],
            "t_done": t_done,
            "pub_first": pub_first,
            "trace1": trace1,
            "trace2": trace2,
            "traces": traces,
            "traces2": traces2,
        }
    )
    res.recv()
    c.close()


def _run(fn, address, iters, ctl, res, ab=False) -> None:
    try:
        fn(address, iters, ctl, res, **({"ab": ab} if fn is reader else {}))
    except BaseException as exc:
        res.send({"error": f"{fn.__name__}: {type(exc).__name__}: {exc}"})
        raise


def _pct(xs: list[float]) -> str:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e6
    return f"median {statistics.median(xs) * 1e6:7.1f} us   p10 {q(0.1):7.1f}   p90 {q(0.9):7.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--ab", action="store_true", help="alternate rounds with and without the leading waiter")
    ap.add_argument("--trace", action="store_true", help="KVSTRATA_DEVOBJ_TRACE=1: print the last round's steps")
    args = ap.parse_args(argv)
    if args.trace:
        os.environ["KVSTRATA_DEVOBJ_TRACE"] = "1"  # before the children start: they inherit it
    from kvstrata.devobj import debug
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(WorkerConfig(socket=str(Path(tmp) / "kv.sock"), memory=64 << 20, disk_dir="")).start()
        ctl_o, ctl_r = ctx.Pipe()  # owner <-> reader
        res = [ctx.Pipe() for _ in range(2)]  # child -> this process
        procs = [
            ctx.Process(target=_run, args=(fn, worker.address, args.iters, ctl, res[i][1], args.ab))
            for i, (fn, ctl) in enumerate(((owner, ctl_o), (reader, ctl_r)))
        ]
        for p in procs:
            p.start()
        w0 = _usage()
        try:
            results = []
            for here, _ in res:
                if not here.poll(600):
                    raise RuntimeError("a child process hung")
                results.append(here.recv())
                if "error" in results[-1]:
                    raise RuntimeError(results[-1]["error"])
            for here, _ in res:
                here.send("bye")
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            w1 = _usage()
            wtrace = debug.trace_take()
            worker.stop()
    o, r = results
    sub_first = [d - p for d, p in zip(r["t_done"], o["t_pub"])]
    skip = min(10, args.iters // 5)
    from kvstrata.devobj.lead import lead_enabled

    print(
        f"4 KiB hand-off on CPU, {args.iters} rounds (first {skip} dropped), worker in the parent process, "
        f"leading waiter {'on' if lead_enabled() else 'off'}"
    )
    rows = [
        ("subscriber first, publish call -> reader's future done:", sub_first),
        ("subscriber first, publish call -> owner's future done: ", o["t_rel"]),
        ("publisher first, subscribe call -> future done:        ", r["pub_first"]),
    ]
    for what, xs in rows:
        if not args.ab:
            print(f"  {what}  {_pct(xs[skip:])}")
            continue
        for name, parity in (("lead", 0), ("no lead", 1)):
            print(f"  {what} {name:7s}  {_pct([x for j, x in enumerate(xs) if j >= skip and j % 2 == parity])}")
    n = args.iters
    for name, res in (("owner", o), ("reader", r)):
        (c0, s0), (c1, s1), (c2, s2) = res["usage"]
        print(
            f"  {name:6s} process per round: subscriber first {(c1 - c0) / n * 1e6:6.1f} us CPU, "
            f"{(s1 - s0) / n:4.1f} context switches; publisher first {(c2 - c1) / n * 1e6:6.1f} us, "
            f"{(s2 - s1) / n:4.1f}"
        )
    print(
        f"  worker process per round (both parts, with startup): {(w1[0] - w0[0]) / (2 * n) * 1e6:6.1f} us CPU, "
        f"{(w1[1] - w0[1]) / (2 * n):4.1f} context switches"
    )
    if args.trace:
        print("--- trace: subscriber first (both processes), last round")
        t0, t1 = o["trace"][0][0] - 1e-3, r["trace1"][-1][0] + 2e-3
        worker_side = [x for x in wtrace if t0 <= x[0] <= t1]  # stamps the worker's own code may add
        print(debug.trace_format(sorted(o["trace"] + r["trace1"] + worker_side)))
        print("--- trace: publisher first (reader), last round")
        print(debug.trace_format(r["trace2"]))
        skip = min(10, args.iters // 5)
        print("--- median per step, subscriber first (from the publish call)")
        print(debug.trace_medians([a + b for a, b in zip(o["traces"][skip:], r["traces"][skip:])]))
        print("--- median per step, publisher first (from the subscribe call)")
        print(debug.trace_medians(r["traces2"][skip:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
