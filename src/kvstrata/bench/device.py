"""``kvstrata bench device``: GPU-to-GPU device objects beside the peer-copy ceiling and NCCL, on 2 GPUs.

One run measures, on the same machine and in this order:

1. the ceiling: ``dst.copy_(src)`` GPU0 -> GPU1 in one process (copy engine over NVLink/PCIe);
2. the field's path: NCCL send/recv between two processes (torch.distributed);
3. kvstrata: ``dev_mget`` and ``dev_subscribe`` from a process on GPU0 into one on GPU1, through a real
   worker (hosted by this process), 4 KiB .. 1 GiB per key, as many keys per call as fit 2 GiB
   (up to 256); wall time per call, warm; and the 4 KiB hand-off latency end to end (the publish call
   in one process to the subscriber's future done in the other; clocks are the node's monotonic clock):
   isolated (the target's figure: each hand-off starts once the previous one is over on both sides, the
   owner's release included, and both were idle 1 ms), and back to back (the next subscribe and publish
   start as soon as the reader has its bytes, while both sides still finish the previous one), each with the
   publisher's direct offers (``kvstrata.devobj.offers``) and without, round by round (:func:`offers_on`);
4. ``dev_broadcast`` of 8 GiB (``--broadcast-gib``; ``--quick``: 2 GiB) from GPU0 to 3 receiver
   processes (GPU1, GPU0, GPU1) against a single peer copy of the same bytes (measured in step 1 of
   this run), for each variant: same-GPU copies (a GPU's leader pulling from the sender's GPU memory,
   and copying on to its group's members) by copy engine (``memcpy``) or kernel, and with
   ``--broadcast-wait stream|both`` GPU-side waits on the leaders' progress counters; plus when each
   receiver's last chunk landed (ms after the broadcast call; ``l`` leader, ``m`` member). Chunk:
   ``--chunk-mib`` (default: ``DeviceObjectConfig.chunk_bytes``, 32 MiB), the least: big objects
   get larger chunks (:func:`kvstrata.devobj.chain.chunk_size`).

``--quick`` fewer sizes and rounds (< 90 s); ``--smoke`` needs no GPU: broker and client-logic
timings through an in-process broker with CPU tensors (so a CPU test can run it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstrata.bench._common import gbps, positive, print_table, write_result
from kvstrata.bench._procs import device_client, get_queued, run_spawned, wait_future
from kvstrata.devobj import debug
from kvstrata.devobj.chain import chunk_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB]
QUICK_SIZES = [4 * KiB, 1 * MiB, 64 * MiB, 1 * GiB]
WAIT = float(os.environ.get("KVSTRATA_BENCH_WAIT", "300"))  # per step; --wait sets it for the children too
#: the isolated 4 KiB hand-offs: each side idle this long, with everything of the previous hand-off done (the
#: owner's release included), before the next starts; the back-to-back rounds start the next at once
QUIET_S = 0.001


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds (< 90 s)")
    parser.add_argument("--smoke", action="store_true", help="no GPU: broker/client timings with CPU tensors")
    parser.add_argument(
        "--broadcast-gib", type=positive(float), default=None, help="broadcast size (default 8, quick 2)"
    )
    parser.add_argument(
        "--chunk-mib",
        type=positive(int),
        default=None,
        help="broadcast pipeline chunk (MiB; default DeviceObjectConfig's, 32)",
    )
    parser.add_argument(
        "--broadcast-wait",
        choices=("host", "stream", "both"),
        default="host",
        help="how broadcast receivers wait for their predecessor's chunks (DeviceObjectConfig.broadcast_wait)",
    )
    parser.add_argument(
        "--rounds", type=positive(int), default=None, help="timed rounds per size (default 10, quick 4)"
    )
    parser.add_argument(
        "--wait", type=positive(float), default=None, help="seconds any one step may take before failing (300)"
    )


CALL_BYTES = 2 * GiB  # bytes per timed call: per-call control costs are paid once per 2 GiB at most


def offers_on(i: int) -> bool:
    """Whether the owner's publish of 4 KiB hand-off ``i`` sends an offer (kvstrata.devobj.offers): on, off, off,
    on, ... so that neither variant always goes first; both are measured in the same run, round by round."""
    return i % 4 in (0, 3)


def keys_per_call(size: int, quick: bool) -> int:
    return max(1, min(64 if quick else 256, CALL_BYTES // size))


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div:
            v = n / div
            return f"{v:g} {unit}"
    return f"{n} B"


# -- helpers shared by the GPU processes ------------------------------------------------------------
def _pattern(n: int, device: int):
    import torch

    # byte i is i % 251, built from one 251-byte period (an int64 arange would need 8 bytes per byte)
    period = torch.arange(251, device=device, dtype=torch.uint8)
    return period.repeat(-(-n // 251))[:n]


def _client(address: str, device: int, **cfg: Any):
    return device_client(address, device, **cfg)


def _wait(f, step: str):
    return wait_future(f, step, WAIT)


def _get(q, step: str):
    return get_queued(q, step, WAIT)


def _spawn(targets: list[tuple], timeout: float | None = None) -> dict[str, Any]:
    """Run ``(fn, *args)`` in spawned processes (:func:`~kvstrata.bench._procs.run_spawned`); results by name."""
    out: dict[str, Any] = {}
    for name, value in run_spawned(targets, 2 * WAIT if timeout is None else timeout):
        out.setdefault(name, []).append(value)
    return out


def _ctx():
    import torch.multiprocessing as mp

    return mp.get_context("spawn")


# -- 1. ceiling --------------------------------------------------------------------------------------
def _cross_time(fn, iters: int, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    for d in range(2):
        torch.cuda.synchronize(d)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(0))
        fn()
        end.record(torch.cuda.current_stream(0))  # the copy runs on the source device's stream
        for d in range(2):
            torch.cuda.synchronize(d)
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def peer_copy(sizes: list[int], quick: bool, rounds: int) -> dict[int, float]:
    """Seconds per call-equivalent: ``keys_per_call(size)`` copies of ``size`` bytes GPU0 -> GPU1."""
    import torch

    torch.cuda.set_device(0)
    out = {}
    for size in sizes:
        k = keys_per_call(size, quick)
        a = torch.empty(size * k, dtype=torch.uint8, device=0).random_(0, 255)
        b = torch.empty(size * k, dtype=torch.uint8, device=1)
        av, bv = a.view(k, size), b.view(k, size)

        def step(av=av, bv=bv, k=k) -> None:
            for j in range(k):
                bv[j].copy_(av[j], non_blocking=True)

        out[size] = _cross_time(step, rounds)
        del a, b, av, bv
        torch.cuda.empty_cache()
    return out


def _single_copy(nbytes: int) -> float:
    """Seconds of one peer copy of ``nbytes`` GPU0 -> GPU1 (what a broadcast is compared with)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=0)
    b = torch.empty(nbytes, dtype=torch.uint8, device=1)
    t = _cross_time(lambda a=a, b=b: b.copy_(a, non_blocking=True), 3, warmup=1)
    a = b = None  # free before the processes allocate theirs
    torch.cuda.empty_cache()
    return t


# -- 2. NCCL ------------------------------------------------------------------------------------------
def nccl_rank(rank: int, port: int, sizes: list[int], quick: bool, rounds: int) -> dict[int, float]:
    import torch
    import torch.distributed as dist

    from kvstrata.bench._common import device_time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    out = {}
    try:
        for size in sizes:
            k = keys_per_call(size, quick)
            x = torch.empty(size * k, dtype=torch.uint8, device=rank).view(k, size)

            def step(x=x, k=k) -> None:
                for j in range(k):
                    if rank == 0:
                        dist.send(x[j], 1)
                    else:
                        dist.recv(x[j], 0)

            out[size] = device_time(step, warmup=2, iters=rounds)
    finally:
        dist.destroy_process_group()
    return out if rank == 1 else {}


# -- 3. kvstrata mget / subscribe / latency ------------------------------------------------------------
def kv_owner(address: str, sizes: list[int], quick: bool, rounds: int, lat_iters: int, ctl: dict) -> dict:
    import torch

    c = _client(address, 0)
    keep = []
    for size in sizes:
        k = keys_per_call(size, quick)
        buf = _pattern(size * k, 0).view(k, size)
        keep.append(buf)
        views = [[buf[j]] for j in range(k)]
        assert all(r is None for r in c.dev_mset([f"m{size}/{j}" for j in range(k)], views))
        for i in range(rounds + 2):
            c.dev_publish([f"s{size}/{i}/{j}" for j in range(k)], views)
    ctl["ready"].set()
    src = _pattern(4 * KiB, 0)
    dev = c.device_objects()
    t_pub = []
    with _profiled("owner, 4 KiB publishes (subscriber first)") as profile:
        for _ in range(2 * lat_iters):  # subscriber first: time from the publish call
            i = _get(ctl["req"], "owner: latency request (subscriber first)")
            dev.send_offers = offers_on(i)
            debug.trace_take()
            t_pub.append(time.perf_counter())
            c.dev_publish([f"lat/{i}"], [[src]])
    trace = [(t, f"owner {th}", step) for t, th, step in debug.trace_take()]
    t_pub_iso, rounds = [], []
    prev = None
    for _ in range(2 * lat_iters):  # subscriber first, isolated: the previous hand-off over on both sides first
        i = _get(ctl["req"], "owner: latency request (isolated)")
        if prev is not None:
            _wait(prev, f"owner: release of lati/{i - 1}")
        time.sleep(QUIET_S)
        dev.send_offers = offers_on(i)
        debug.trace_take()  # the previous round's release
        t_pub_iso.append(time.perf_counter())
        (prev,) = c.dev_publish([f"lati/{i}"], [[src]])
        rounds.append([(t, f"owner {th}", step) for t, th, step in debug.trace_take()])
    _wait(prev, "owner: release of the last isolated hand-off")
    dev.send_offers = True
    for _ in range(lat_iters):  # publisher first
        i = _get(ctl["req"], "owner: latency request (publisher first)")
        c.dev_publish([f"latp/{i}"], [[src]])
        ctl["pub"].put(i)
    if not ctl["done"].wait(WAIT):
        raise RuntimeError(f"owner: the reader did not finish within {WAIT:g} s")
    torch.cuda.synchronize()
    c.close()
    return {"t_pub": t_pub, "t_pub_iso": t_pub_iso, "trace": trace, "rounds": rounds, "profile": profile}


def kv_reader(address: str, sizes: list[int], quick: bool, rounds: int, lat_iters: int, ctl: dict) -> dict:
    import torch

    c = _client(address, 1)
    if not ctl["ready"].wait(WAIT):
        raise RuntimeError(f"reader: the owner did not register its keys within {WAIT:g} s")
    out: dict[str, Any] = {"mget": {}, "subscribe": {}}
    traces: dict[str, list] = {}
    for size in sizes:
        k = keys_per_call(size, quick)
        dst = torch.full((k, size), 7, dtype=torch.uint8, device=1)
        views = [[dst[j]] for j in range(k)]
        expected = _pattern(size * k, 1).view(k, size)
        for op in ("mget", "subscribe"):
            times = []
            for i in range(rounds + 2):
                keys = [f"m{size}/{j}" for j in range(k)] if op == "mget" else [f"s{size}/{i}/{j}" for j in range(k)]
                dst.fill_(7)
                torch.cuda.synchronize()
                debug.trace_take()
                t0 = time.perf_counter()
                futs = getattr(c, f"dev_{op}")(keys, views, timeout=WAIT)
                for f in futs:
                    _wait(f, f"reader: dev_{op} of {k} x {fmt_size(size)} keys, round {i}")
                times.append(time.perf_counter() - t0)
                traces[f"dev_{op} {k} x {fmt_size(size)}"] = debug.trace_take()
                if i == 0 and not torch.equal(dst, expected):
                    raise AssertionError(f"dev_{op} of {size} B keys delivered wrong bytes")
            out[op][size] = statistics.median(times[2:])
        del dst, views, expected
        torch.cuda.empty_cache()
    d = torch.zeros(4 * KiB, dtype=torch.uint8, device=1)
    t_done = []
    with _profiled("reader, 4 KiB subscribes (subscriber first)") as profile:
        for i in range(2 * lat_iters):
            (f,) = c.dev_subscribe([f"lat/{i}"], [[d]], timeout=WAIT)
            debug.trace_take()
            ctl["req"].put(i)
            _wait(f, f"reader: latency subscribe lat/{i} (subscriber first)")
            t_done.append(time.perf_counter())
    traces["4 KiB hand-off, subscriber first (reader side)"] = [
        (t, f"reader {th}", step) for t, th, step in debug.trace_take()
    ] + [(t_done[-1], "reader main", "future done")]
    t_done_iso, rounds = [], []
    for i in range(2 * lat_iters):
        time.sleep(QUIET_S)  # this side's reports of the previous hand-off sent
        (f,) = c.dev_subscribe([f"lati/{i}"], [[d]], timeout=WAIT)
        debug.trace_take()  # the subscribe call's own steps
        ctl["req"].put(i)
        _wait(f, f"reader: latency subscribe lati/{i} (isolated)")
        t_done_iso.append(time.perf_counter())
        rounds.append([(t, f"reader {th}", step) for t, th, step in debug.trace_take()])
        rounds[-1].append((t_done_iso[-1], "reader main", "future done"))
    pub_first = []
    for i in range(lat_iters):
        ctl["req"].put(i)
        _get(ctl["pub"], "reader: owner's publish (publisher first)")
        time.sleep(0.002)  # let the publish land in the broker
        debug.trace_take()
        t0 = time.perf_counter()
        _wait(c.dev_subscribe([f"latp/{i}"], [[d]], timeout=WAIT)[0], f"reader: latency subscribe latp/{i}")
        pub_first.append(time.perf_counter() - t0)
    traces["4 KiB subscribe, publisher first"] = [*debug.trace_take(), (t0 + pub_first[-1], "main", "future done")]
    if not torch.equal(d, _pattern(4 * KiB, 1)):
        raise AssertionError("4 KiB hand-off delivered wrong bytes")
    ctl["done"].set()
    c.close()
    out["t_done"] = t_done
    out["t_done_iso"] = t_done_iso
    out["rounds"] = rounds
    out["pub_first"] = pub_first
    out["traces"] = traces
    out["profile"] = profile
    return out


@contextlib.contextmanager
def _profiled(what: str) -> Any:
    """With ``KVSTRATA_BENCH_PROFILE=1``: a cProfile of this thread over the block (the caller's side of the
    calls; the trace shows the other threads' steps), its top functions by own time put in the yielded list
    (printed by :func:`run`); otherwise nothing."""
    out: list[str] = []
    if os.environ.get("KVSTRATA_BENCH_PROFILE") != "1":
        yield out
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield out
    finally:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        out.append(f"--- profile: {what}\n" + "\n".join(text.getvalue().splitlines()[4:34]))


# -- 4. broadcast --------------------------------------------------------------------------------------
BCAST_MODES = ("memcpy", "kernel")  # how hops within one GPU copy (DeviceObjectConfig.same_gpu_copy)


def bcast_modes(waits: str) -> list[tuple[str, dict[str, str]]]:
    """``(label, receiver config)`` per broadcast variant: each same_gpu_copy mode, per broadcast_wait
    (``--broadcast-wait host|stream|both``); host waits keep the bare mode name as the label."""
    chosen = ("host", "stream") if waits == "both" else (waits,)
    return [
        (m if w == "host" else f"{m}+stream-wait", {"same_gpu_copy": m, "broadcast_wait": w})
        for w in chosen
        for m in BCAST_MODES
    ]


def bcast_sender(
    address: str, nbytes: int, chunk: int, rounds: int, ctl: dict, modes: list
) -> dict[str, dict[str, list[float]]]:
    """``{"seconds": {mode: [per round]}, "t0": {mode: [perf_counter at each dev_broadcast call]}}``."""
    import torch

    c = _client(address, 0, chunk_bytes=chunk)
    src = _pattern(nbytes, 0)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    traces: dict[str, list] = {}  # the last round's steps (KVSTRATA_DEVOBJ_TRACE=1)
    for mode, _ in modes:
        for i in range(rounds):
            for _ in range(3):
                _get(ctl["ready"], f"broadcaster: receivers' subscribes ({mode}, round {i})")
            time.sleep(0.005)  # the receivers' subscribes are registered before they said so
            debug.trace_take()
            t0 = time.perf_counter()
            _wait(c.dev_broadcast(f"b-{mode}-{i}", [src], receivers=3), f"broadcaster: broadcast ({mode}, round {i})")
            times.setdefault(mode, []).append(time.perf_counter() - t0)
            starts.setdefault(mode, []).append(t0)
            traces[mode] = [(t, f"sender {th}", step) for t, th, step in debug.trace_take()]
            traces[mode] += [(t0, "sender main", "dev_broadcast call"), (t0 + times[mode][-1], "sender main", "done")]
    c.close()
    return {"seconds": times, "t0": starts, "traces": traces}


def bcast_receiver(address: str, device: int, nbytes: int, rounds: int, ctl: dict, modes: list) -> dict[str, Any]:
    """Per mode and round: this receiver's chain position and when its last chunk landed (perf_counter,
    the node's monotonic clock, comparable with the sender's ``t0``)."""
    import torch

    dst = torch.full((nbytes,), 7, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    landed: dict[str, list[dict[str, float]]] = {}
    traces: dict[str, list] = {}
    for mode, cfg in modes:
        c = _client(address, device, **cfg)
        for i in range(rounds):
            dst.fill_(7)
            torch.cuda.synchronize()
            (f,) = c.dev_subscribe([f"b-{mode}-{i}"], [[dst]], timeout=WAIT)
            debug.trace_take()
            ctl["ready"].put(device)
            _wait(f, f"receiver on GPU{device}: broadcast ({mode}, round {i})")
            traces[mode] = [(t, f"GPU{device} {th}", step) for t, th, step in debug.trace_take()]
            entry = next(e for e in reversed(c.device_objects().broadcast_log()) if e["key"] == f"b-{mode}-{i}")
            mark = {"position": entry["position"], "copied": entry["copied"], "role": entry.get("role", "")}
            landed.setdefault(mode, []).append(mark)
            if i == 0 and not torch.equal(dst, _pattern(nbytes, device)):
                raise AssertionError(f"broadcast ({mode} hops) receiver on GPU{device} got wrong bytes")
        c.close()
    return {"device": device, "landed": landed, "traces": traces}


def bcast_finish_ms(sender: dict, receivers: list[dict]) -> dict[str, list[dict[str, Any]]]:
    """Per mode, per chain position: when that receiver's last chunk landed, ms after the broadcast call
    (median over the rounds after the first; which process holds a position may change between rounds)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for mode, t0s in sender["t0"].items():
        by_pos: dict[int, list[float]] = {}
        device: dict[int, int] = {}
        for r in receivers:
            for rnd, (mark, t0) in enumerate(zip(r["landed"][mode], t0s)):
                if rnd or len(t0s) == 1:
                    by_pos.setdefault(mark["position"], []).append((mark["copied"] - t0) * 1e3)
                    device[mark["position"]] = (r["device"], mark.get("role", ""))
        rows = sorted(by_pos.items())
        out[mode] = [
            {"position": p, "device": device[p][0], "role": device[p][1], "ms": round(statistics.median(v), 2)}
            for p, v in rows
        ]
    return out


# -- driver ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    global WAIT
    if getattr(args, "wait", None):
        WAIT = float(args.wait)
        os.environ["KVSTRATA_BENCH_WAIT"] = str(WAIT)  # the spawned processes read it at import
    if args.smoke:
        return smoke(args)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("kvstrata bench device: needs 2 CUDA GPUs (use --smoke for the CPU-only broker timings)")
        return 2
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    quick = args.quick
    sizes = QUICK_SIZES if quick else SIZES
    rounds = args.rounds or (4 if quick else 10)
    lat_iters = 50 if quick else 200
    bcast_bytes = int((args.broadcast_gib or (2 if quick else 8)) * GiB)
    if args.chunk_mib is None:
        from kvstrata.devobj import DeviceObjectConfig

        chunk = DeviceObjectConfig.chunk_bytes  # the default the library ships with
    else:
        chunk = args.chunk_mib * MiB
    bcast_rounds = 2 if quick else 3
    modes = bcast_modes(args.broadcast_wait)
    t_start = time.perf_counter()

    peer = torch.cuda.can_device_access_peer(0, 1)
    print(f"[1/4] peer copy GPU0 -> GPU1 (ceiling); can_access_peer={peer}", flush=True)
    ceiling = peer_copy(sizes, quick, rounds)
    single = _single_copy(bcast_bytes)

    print("[2/4] NCCL send/recv between two processes", flush=True)
    port = _free_port()
    nccl = _spawn([(nccl_rank, r, port, sizes, quick, rounds) for r in range(2)])["nccl_rank"]
    nccl = next(x for x in nccl if x)

    with tempfile.TemporaryDirectory() as tmp:
        # KVSTRATA_SPIN_US, as for `kvstrata worker`: how long connection threads poll for requests (0: never)
        spin = float(os.environ.get("KVSTRATA_SPIN_US", WorkerConfig.spin_us))
        config = WorkerConfig(socket=str(Path(tmp) / "kv.sock"), memory=64 << 20, disk_dir="", spin_us=spin)
        worker = Worker(config).start()
        try:
            print("[3/4] kvstrata dev_mget / dev_subscribe GPU0 -> GPU1, 4 KiB latency", flush=True)
            ctx = _ctx()
            ctl = {"ready": ctx.Event(), "done": ctx.Event(), "req": ctx.Queue(), "pub": ctx.Queue()}
            kv = _spawn(
                [
                    (kv_owner, worker.address, sizes, quick, rounds, lat_iters, ctl),
                    (kv_reader, worker.address, sizes, quick, rounds, lat_iters, ctl),
                ]
            )
            reader, owner = kv["kv_reader"][0], kv["kv_owner"][0]
            print(f"[4/4] broadcast {fmt_size(bcast_bytes)} GPU0 -> 3 receivers (GPU1, GPU0, GPU1)", flush=True)
            ctl = {"ready": ctx.Queue()}
            bc = _spawn(
                [(bcast_sender, worker.address, bcast_bytes, chunk, bcast_rounds, ctl, modes)]
                + [(bcast_receiver, worker.address, d, bcast_bytes, bcast_rounds, ctl, modes) for d in (1, 0, 1)]
            )
        except BaseException:
            snap = getattr(worker, "devobj_broker", None)
            print(f"broker state at the failure: {snap.snapshot() if snap is not None else None}", flush=True)
            raise
        finally:
            worker.stop()
    sender = bc["bcast_sender"][0]
    bcast_times = {m: statistics.median(ts[1:]) for m, ts in sender["seconds"].items()}
    finish = bcast_finish_ms(sender, bc["bcast_receiver"])
    bcast_mode = min(bcast_times, key=bcast_times.get)
    bcast_time = bcast_times[bcast_mode]

    if debug.TRACING:
        traces = dict(reader["traces"])
        hand = "4 KiB hand-off, subscriber first (reader side)"
        traces[hand] = sorted(owner["trace"] + traces[hand])  # one monotonic clock for the node
        for mode, stamps in sender.get("traces", {}).items():
            merged = stamps + [x for r in bc["bcast_receiver"] for x in r.get("traces", {}).get(mode, [])]
            traces[f"broadcast ({mode}), last round"] = sorted(merged)
        for name, stamps in traces.items():
            if stamps:
                print(f"--- trace: {name}\n{debug.trace_format(stamps)}", flush=True)
        skip = min(10, len(owner["rounds"]) // 5)
        pairs = enumerate(zip(owner["rounds"], reader["rounds"]))
        merged = [a + b for i, (a, b) in pairs if i >= skip and offers_on(i)]
        what = "isolated 4 KiB hand-offs with offers (from the publish call)"
        print(f"--- median per step, {what}\n{debug.trace_medians(merged)}")
    for text in owner.get("profile", []) + reader.get("profile", []):
        print(text, flush=True)

    def split(done: list[float], pub: list[float]) -> tuple[list[float], list[float]]:  # (offers on, off)
        lat = [d - p for d, p in zip(done, pub)]
        return [x for i, x in enumerate(lat) if offers_on(i)], [x for i, x in enumerate(lat) if not offers_on(i)]

    latency, latency_no = split(reader["t_done"], owner["t_pub"])
    lat_us = statistics.median(latency) * 1e6
    latency_iso, latency_iso_no = split(reader["t_done_iso"], owner["t_pub_iso"])
    lat_iso_us = statistics.median(latency_iso) * 1e6
    lat_iso_p90_us = sorted(latency_iso)[int(0.9 * (len(latency_iso) - 1))] * 1e6
    lat_pub_first_us = statistics.median(reader["pub_first"]) * 1e6
    rows, per_size = [], {}
    for size in sizes:
        k = keys_per_call(size, quick)
        n = size * k
        entry = {
            "keys_per_call": k,
            "peer_copy_GBps": gbps(n, ceiling[size]),
            "nccl_GBps": gbps(n, nccl[size]),
            "dev_mget_GBps": gbps(n, reader["mget"][size]),
            "dev_subscribe_GBps": gbps(n, reader["subscribe"][size]),
        }
        entry["mget_of_ceiling"] = round(ceiling[size] / reader["mget"][size], 3)
        entry["subscribe_of_ceiling"] = round(ceiling[size] / reader["subscribe"][size], 3)
        per_size[size] = entry
        rows.append(
            {
                "key size": fmt_size(size),
                "keys/call": k,
                "peer copy GB/s": entry["peer_copy_GBps"],
                "NCCL GB/s": entry["nccl_GBps"],
                "dev_mget GB/s": entry["dev_mget_GBps"],
                "mget/ceiling": entry["mget_of_ceiling"],
                "dev_subscribe GB/s": entry["dev_subscribe_GBps"],
                "sub/ceiling": entry["subscribe_of_ceiling"],
            }
        )
    big = [s for s in sizes if s >= 64 * MiB]
    result = {
        "sizes": per_size,
        "latency_4KiB_us": {
            "subscriber_first_end_to_end": round(lat_us, 1),
            "subscriber_first_end_to_end_isolated": round(lat_iso_us, 1),
            "subscriber_first_end_to_end_isolated_p90": round(lat_iso_p90_us, 1),
            "publisher_first_subscribe_call": round(lat_pub_first_us, 1),
            "samples": len(latency),
            # the same hand-offs without direct offers, in the same run, round by round (the broker alone)
            "without_offers": {
                "subscriber_first_end_to_end": round(statistics.median(latency_no) * 1e6, 1),
                "subscriber_first_end_to_end_isolated": round(statistics.median(latency_iso_no) * 1e6, 1),
                "samples": len(latency_no),
            },
        },
        "broadcast": {
            "bytes": bcast_bytes,
            "receivers": 3,
            "chunk_bytes": chunk,
            "chunk_bytes_used": chunk_size([{"nbytes": bcast_bytes}], chunk),
            "seconds": bcast_time,
            "single_peer_copy_seconds": single,
            "ratio_to_single_copy": round(bcast_time / single, 3),
            "best_same_gpu_copy": bcast_mode,
            "ratio_by_same_gpu_copy": {m: round(t / single, 3) for m, t in bcast_times.items()},
            "all_rounds_seconds": sender["seconds"],
            "receiver_finish_ms_by_same_gpu_copy": finish,
        },
        "targets": {
            "mget_and_subscribe_>=64MiB_>=0.9_of_ceiling": all(
                per_size[s]["mget_of_ceiling"] >= 0.9 and per_size[s]["subscribe_of_ceiling"] >= 0.9 for s in big
            ),
            "latency_4KiB_<=200us": lat_iso_us <= 200,
            "broadcast_<=1.2x_single_copy": bcast_time / single <= 1.2,
        },
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    path = write_result("device_quick" if quick else "device", result, args.out)
    _plot(per_size, Path(path).with_suffix(".png"))
    print(f"results: {path}")
    print(
        f"4 KiB hand-off: {lat_iso_us:.0f} us end to end (subscriber first; p90 {lat_iso_p90_us:.0f}), {lat_us:.0f} us "
        f"with the next started as each ends (without offers: {statistics.median(latency_iso_no) * 1e6:.0f} / "
        f"{statistics.median(latency_no) * 1e6:.0f} us), {lat_pub_first_us:.0f} us subscribe call "
        f"(publisher first); broadcast {fmt_size(bcast_bytes)} to 3: {bcast_time * 1e3:.1f} ms = "
        f"{bcast_time / single:.2f}x one peer copy ({single * 1e3:.1f} ms; same-GPU hops by {bcast_mode}, "
        f"ratios {result['broadcast']['ratio_by_same_gpu_copy']}); targets {result['targets']}"
    )
    print_table(rows)
    print_table(
        [
            {
                "broadcast variant": m,
                "broadcast ms": round(bcast_times[m] * 1e3, 2),
                "x one peer copy": result["broadcast"]["ratio_by_same_gpu_copy"][m],
                "receivers done at ms (chain order)": ", ".join(
                    f"GPU{r['device']}{' ' + r['role'][0] if r.get('role') else ''} {r['ms']}" for r in finish[m]
                ),
            }
            for m in bcast_times
        ]
    )
    return 0


def _plot(per_size: dict[int, dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    sizes = sorted(per_size)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for field, label in (
        ("peer_copy_GBps", "peer copy (ceiling)"),
        ("nccl_GBps", "NCCL send/recv"),
        ("dev_mget_GBps", "kvstrata dev_mget"),
        ("dev_subscribe_GBps", "kvstrata dev_subscribe"),
    ):
        ax.plot(sizes, [per_size[s][field] for s in sizes], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [fmt_size(s) for s in sizes], rotation=30)
    ax.set_xlabel("bytes per key")
    ax.set_ylabel("GB/s (GPU0 -> GPU1, per call)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# -- smoke (CPU) -------------------------------------------------------------------------------------
def smoke(args: argparse.Namespace) -> int:
    """Broker and client logic timings with CPU tensors through an in-process broker (no GPU)."""
    import torch

    from kvstrata.bench._common import host_time
    from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink

    broker = DeviceBroker()
    cfg = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05)
    a = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=cfg)
    b = DeviceObjects(InprocBrokerLink(broker), device="cpu", config=cfg)
    src, dst = [torch.arange(1024, dtype=torch.int32)], [torch.zeros(1024, dtype=torch.int32)]
    counter = iter(range(1 << 30))
    try:

        def handoff_pub_first() -> None:
            key = f"p{next(counter)}"
            (pf,) = a.dev_publish([key], [src])
            b.dev_subscribe([key], [dst], timeout=10)[0].result(10)
            pf.result(10)

        def handoff_sub_first() -> None:
            key = f"q{next(counter)}"
            (sf,) = b.dev_subscribe([key], [dst], timeout=10)
            (pf,) = a.dev_publish([key], [src])
            sf.result(10)
            pf.result(10)

        a.dev_mset(["w"], [src])
        n_keys = 256
        a.dev_mset([f"w{j}" for j in range(n_keys)], [src] * n_keys)
        many = [[torch.zeros(1024, dtype=torch.int32)] for _ in range(n_keys)]

        def mget_one() -> None:
            b.dev_mget(["w"], [dst], timeout=10)[0].result(10)

        def mget_batch() -> None:
            for f in b.dev_mget([f"w{j}" for j in range(n_keys)], many, timeout=10):
                f.result(10)

        rb = DeviceBroker()
        rb.handle("p", "hello", {"info": {}})
        rb.handle("s", "hello", {"info": {}})
        item = {"tensors": [{"shape": [1], "dtype": "uint8", "nbytes": 1}], "handles": [], "events": []}

        def broker_cycle() -> None:
            key = f"k{next(counter)}"
            rb.handle("p", "publish", {"items": [dict(item, key=key)]})
            t = rb.handle("s", "subscribe", {"keys": [key]})["results"][0]["transfer"]
            rb.handle("s", "complete", {"tid": t["tid"], "ok": True})
            rb.handle("p", "wait_events", {"timeout": 0})

        timings = {
            "broker_publish_subscribe_complete_us": host_time(broker_cycle, iters=200) * 1e6,
            "handoff_publisher_first_us": host_time(handoff_pub_first, iters=50) * 1e6,
            "handoff_subscriber_first_us": host_time(handoff_sub_first, iters=50) * 1e6,
            "mget_one_key_us": host_time(mget_one, iters=50) * 1e6,
            f"mget_{n_keys}_keys_per_key_us": host_time(mget_batch, iters=10) * 1e6 / n_keys,
        }
        if not torch.equal(dst[0], src[0]) or not all(torch.equal(m[0], src[0]) for m in many):
            raise AssertionError("smoke: wrong bytes delivered")
    finally:
        a.close()
        b.close()
    timings = {k: round(v, 1) for k, v in timings.items()}
    path = write_result(
        "device_smoke", {"mode": "smoke (CPU tensors, in-process broker)", "timings": timings}, args.out
    )
    print(f"results: {path}")
    print_table([{"what": k, "value": v} for k, v in timings.items()])
    return 0


__all__ = ["add_arguments", "run", "smoke"]
