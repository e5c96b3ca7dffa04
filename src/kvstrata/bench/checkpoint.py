"""``kvstrata bench checkpoint``: a model's weights handed from one process to another through kvstrata, against
``torch.save`` / ``torch.load`` through a file in ``/dev/shm`` (RAM: the fastest file a node has) and, on a GPU,
the pinned-memory DMA ceiling.

The weights: a decoder's shapes (``--layers`` layers of ``--hidden`` width: attention and MLP matrices, norms; bf16),
on the GPU when there is one. A worker process holds the checkpoint. Rows, each the median of ``--iters`` runs:

* ``kvstrata save``: :func:`~kvstrata.integrations.save_state_dict` through the worker, into the room the previous
  run's checkpoint left (deleted after its load, untimed); ``first_save_ms``: the first save, into fresh memory;
* ``kvstrata load``: :func:`~kvstrata.integrations.load_state_dict` into another model's tensors (``into=``);
* ``torch.save file`` / ``torch.load file``: the same weights to a file in /dev/shm and back (``map_location``
  the weights' device, then each copied into the other model's tensors, as ``load_state_dict`` does);
* ``dma`` (GPU only): one pinned host-to-device ``copy_`` of the same bytes.

Every load is checked bit for bit. ``vs_torch``: the torch row's time over kvstrata's (the same direction);
``of_dma``: the DMA time over the row's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench._common import gbps, positive, print_table, write_result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=positive(int), default=None, help="decoder layers (GPU 8, CPU 2)")
    parser.add_argument("--hidden", type=positive(int), default=None, help="hidden width (GPU 4096, CPU 1024)")
    parser.add_argument("--iters", type=positive(int), default=5, help="timed runs per row (default 5)")
    parser.add_argument("--name", default=None, help="the result file's name (default checkpoint_gpu / _cpu)")


def weights(layers: int, hidden: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """A decoder's state_dict shapes (Llama-like: 4 attention matrices, 3 MLP ones of 3.5x width, 2 norms)."""
    g = torch.Generator(device=device).manual_seed(seed)
    mlp = hidden * 7 // 2
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name, shape in (
            ("attn.q", (hidden, hidden)), ("attn.k", (hidden // 4, hidden)), ("attn.v", (hidden // 4, hidden)),
            ("attn.o", (hidden, hidden)), ("mlp.gate", (mlp, hidden)), ("mlp.up", (mlp, hidden)),
            ("mlp.down", (hidden, mlp)), ("norm1", (hidden,)), ("norm2", (hidden,)),
        ):  # fmt: skip
            out[f"layers.{i}.{name}"] = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
    return out


def _median(fn: Any, iters: int, sync: Any) -> float:
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import kvstrata
    from kvstrata.bench.store import _start_worker, _stop
    from kvstrata.integrations import delete_checkpoint, load_state_dict, save_state_dict

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    layers = args.layers or (8 if cuda else 2)
    hidden = args.hidden or (4096 if cuda else 1024)
    src = weights(layers, hidden, device, seed=1)
    dst = weights(layers, hidden, device, seed=2)
    nbytes = sum(t.nbytes for t in src.values())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"{len(src)} tensors, {nbytes / 2**20:.0f} MiB of bf16 on {device}", flush=True)
    rows: list[dict[str, Any]] = []
    correct = True

    def check() -> None:
        nonlocal correct
        correct &= all(torch.equal(src[k], dst[k]) for k in src)
        for t in dst.values():
            t.zero_()

    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-ckpt-") as tmp:
        proc, address = _start_worker(Path(tmp), 2 * nbytes + (256 << 20))
        try:
            with kvstrata.connect(address, timeout=30) as kv:
                sync()
                start = time.perf_counter()
                save_state_dict(kv, "warm", src)  # (into fresh memory: the worker's segments, this client's mappings)
                sync()
                t_first = time.perf_counter() - start
                load_state_dict(kv, "warm", into=dst)
                check()
                delete_checkpoint(kv, "warm")
                saves, loads = [], []
                for _ in range(args.iters):  # each save into the room the last one freed, as a service's updates
                    sync()
                    start = time.perf_counter()
                    save_state_dict(kv, "m", src)
                    sync()
                    saves.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    load_state_dict(kv, "m", into=dst)
                    sync()
                    loads.append(time.perf_counter() - start)
                    check()
                    delete_checkpoint(kv, "m")
                t_save, t_load = statistics.median(saves), statistics.median(loads)
        finally:
            _stop(proc)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = Path(shm) / f"kvstrata-bench-{os.getpid()}.pt"
    try:
        t_tsave = _median(lambda: torch.save(src, path), args.iters, sync)

        def torch_load() -> None:
            loaded = torch.load(path, map_location=device)
            for k, t in loaded.items():
                dst[k].copy_(t)

        t_tload = _median(torch_load, args.iters, sync)
        check()
    finally:
        path.unlink(missing_ok=True)
    t_dma = None
    if cuda:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t_dma = _median(lambda: flat.copy_(host, non_blocking=True), args.iters, sync)
    for row, seconds, base in (
        ("kvstrata save", t_save, t_tsave),
        ("kvstrata load", t_load, t_tload),
        ("torch.save file", t_tsave, t_tsave),
        ("torch.load file", t_tload, t_tload),
    ):
        rows.append(
            {
                "row": row,
                "ms": round(seconds * 1e3, 2),
                "GBps": round(gbps(nbytes, seconds), 2),
                "vs_torch": round(base / seconds, 2),
                "of_dma": round(t_dma / seconds, 3) if t_dma else None,
            }
        )
    if t_dma:
        rows.append(
            {"row": "dma h2d", "ms": round(t_dma * 1e3, 2), "GBps": round(gbps(nbytes, t_dma), 2), "of_dma": 1.0}
        )
    print_table(rows)
    print(f"first save (fresh memory): {t_first * 1e3:.1f} ms; loads match the saved weights bit for bit: {correct}")
    path = write_result(
        args.name or f"checkpoint_{'gpu' if cuda else 'cpu'}",
        {
            "benchmark": "checkpoint",
            "device": device,
            "tensors": len(src),
            "bytes": nbytes,
            "layers": layers,
            "hidden": hidden,
            "iters": args.iters,
            "first_save_ms": round(t_first * 1e3, 2),
            "file_folder": shm,
            "rows": rows,
            "correct": correct,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0 if correct else 1
