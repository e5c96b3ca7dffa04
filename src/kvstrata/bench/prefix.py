"""``kvstrata bench prefix``: an engine's KV offload and prefix reuse through ``PrefixKVCache``, against DMA.

A paged KV cache of a real model's geometry (default Llama-3-8B: 32 layers, 8 KV heads of 128, bf16, 16-token
blocks: 2 MiB a block, in 64 pieces of 32 KiB) on the GPU, a worker process holding the offloaded blocks, and a
request of ``--blocks`` blocks (default 128: a 2,048-token prompt, 256 MiB). In one run:

Each PrefixKVCache row twice: ``packed`` (the default on a GPU: blocks packed on the device, one DMA a block) and
``pieces`` (``staging_bytes=0``: every layer's K and V of a block its own copy-engine copy).

* ``save``: :meth:`~kvstrata.integrations.PrefixKVCache.save` of the request's blocks, none held before (lookup,
  copies out of the paged cache, commit);
* ``load cold``: :meth:`~kvstrata.integrations.PrefixKVCache.load` of blocks this client has not read before (the
  worker's leases asked for); ``load kept``: the same blocks again (leases kept by the client: no request);
* ``lookup``: the request's :meth:`~kvstrata.integrations.PrefixKVCache.lookup` alone;
* ``torch per piece``: what an engine without kvstrata does, every layer's K and V of every block copied with its
  own ``copy_(non_blocking=True)`` between the paged cache and a pinned host buffer, then synchronized;
* ``dma``: one pinned ``copy_`` of the same bytes, contiguous (the link's ceiling for them), each direction.

Every row is the median wall time of whole calls (each returns once its bytes landed), ``of_dma`` the same bytes'
DMA time over the row's. Without a GPU (or with ``--smoke``) a tiny CPU version checks the plumbing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.bench._common import gbps, host_time, positive, print_table, write_result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the plumbing")
    parser.add_argument("--blocks", type=positive(int), default=128, help="blocks per request (default 128)")
    parser.add_argument("--layers", type=positive(int), default=32, help="decoder layers (default 32)")
    parser.add_argument("--kv-heads", type=positive(int), default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=positive(int), default=128, help="head dim (default 128)")
    parser.add_argument("--block-tokens", type=positive(int), default=16, help="tokens per block (default 16)")
    parser.add_argument("--iters", type=positive(int), default=10, help="timed calls per row (default 10)")


def run(args: argparse.Namespace) -> int:
    import kvstrata
    from kvstrata.bench.store import _start_worker, _stop
    from kvstrata.integrations import PrefixKVCache
    from kvstrata.units import format_size

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        args.blocks, args.layers, args.kv_heads, args.head_dim, args.iters = 8, 2, 2, 32, 3
    device = "cuda" if cuda else "cpu"
    bt = args.block_tokens
    num_blocks = 2 * args.blocks
    shape = (2, num_blocks, bt, args.kv_heads, args.head_dim)
    kv_caches = [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(args.layers)]
    block_bytes = 2 * args.layers * bt * args.kv_heads * args.head_dim * 2
    nbytes = args.blocks * block_bytes
    # every save writes new blocks (deleted after each variant): room for one variant's, the warm-up's included
    memory = max(64 << 20, (args.iters + 4) * nbytes * 5 // 4)
    print(
        f"kvstrata bench prefix: {args.blocks} blocks of {format_size(block_bytes)} ({args.layers} layers x K/V x "
        f"{bt} tokens x {args.kv_heads} heads x {args.head_dim}, bf16) = {format_size(nbytes)} per request, "
        f"KV cache on {device}, a worker of {format_size(memory)}",
        flush=True,
    )
    rng = np.random.default_rng(0)
    src_ids = list(range(args.blocks))
    dst_ids = list(range(args.blocks, num_blocks))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def new_prompt() -> list[int]:
        return rng.integers(0, 128_000, args.blocks * bt).tolist()

    times: dict[str, dict[str, float]] = {}
    correct = True
    variants = {"packed": None, "pieces": 0} if cuda else {"packed": 3 * block_bytes, "pieces": 0}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-prefix-") as tmp:
        proc, address = _start_worker(Path(tmp), memory)
        try:
            with kvstrata.connect(address, timeout=30) as kv:
                for variant, staging_bytes in variants.items():
                    cache = PrefixKVCache(kv, kv_caches, model=f"bench-{variant}", staging_bytes=staging_bytes)
                    times[variant], ok = _measure(cache, args, src_ids, dst_ids, new_prompt, sync)
                    correct = correct and ok
        finally:
            _stop(proc)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pieces = [c[kv_i, b] for b in src_ids for c in kv_caches for kv_i in (0, 1)]
    host_pieces = list(pinned.view(torch.bfloat16).split(pieces[0].numel()))

    def per_piece_d2h() -> None:
        for h, d in zip(host_pieces, pieces):
            h.copy_(d.reshape(-1), non_blocking=True)
        sync()

    def per_piece_h2d() -> None:
        for h, d in zip(host_pieces, pieces):
            d.view(-1).copy_(h, non_blocking=True)
        sync()

    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def dma_h2d() -> None:
        flat.copy_(pinned, non_blocking=True)
        sync()

    def dma_d2h() -> None:
        pinned.copy_(flat, non_blocking=True)
        sync()

    t_dma = {"d2h": host_time(dma_d2h, iters=args.iters), "h2d": host_time(dma_h2d, iters=args.iters)}
    table = []
    for variant, t in times.items():
        for op, direction in (("save", "d2h"), ("load cold", "h2d"), ("load kept", "h2d")):
            table.append((f"{op} {variant} ({direction})", t[op], t_dma[direction]))
    table.append(("torch per piece d2h", host_time(per_piece_d2h, iters=args.iters), t_dma["d2h"]))
    table.append(("torch per piece h2d", host_time(per_piece_h2d, iters=args.iters), t_dma["h2d"]))
    table += [("dma d2h", t_dma["d2h"], t_dma["d2h"]), ("dma h2d", t_dma["h2d"], t_dma["h2d"])]
    rows: list[dict[str, Any]] = [
        {"row": name, "ms": round(t * 1e3, 3), "GB/s": gbps(nbytes, t), "of_dma": round(dma / t, 3), "bytes": nbytes}
        for name, t, dma in table
    ]
    for variant, t in times.items():
        rows.append(
            {"row": f"lookup {variant}", "ms": round(t["lookup"] * 1e3, 3), "GB/s": "", "of_dma": "", "bytes": 0}
        )
    print_table(rows, ["row", "ms", "GB/s", "of_dma"])
    print(f"loaded blocks match the saved ones bit for bit: {correct}")
    path = write_result(
        "prefix_cache" + ("_cpu" if not cuda else ""),
        {
            "geometry": {
                "blocks": args.blocks,
                "layers": args.layers,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "block_tokens": bt,
                "block_bytes": block_bytes,
                "pieces_per_block": 2 * args.layers,
            },
            "iters": args.iters,
            "rows": rows,
            "correct": correct,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        getattr(args, "out", None),
    )
    print(f"wrote {path}")
    return 0 if correct else 1


def _measure(
    cache: Any, args: argparse.Namespace, src_ids: list[int], dst_ids: list[int], new_prompt: Any, sync: Any
) -> tuple[dict[str, float], bool]:
    """One variant's save / load cold / load kept / lookup times, whether a fresh prompt's blocks came back bit for
    bit; the keys it wrote deleted after."""
    saved: list[list[int]] = []

    def save() -> None:
        tokens = new_prompt()
        r = cache.save(tokens, src_ids)
        if r.stored != args.blocks:
            raise SystemExit(f"kvstrata bench prefix: save stored {r.stored} of {args.blocks} blocks")
        saved.append(tokens)

    def load(tokens: list[int]) -> None:
        if cache.load(tokens, dst_ids) != args.blocks:
            raise SystemExit("kvstrata bench prefix: a load fell short")
        sync()  # (packed: the unpacking is queued on the stream when load returns)

    # The worker's fresh shared memory costs page faults and this client's CUDA registration the first time each
    # segment is written: a long-running engine pays that once. A round of saves over the same room, deleted, first.
    for _ in range(args.iters + 1):
        save()
    cache.client.delete([k for tokens in saved for k in cache.block_keys(tokens)])
    saved.clear()
    t = {"save": host_time(save, warmup=1, iters=args.iters)}
    cold = iter(list(saved))
    t["load cold"] = host_time(lambda: load(next(cold)), warmup=1, iters=len(saved) - 1)
    t["load kept"] = host_time(lambda: load(saved[0]), warmup=2, iters=args.iters)
    t["lookup"] = host_time(lambda: cache.lookup(saved[0]), warmup=2, iters=args.iters)
    check = new_prompt()  # correctness: a fresh prompt, its target blocks zeroed first
    cache.save(check, src_ids)
    caches = cache.layout.tensors
    for c in caches:
        c[:, dst_ids] = 0
    load(check)
    ok = all(torch.equal(c[:, src_ids], c[:, dst_ids]) for c in caches)
    cache.client.delete([k for tokens in [*saved, check] for k in cache.block_keys(tokens)])
    return t, ok
