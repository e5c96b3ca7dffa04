"""What a small gather from host memory can reach: 1,024 / 16,384 rows of 1 KiB against one DMA of the same bytes.

Issue 4 asks ``gather`` of 1,024 rows of 1 KiB (1 MiB) for 10x ``table[ids].to("cuda")``. This probe puts the
gather beside the hardware's floor for the same bytes, each timed two ways:

* ``cold``: ``calls`` back-to-back calls between two events (the first call's host work runs while the GPU
  waits, so it counts; how ``bench._common.device_time`` timed streamed rates up to session 7);
* ``primed``: one call queued before the start event, so every timed call's host work overlaps the call before
  it (the rate of an engine that issues gathers back to back; ``device_time``'s streamed rates since session 8).

Rows: kvstrata ``gather`` (random ids on the device), the same with sorted contiguous ids, torch's
``index_select`` on a device view of the table, one pinned DMA of the same number of contiguous bytes, and
``table[ids].to("cuda")`` (host clock).

Run: ``PYTHONPATH=src python tools/probe_gather_floor.py [--calls 4] [--iters 200]``
"""

from __future__ import annotations

import argparse

import torch

from kvstrata.bench._common import device_time, host_time
from kvstrata.memory import alloc_pinned, device_view
from kvstrata.ops import gather


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    row_bytes, n_table = 1024, 256 * 1024
    table = alloc_pinned(n_table * row_bytes).view(torch.float16).view(n_table, row_bytes // 2)
    view = device_view(table)
    view.view(torch.int16).random_(0, 30000)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}; calls per sample {args.calls}, {args.iters} samples; medians in us")
    print(f"{'rows':>6} {'method':<28} {'cold':>8} {'primed':>8} {'GB/s primed':>12} {'x to_cuda (primed)':>19}")
    for n in (1024, 16384):
        ids = torch.randint(0, n_table, (n,), device="cuda")
        ids_sorted_run = torch.arange(n, device="cuda") + 4096
        ids_cpu = ids.cpu()
        out = torch.empty(n, row_bytes // 2, dtype=torch.float16, device="cuda")
        flat = table.view(-1).view(torch.uint8)[: n * row_bytes]
        sink = torch.empty(n * row_bytes, dtype=torch.uint8, device="cuda")

        def to_cuda() -> None:
            out.copy_(table[ids_cpu].to("cuda"))
            torch.cuda.synchronize()

        base = host_time(to_cuda, warmup=1, iters=max(20, args.iters // 4))
        methods = {
            "kvstrata gather": lambda: gather(table, out, ids, check=False),
            "kvstrata gather, one run": lambda: gather(table, out, ids_sorted_run, check=False),
            "index_select (device view)": lambda: torch.index_select(view, 0, ids, out=out),
            "one DMA of the same bytes": lambda: sink.copy_(flat, non_blocking=True),
        }
        for name, fn in methods.items():
            cold = device_time(fn, iters=args.iters, calls=args.calls, prime=False)
            primed = device_time(fn, iters=args.iters, calls=args.calls, prime=True)
            gbs = n * row_bytes / primed / 1e9
            print(f"{n:>6} {name:<28} {cold * 1e6:>8.1f} {primed * 1e6:>8.1f} {gbs:>12.2f} {base / primed:>19.1f}")
        gather(table, out, ids, check=False)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), table[ids_cpu]), "gather delivered wrong rows"
        print(f"{n:>6} {'table[ids].to(cuda) (host)':<28} {base * 1e6:>8.1f}")


if __name__ == "__main__":
    main()
