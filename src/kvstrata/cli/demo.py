"""``kvstrata demo``: an LLM serving engine offloading its KV cache to kvstrata, on the embedded store.

Simulated sessions send prompts that share system-prompt prefixes. Each prompt is cut into blocks
of tokens; a block's key is a hash chain over its tokens and everything before it (as in vLLM's
prefix caching), so equal prefixes give equal keys. For every request the engine looks up the
longest cached prefix, loads those blocks into its (GPU, or here CPU) KV tensors with one
``mget_h2d``, "computes" the rest and offloads them with one ``mset_d2h`` (write-once: a block
another session stored first is left alone). The host tier is smaller than the working set, so
older blocks spill to a temporary SSD folder and come back when a session returns for a second
turn. Every reused block is checked bit for bit against what was computed for it.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import shutil
import tempfile
import time
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvstrata.bench._common import positive

    p = subparsers.add_parser("demo", help="KV-cache offload and prefix reuse on the embedded store (start here)")
    p.add_argument("--sessions", type=positive(int), default=40, help="chat sessions (default 40)")
    p.add_argument("--memory", default="48MiB", help="host (DRAM) tier size (default 48MiB: smaller than the data)")
    p.add_argument(
        "--layers", type=positive(int), default=8, help="decoder layers whose K and V each block holds (default 8)"
    )
    p.add_argument("--block-tokens", type=positive(int), default=16, help="tokens per KV block (default 16)")
    p.add_argument("--device", default=None, help="where the KV tensors live (default: cuda if present, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sessions' prompts and KV values (default 0)")
    p.set_defaults(func=run)


class Model:
    """Shapes of a small decoder's KV cache: per block, K and V for every layer, [heads, tokens, head_dim]."""

    def __init__(self, layers: int, heads: int, head_dim: int, block_tokens: int, device: Any) -> None:
        import torch

        self.layers, self.heads, self.head_dim, self.block_tokens = layers, heads, head_dim, block_tokens
        self.dtype = torch.float16
        self.device = device
        self.block_bytes = 2 * layers * heads * block_tokens * head_dim * 2

    def empty_block(self) -> list[Any]:
        import torch

        shape = (self.heads, self.block_tokens, self.head_dim)
        return [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.layers)]

    def compute_block(self, key: str) -> list[Any]:
        """The KV a forward pass would produce for this block: deterministic in the key, so reuse can be checked.

        A window into a random buffer twice a block's size keeps the simulated prefill cheap next
        to the store's work.
        """
        import torch

        n = self.block_bytes // 2
        if not hasattr(self, "_base"):
            g = torch.Generator().manual_seed(1234)
            self._base = torch.randn(2 * n, generator=g, dtype=torch.float32).to(self.dtype).to(self.device)
        shift = int(key[-12:], 16) % n
        kv = self._base[shift : shift + n].view(2 * self.layers, self.heads, self.block_tokens, self.head_dim)
        return list(kv.unbind(0))


def block_keys(tokens: list[int], block_tokens: int) -> list[str]:
    keys, parent = [], b""
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent + bytes(str(tokens[start : start + block_tokens]), "ascii"), digest_size=16)
        parent = h.digest()
        keys.append(f"kv/demo-model/{h.hexdigest()}")
    return keys


def run(args: argparse.Namespace) -> int:
    import torch

    import kvstrata
    from kvstrata.units import format_size, parse_size

    rng = random.Random(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"kvstrata demo: --device {args.device!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"kvstrata demo: --device {args.device}: no CUDA device here (use --device cpu)")
    model = Model(args.layers, heads=8, head_dim=64, block_tokens=args.block_tokens, device=device)
    bt = args.block_tokens
    system_prompts = [[rng.randrange(32000) for _ in range(bt * 8)] for _ in range(4)]
    histories: dict[int, list[int]] = {}
    disk_dir = tempfile.mkdtemp(prefix="kvstrata-demo-ssd-")
    try:
        memory = parse_size(args.memory, "memory")
    except ValueError as exc:
        raise SystemExit(f"kvstrata demo: --memory: {exc}") from None
    if memory < 8 * model.block_bytes:
        raise SystemExit(
            f"kvstrata demo: --memory {args.memory}: the host tier must hold at least 8 KV blocks of "
            f"{format_size(model.block_bytes)} ({format_size(8 * model.block_bytes)})"
        )
    totals = dict(requests=0, blocks=0, hit_blocks=0, computed=0, deduped=0, loaded_bytes=0, stored_bytes=0)
    load_s = store_s = 0.0
    mismatches = 0
    print(f"kvstrata demo: KV-cache offload for {args.sessions} chat sessions on the embedded store")
    print(
        f"  model: {args.layers} layers x 8 heads x 64 dims, fp16, {bt}-token blocks = {format_size(model.block_bytes)}"
        f" per block; KV tensors on {device}"
    )
    print(f"  host tier {format_size(memory)} (DRAM, shared memory), SSD tier in {disk_dir}\n")
    t_start = time.perf_counter()
    try:
        with kvstrata.connect(
            embedded=True,
            memory_bytes=memory,
            segment_bytes=min(memory, 16 << 20),
            disk_dir=disk_dir,
            disk_bytes=8 * memory,
        ) as kv:
            # Two turns per session: the second turn's prompt is the whole first conversation plus more.
            schedule = [(s, 1) for s in range(args.sessions)] + [
                (s, 2) for s in rng.sample(range(args.sessions), args.sessions)
            ]
            for session, turn in schedule:
                if turn == 1:
                    prompt = system_prompts[session % len(system_prompts)] + [
                        rng.randrange(32000) for _ in range(bt * 6)
                    ]
                else:
                    prompt = histories[session] + [rng.randrange(32000) for _ in range(bt * 3)]
                histories[session] = prompt
                keys = block_keys(prompt, bt)
                present = kv.exists(keys)
                n_hit = next((i for i, p in enumerate(present) if not p), len(keys))  # longest cached prefix
                totals["requests"] += 1
                totals["blocks"] += len(keys)
                if n_hit:
                    dst = [model.empty_block() for _ in range(n_hit)]
                    t0 = time.perf_counter()
                    results = kv.mget_h2d(keys[:n_hit], dst)
                    load_s += time.perf_counter() - t0
                    for key, tensors, r in zip(keys[:n_hit], dst, results):
                        if r is not None:  # evicted between exists and load: recompute instead
                            continue
                        totals["hit_blocks"] += 1
                        totals["loaded_bytes"] += model.block_bytes
                        expected = model.compute_block(key)
                        mismatches += sum(not torch.equal(a, b) for a, b in zip(tensors, expected))
                new_keys = keys[n_hit:]
                if new_keys:
                    computed = [model.compute_block(k) for k in new_keys]
                    totals["computed"] += len(new_keys)
                    t0 = time.perf_counter()
                    results = kv.mset_d2h(new_keys, computed)
                    store_s += time.perf_counter() - t0
                    for r in results:
                        if r is None:
                            totals["stored_bytes"] += model.block_bytes
                        elif isinstance(r, kvstrata.KeyExists):
                            totals["deduped"] += 1
                        else:
                            raise r
            stats = kv.stats()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    _summary(totals, stats, load_s, store_s, elapsed, mismatches, model)
    return 0 if mismatches == 0 else 1


def _summary(
    totals: dict, stats: dict, load_s: float, store_s: float, elapsed: float, mismatches: int, model: Model
) -> None:
    from kvstrata.units import format_size

    def rate(nbytes: int, secs: float) -> str:
        return f"{nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else "-"

    hit_pct = 100 * totals["hit_blocks"] / max(totals["blocks"], 1)
    mem = stats["tiers"]["memory"]
    disk = stats["tiers"].get("disk", {})
    print(f"  requests served            {totals['requests']}")
    print(f"  prompt blocks              {totals['blocks']}  ({totals['blocks'] * model.block_tokens} tokens)")
    print(f"  reused from kvstrata       {totals['hit_blocks']}  ({hit_pct:.1f}% of blocks: prefill skipped for them)")
    deduped = f" (+{totals['deduped']} stored first by another session: write-once)" if totals["deduped"] else ""
    print(f"  computed and offloaded     {totals['computed'] - totals['deduped']}{deduped}")
    print(
        f"  loaded  (mget_h2d)         {format_size(totals['loaded_bytes'])} at {rate(totals['loaded_bytes'], load_s)}"
    )
    print(
        f"  offloaded (mset_d2h)       {format_size(totals['stored_bytes'])} at {rate(totals['stored_bytes'], store_s)}"
    )
    print(f"  host tier                  {format_size(mem['used'])} of {format_size(mem['capacity'])} used")
    if disk:
        print(f"  SSD tier                   {format_size(disk.get('used', 0))} used")
    print(
        f"  store                      {stats['objects']} objects, {stats['hits']} hits, {stats['misses']} misses,"
        f" {stats['spills']} spills to SSD, {stats['promotions']} promotions back, {stats['evictions']} evictions"
    )
    verdict = "every reused block matched bit for bit" if mismatches == 0 else f"{mismatches} TENSORS DIFFERED"
    print(f"  check                      {verdict}")
    print(f"  done in {elapsed:.1f} s")
