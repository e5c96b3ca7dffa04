"""``kvstrata bench allgather``: the hybrid all-gather beside plain NCCL and the host path alone.

Spawns one worker per GPU (NCCL, ``NCCL_NVLS_ENABLE=0``: no NVLink multicast) and times, per size
per rank, in one run: ``all_gather_into_tensor`` (the baseline), the host path alone (ratio 1, the
PCIe leg in isolation), the hybrid at ratios 2/4/8/16 and ``ratio="auto"``, while a bf16 matmul
keeps running on a side stream (as the seed's test does; ``--no-load`` turns it off). Bus bandwidth
follows nccl-tests: ``algbw * (n - 1) / n`` with ``algbw = output bytes / time``; a time is the
slowest rank's mean over a batch of calls, median of three batches.

``--smoke``: two CPU processes over gloo at tiny sizes (for a test, not a figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

MIB = 1 << 20
FULL_SIZES = [4, 16, 64, 256, 1024]  # MiB per rank
QUICK_SIZES = [4, 64, 512]
SMOKE_SIZES_BYTES = [64 << 10, 1 << 20]  # the second one runs the auto measurement
RATIOS = [2, 4, 8, 16]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="three sizes, fewer iterations (< 90 s on 2 GPUs)")
    parser.add_argument("--smoke", action="store_true", help="gloo + CPU, 2 processes, tiny sizes (tests)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="MiB per rank (default 4..1024)")
    parser.add_argument("--gpus", type=int, default=None, help="number of GPUs (default: all)")
    parser.add_argument("--iters", type=int, default=None, help="calls per timed batch")
    parser.add_argument("--no-load", action="store_true", help="no matmul on a side stream")
    parser.add_argument(
        "--cross-node", choices=["relay", "direct"], default="relay", help="how ranks on different NUMA nodes meet"
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.multiprocessing as mp

    from kvstrata.bench._common import print_table, write_result

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (inherited by the workers)
    if args.smoke:
        backend, world = "gloo", 2
        sizes = SMOKE_SIZES_BYTES
        iters = args.iters or 2
    else:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            print("kvstrata bench allgather: needs two or more CUDA GPUs (use --smoke for a CPU run)")
            return 2
        backend, world = "nccl", args.gpus or torch.cuda.device_count()
        sizes = [s * MIB for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES))]
        iters = args.iters or (5 if args.quick else 10)
    config = {
        "backend": backend,
        "world": world,
        "sizes": sizes,
        "iters": iters,
        "load": not (args.no_load or args.smoke),
        "cross_node": getattr(args, "cross_node", "relay"),
    }
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-ag-") as tmp:
        out_file = Path(tmp, "rows.json")
        mp.spawn(_worker, args=(config, str(Path(tmp, "store")), str(out_file)), nprocs=world, join=True)
        gathered = json.loads(out_file.read_text())
    rows = gathered["rows"]
    config["numa_node_of_rank"] = gathered["numa_node_of_rank"]
    summary = _summarize(rows, backend)
    name = "allgather_smoke" if args.smoke else "allgather"
    path = write_result(name, {"config": config, "rows": rows, "summary": summary}, args.out)
    _plot(rows, path.with_suffix(".png"))
    print(f"results: {path}")
    print_table(summary)
    return 0


# --- workers -------------------------------------------------------------------------------------


def _worker(rank: int, config: dict, store: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from kvstrata.comm import HybridAllGather

    world, backend = config["world"], config["backend"]
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16
    ag = HybridAllGather(ratio="auto", timeout=120.0, cross_node=config["cross_node"])
    load = _MatmulLoad(device) if config["load"] and cuda else None
    rows = []
    try:
        for size in config["sizes"]:
            count = size // 2
            inp = torch.randn(count, device=device).to(dtype)
            out = torch.empty(world * count, dtype=dtype, device=device)
            ref = torch.empty_like(out)
            dist.all_gather_into_tensor(ref, inp)
            methods: list[tuple[str, int | str | None]] = [("nccl", None), ("host", 1)]
            methods += [(f"hybrid r={r}", r) for r in RATIOS] + [("hybrid auto", "auto")]
            fns = {}
            for name, ratio in methods:
                if ratio is None:
                    fn = lambda out=out, inp=inp: dist.all_gather_into_tensor(out, inp)
                else:
                    fn = lambda out=out, inp=inp, ratio=ratio: ag.all_gather(out, inp, ratio=ratio)
                fns[name] = fn
                row = {"size_mib": round(size / MIB, 3), "method": name, "ratio": ratio}
                try:
                    if load is not None:  # on before the first call: auto measures under the same load
                        load.start()
                    out.zero_()
                    fn()
                    _sync(cuda)
                    ok = torch.tensor([int(torch.equal(out, ref))], device=device)
                    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                    row["correct"] = bool(ok.item())
                    seconds = _time(fn, iters=config["iters"], device=device)
                except RuntimeError as exc:  # the same on every rank (setup failures agree collectively)
                    row["error"] = str(exc)[:200]
                    seconds = None
                finally:
                    if load is not None:
                        load.stop()
                if seconds is not None:
                    algbw = world * size / seconds / 1e9
                    # (3 significant digits: a small smoke run on a busy CPU moves well under 0.01 GB/s, not 0)
                    busbw = float(f"{algbw * (world - 1) / world:.3g}")
                    row.update(ms=float(f"{seconds * 1e3:.4g}"), busbw_gbs=busbw)
                if ratio == "auto":
                    choice = ag.auto_choices.get((world, str(dtype), size.bit_length() - 1))
                    row["auto_choice"] = "nccl" if not choice or not choice[0] else f"r={choice[0]} {choice[1]}"
                elif ratio is not None and ratio > 1:
                    row["head"] = ag.default_head
                rows.append(row)
            if load is not None:
                load.start()
            try:  # the target's ratio, from alternating batches: drift in the load hits both alike
                t_nccl, t_auto = _paired(fns["nccl"], fns["hybrid auto"], iters=config["iters"], device=device)
            finally:
                if load is not None:
                    load.stop()
            rows.append(
                {
                    "size_mib": round(size / MIB, 3),
                    "method": "paired",
                    "nccl_ms": round(t_nccl * 1e3, 3),
                    "auto_ms": round(t_auto * 1e3, 3),
                    "auto_over_nccl": round(t_auto / t_nccl, 3),
                }
            )
            del inp, out, ref, fn, fns
        if rank == 0:
            Path(out_file).write_text(json.dumps({"rows": rows, "numa_node_of_rank": list(ag.topology.node_of)}))
    finally:
        ag.close()
        if load is not None:
            load.close()
        dist.barrier()
        dist.destroy_process_group()


def _sync(cuda: bool) -> None:
    # The current stream only: every all-gather path orders its result on it, while a device-wide
    # synchronize would also wait for the background matmul load and time that instead.
    if cuda:
        import torch

        torch.cuda.current_stream().synchronize()


def _batch_medians(fns: list, *, iters: int, device, batches: int) -> list[float]:
    """Per function: the median over ``batches`` of its mean seconds per call, each batch timed on the
    slowest rank, the functions' batches alternating (drift in a background load hits each alike)."""
    import torch
    import torch.distributed as dist

    cuda = device.type == "cuda"
    for fn in fns:
        for _ in range(2):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(batches):
        for i, fn in enumerate(fns):
            _sync(cuda)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            _sync(cuda)
            times[i].append((time.perf_counter() - t0) / iters)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [statistics.median(row) for row in t.tolist()]


def _time(fn, *, iters: int, device) -> float:
    """Slowest rank's mean seconds per call over a batch, median of three batches (after warm-up)."""
    return _batch_medians([fn], iters=iters, device=device, batches=3)[0]


def _paired(base, other, *, iters: int, device, batches: int = 7) -> tuple[float, float]:
    """Median seconds per call of ``base`` and ``other`` timed in alternating batches (slowest rank)."""
    a, b = _batch_medians([base, other], iters=iters, device=device, batches=batches)
    return a, b


class _MatmulLoad:
    """A bf16 matmul kept running on a side stream (at most two in flight) while a method is timed.

    One thread for the whole run, switched on and off: ``start`` returns only once a matmul has
    finished since it was switched on. (A fresh thread per method first creates its cuBLAS handle
    and workspace: the first method timed, the NCCL baseline, then ran with no load at all - 0.04 ms
    at 4 MiB against 0.9 ms under load on the H200 pair.)
    """

    def __init__(self, device, n: int = 8192) -> None:
        import torch

        self.device = device
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream(device)
        self._on = threading.Event()
        self._running = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._quit = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def start(self) -> None:
        self._running.clear()
        self._idle.clear()
        self._on.set()
        if not self._running.wait(60):
            raise RuntimeError("matmul load did not start within 60 s")

    def stop(self) -> None:
        self._on.clear()
        self._idle.wait(60)
        self.stream.synchronize()

    def close(self) -> None:
        self._quit = True
        self._on.set()
        self._thread.join(60)

    def _loop(self) -> None:
        import torch

        torch.cuda.set_device(self.device)
        while not self._quit:
            if not self._on.wait(0.1):
                continue
            pending: list = []
            while self._on.is_set() and not self._quit:
                with torch.cuda.stream(self.stream):
                    torch.matmul(self.a, self.b, out=self.c)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                pending.append(ev)
                if len(pending) > 2:
                    pending.pop(0).synchronize()
                    self._running.set()
            for ev in pending:
                ev.synchronize()
            self._running.set()
            self._idle.set()


# --- report --------------------------------------------------------------------------------------


def _summarize(rows: list[dict], backend: str = "nccl") -> list[dict]:
    """One line per size: baseline, host path alone, best fixed split, auto, and the issue's targets. The baseline
    (the row named "nccl": ``all_gather_into_tensor``) is labelled by the backend it ran on (gloo in ``--smoke``).
    A method whose result was wrong is no candidate for the best fixed split, and auto's target needs its result
    right."""
    out = []
    for size in sorted({r["size_mib"] for r in rows}):
        at = {r["method"]: r for r in rows if r["size_mib"] == size}
        nccl, host, auto = at.get("nccl", {}), at.get("host", {}), at.get("hybrid auto", {})
        paired = at.pop("paired", {})
        fixed = [r for m, r in at.items() if m.startswith("hybrid r=") and "ms" in r and r.get("correct") is True]
        best = min(fixed, key=lambda r: r["ms"]) if fixed else {}
        auto_right = auto.get("correct") is True and nccl.get("correct") is True
        line = {
            "MiB/rank": size,
            f"{backend} GB/s": nccl.get("busbw_gbs"),
            "host GB/s": host.get("busbw_gbs"),
            "best fixed": best.get("method", "-").replace("hybrid ", "") + (f" {best['head']}" if best else ""),
            "best GB/s": best.get("busbw_gbs"),
            "auto": auto.get("auto_choice"),
            "auto GB/s": auto.get("busbw_gbs"),
        }
        if "auto_over_nccl" in paired:  # alternating batches: the figure the target is judged on
            line[f"auto/{backend} time"] = paired["auto_over_nccl"]
            line["<=1.03"] = paired["auto_over_nccl"] <= 1.03 and auto_right
        elif "ms" in nccl and "ms" in auto:
            line[f"auto/{backend} time"] = round(auto["ms"] / nccl["ms"], 3)
            line["<=1.03"] = auto["ms"] <= 1.03 * nccl["ms"] and auto_right
        if "busbw_gbs" in nccl and host.get("busbw_gbs"):
            if best:
                line["gain/host best"] = round((best["busbw_gbs"] - nccl["busbw_gbs"]) / host["busbw_gbs"], 3)
            if "busbw_gbs" in auto and auto_right:
                line["gain/host auto"] = round((auto["busbw_gbs"] - nccl["busbw_gbs"]) / host["busbw_gbs"], 3)
        line["all correct"] = all(r.get("correct", False) for r in at.values() if "error" not in r)
        out.append(line)
    return out


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["size_mib"], r["busbw_gbs"]) for r in rows if r["method"] == method and "busbw_gbs" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("MiB per rank")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("all-gather: NCCL, host path, hybrid")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


__all__ = ["add_arguments", "run"]
