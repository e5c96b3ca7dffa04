"""``kvstrata demo``: an LLM serving engine offloading its KV cache to kvstrata, on the embedded store.

Simulated sessions send prompts that share system-prompt prefixes. The engine keeps its KV cache paged as
vLLM does (per layer ``[2, num_blocks, block_tokens, heads, head_dim]``, on the GPU, or here on the CPU) and
offloads it through :class:`kvstrata.integrations.PrefixKVCache`: a block's key is a hash chain over its tokens
and everything before it, so equal prefixes give equal keys. For every request the engine places the prompt's
blocks in its cache, looks up the longest cached prefix, loads it into those blocks (one ``mget_h2d``, straight
into the paged cache), "computes" the rest and offloads the computed blocks the store does not hold (one
``mset_d2h``, straight out of it). The host tier is smaller than the working set, so older blocks spill to a
temporary SSD folder (sized for the planned sessions) and come back when a session returns for a second turn.
A block the store has no room for is left out (counted as not offloaded) and computed again when it is next
needed; a block that cannot be loaded is computed again too. Every reused block is checked bit for bit against
what was computed for it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import tempfile
import time
from typing import Any

SYSTEM_PROMPTS = 4  # shared system prompts, one per session in turn
SYSTEM_BLOCKS = 8  # blocks of each system prompt
FIRST_TURN_BLOCKS = 6  # a session's own blocks in its first turn
SECOND_TURN_BLOCKS = 3  # the blocks its second turn adds to the whole first conversation
#: blocks of the largest request (a second turn's prompt), all leased at once while they load
LARGEST_REQUEST = SYSTEM_BLOCKS + FIRST_TURN_BLOCKS + SECOND_TURN_BLOCKS


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
    """A small decoder's paged KV cache (vLLM's layout: per layer ``[2, num_blocks, block_tokens, heads,
    head_dim]``) with room for the largest request twice over, and the KV its forward pass would compute."""

    def __init__(self, layers: int, heads: int, head_dim: int, block_tokens: int, device: Any) -> None:
        import torch

        self.layers, self.heads, self.head_dim, self.block_tokens = layers, heads, head_dim, block_tokens
        self.dtype = torch.float16
        self.device = device
        self.block_bytes = 2 * layers * heads * block_tokens * head_dim * 2
        self.num_blocks = 2 * LARGEST_REQUEST
        shape = (2, self.num_blocks, block_tokens, heads, head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(layers)]
        self._placement = random.Random(7)

    def place(self, n: int) -> list[int]:
        """Cache blocks for a request's ``n`` prompt blocks, anywhere in the cache (as a block allocator hands
        them out)."""
        return self._placement.sample(range(self.num_blocks), n)

    def compute_block(self, key: str) -> Any:
        """The KV a forward pass would produce for this block, ``[layers, 2, block_tokens, heads, head_dim]``:
        deterministic in the key, so reuse can be checked.

        A window into a random buffer twice a block's size keeps the simulated prefill cheap next
        to the store's work.
        """
        import torch

        n = self.block_bytes // 2
        if not hasattr(self, "_base"):
            g = torch.Generator().manual_seed(1234)
            self._base = torch.randn(2 * n, generator=g, dtype=torch.float32).to(self.dtype).to(self.device)
        shift = int(key[-12:], 16) % n
        return self._base[shift : shift + n].view(self.layers, 2, self.block_tokens, self.heads, self.head_dim)

    def write_block(self, block: int, kv: Any) -> None:
        """Put a computed block's KV in cache block ``block``."""
        for layer, cache in enumerate(self.kv_caches):
            cache[:, block].copy_(kv[layer])

    def mismatches(self, block: int, kv: Any) -> int:
        """How many of cache block ``block``'s K and V tensors differ from ``kv``."""
        import torch

        return sum(
            not torch.equal(cache[i, block], kv[layer, i]) for layer, cache in enumerate(self.kv_caches) for i in (0, 1)
        )


@dataclasses.dataclass
class Tally:
    """What the requests did, block by block. Every prompt block is either reused or computed
    (``blocks == hit_blocks + computed``), and every computed block either offloaded, left out for want of
    room, or already in the store (``computed == offloaded + store_full + already_stored``)."""

    planned: int = 0  # requests in the schedule
    requests: int = 0
    blocks: int = 0
    lookup_hits: int = 0  # blocks of the longest cached prefix of each prompt
    lookup_misses: int = 0  # blocks past it (not cached, or cached after a block that is not: computed)
    hit_blocks: int = 0  # loaded and reused
    load_failed: int = 0  # in the cached prefix but not loaded: computed instead
    computed: int = 0
    offloaded: int = 0
    store_full: int = 0  # computed, not offloaded: the store had no room (CapacityError)
    already_stored: int = 0  # computed, not offloaded: the store holds it already
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    mismatches: int = 0


def planned_blocks(sessions: int) -> int:
    """Distinct KV blocks the sessions' prompts hold at most: the working set the SSD tier is sized for."""
    return min(sessions, SYSTEM_PROMPTS) * SYSTEM_BLOCKS + sessions * (FIRST_TURN_BLOCKS + SECOND_TURN_BLOCKS)


def ssd_bytes(sessions: int, block_bytes: int) -> int:
    """The SSD tier's size: the whole planned working set, each block with a page of overhead, plus a quarter and
    16 MiB of headroom (the host tier holds part of it too: what is left over is the margin)."""
    return planned_blocks(sessions) * (block_bytes + 4096) * 5 // 4 + (16 << 20)


def min_memory(block_bytes: int) -> int:
    """The smallest host tier the demo runs in: the largest request's blocks, leased together while they load, and
    a block to spare (free space is not all in one piece) beside the client's write reservation, which may hold
    1/RESERVE_SHARE of the tier (:mod:`kvstrata.store.reservations`). Smaller, loads fail for want of room."""
    from kvstrata.store.allocator import ALIGNMENT
    from kvstrata.store.reservations import RESERVE_SHARE

    aligned = -(-block_bytes // ALIGNMENT) * ALIGNMENT
    return -(-(LARGEST_REQUEST + 1) * aligned * RESERVE_SHARE // (RESERVE_SHARE - 1))


def _device(text: str | None) -> Any:
    """The KV tensors' device from ``--device``, or a clean argument error (SystemExit)."""
    import torch

    name = text or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"kvstrata demo: --device {text!r}: {exc}") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"kvstrata demo: --device {text!r}: KV tensors must be on cpu or cuda, not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"kvstrata demo: --device {text}: no CUDA device here (use --device cpu)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise SystemExit(
                f"kvstrata demo: --device {text}: there {'is' if count == 1 else 'are'} {count} CUDA"
                f" device{'' if count == 1 else 's'} here (cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})"
            )
    return device


def run(args: argparse.Namespace) -> int:
    import kvstrata
    from kvstrata.units import format_size, parse_size

    # Every argument is checked before anything is made (the SSD folder last).
    device = _device(args.device)
    model = Model(args.layers, heads=8, head_dim=64, block_tokens=args.block_tokens, device=device)
    try:
        memory = parse_size(args.memory, "memory")
    except ValueError as exc:
        raise SystemExit(f"kvstrata demo: --memory: {exc}") from None
    need = min_memory(model.block_bytes)
    if memory < need:
        raise SystemExit(
            f"kvstrata demo: --memory {args.memory}: the host tier must hold at least {format_size(need)}: the"
            f" largest request's {LARGEST_REQUEST} KV blocks of {format_size(model.block_bytes)} and room to spare"
        )
    disk_bytes = ssd_bytes(args.sessions, model.block_bytes)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    ssd_note = ""
    if disk_bytes > free * 9 // 10:  # a tier larger than the disk would fail writes later, not say so now
        disk_bytes = max(free * 9 // 10, model.block_bytes)
        ssd_note = f" (capped by the free space in {tempfile.gettempdir()}: blocks past it are not offloaded)"
    rng = random.Random(args.seed)
    tally = Tally(planned=2 * args.sessions)
    stats: dict | None = None
    interrupted = False
    print(f"kvstrata demo: KV-cache offload for {args.sessions} chat sessions on the embedded store")
    print(
        f"  model: {args.layers} layers x 8 heads x 64 dims, fp16, {args.block_tokens}-token blocks ="
        f" {format_size(model.block_bytes)} per block; KV tensors on {device}"
    )
    t_start = time.perf_counter()
    disk_dir = None
    try:
        disk_dir = tempfile.mkdtemp(prefix="kvstrata-demo-ssd-")
        print(
            f"  host tier {format_size(memory)} (DRAM, shared memory), SSD tier of {format_size(disk_bytes)}"
            f" in {disk_dir}{ssd_note}\n",
            flush=True,
        )
        with kvstrata.connect(
            embedded=True,
            memory_bytes=memory,
            segment_bytes=min(memory, max(16 << 20, model.block_bytes)),
            disk_dir=disk_dir,
            disk_bytes=disk_bytes,
        ) as kv:
            try:
                serve(kv, model, args.sessions, rng, tally)
            except KeyboardInterrupt:
                interrupted = True
            stats = kv.stats()
    except KeyboardInterrupt:  # before the first request, or a second Ctrl-C while closing
        interrupted = True
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    if interrupted:
        if stats is None or tally.requests == 0:
            print("kvstrata demo: interrupted", flush=True)
            return 130
        print(f"  interrupted after {tally.requests} of {tally.planned} requests: what they did\n")
    _summary(tally, stats, elapsed, model)
    if interrupted:
        return 130
    return 0 if tally.mismatches == 0 else 1


def serve(kv: Any, model: Model, sessions: int, rng: random.Random, tally: Tally) -> None:
    """Every session's two turns, in the demo's order, each request counted in ``tally`` as it ends."""
    from kvstrata.integrations import PrefixKVCache

    cache = PrefixKVCache(kv, model.kv_caches, model="demo-model")
    bt = model.block_tokens
    system_prompts = [[rng.randrange(32000) for _ in range(bt * SYSTEM_BLOCKS)] for _ in range(SYSTEM_PROMPTS)]
    histories: dict[int, list[int]] = {}
    # Two turns per session: the second turn's prompt is the whole first conversation plus more.
    schedule = [(s, 1) for s in range(sessions)] + [(s, 2) for s in rng.sample(range(sessions), sessions)]
    for session, turn in schedule:
        if turn == 1:
            own = [rng.randrange(32000) for _ in range(bt * FIRST_TURN_BLOCKS)]
            prompt = system_prompts[session % SYSTEM_PROMPTS] + own
        else:
            prompt = histories[session] + [rng.randrange(32000) for _ in range(bt * SECOND_TURN_BLOCKS)]
        histories[session] = prompt
        request(cache, model, prompt, tally)


def request(cache: Any, model: Model, tokens: list[int], tally: Tally) -> None:
    """One prompt: place its blocks, look up and load the cached prefix, compute the rest, offload what the store
    lacks (``cache``: a :class:`~kvstrata.integrations.PrefixKVCache` of ``model``'s KV cache)."""
    keys = cache.block_keys(tokens)
    blocks = model.place(len(keys))
    n_hit = cache.lookup(tokens)  # the longest cached prefix
    t0 = time.perf_counter()
    loaded = cache.load(tokens, blocks[:n_hit]) if n_hit else 0  # a block gone since the lookup ends it
    load_s = time.perf_counter() - t0 if n_hit else 0.0
    mismatches = sum(model.mismatches(blocks[i], model.compute_block(keys[i])) for i in range(loaded))
    # Computed: the blocks not loaded. Offloaded: those of them the store does not hold (a block cached after a
    # missing one is computed, since only a prefix is reusable, but the store holds it already).
    for i in range(loaded, len(keys)):
        model.write_block(blocks[i], model.compute_block(keys[i]))
    t0 = time.perf_counter()
    saved = cache.save(tokens, blocks, start=loaded)
    store_s = time.perf_counter() - t0 if saved.stored + saved.refused else 0.0
    # Counted once the request is through, so that an interrupted request leaves the totals consistent.
    tally.requests += 1
    tally.blocks += len(keys)
    tally.lookup_hits += n_hit
    tally.lookup_misses += len(keys) - n_hit
    tally.hit_blocks += loaded
    tally.load_failed += n_hit - loaded
    tally.loaded_bytes += loaded * model.block_bytes
    tally.load_s += load_s
    tally.mismatches += mismatches
    tally.computed += len(keys) - loaded
    tally.offloaded += saved.stored
    tally.stored_bytes += saved.stored_bytes
    tally.store_s += store_s
    tally.store_full += saved.refused
    tally.already_stored += saved.present


def _summary(t: Tally, stats: dict, elapsed: float, model: Model) -> None:
    from kvstrata.units import format_size

    def rate(nbytes: int, secs: float) -> str:
        return f"{nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else "-"

    hit_pct = 100 * t.hit_blocks / max(t.blocks, 1)
    mem = stats["tiers"]["memory"]
    disk = stats["tiers"].get("disk", {})
    print(f"  requests served            {t.requests}")
    print(f"  prompt blocks              {t.blocks}  ({t.blocks * model.block_tokens} tokens)")
    print(
        f"  lookups                    {t.lookup_hits} hits (the cached prefix of each prompt),"
        f" {t.lookup_misses} misses (past it)"
    )
    failed = f"; {t.load_failed} cached but not loaded: computed" if t.load_failed else ""
    print(f"  reused from kvstrata       {t.hit_blocks}  ({hit_pct:.1f}% of blocks: prefill skipped for them){failed}")
    parts = [f"{t.offloaded} offloaded"]
    if t.store_full:
        parts.append(f"{t.store_full} not offloaded: store full")
    if t.already_stored:
        parts.append(f"{t.already_stored} not offloaded: already stored")
    print(f"  computed                   {t.computed}  ({', '.join(parts)})")
    print(f"  loaded  (mget_h2d)         {format_size(t.loaded_bytes)} at {rate(t.loaded_bytes, t.load_s)}")
    print(f"  offloaded (mset_d2h)       {format_size(t.stored_bytes)} at {rate(t.stored_bytes, t.store_s)}")
    print(f"  host tier                  {format_size(mem['used'])} of {format_size(mem['capacity'])} used")
    if disk:
        print(
            f"  SSD tier                   {format_size(disk.get('used', 0))} of"
            f" {format_size(disk.get('capacity', 0))} used"
        )
    print(
        f"  store                      {stats['objects']} objects, {stats['hits']} reads served,"
        f" {stats['spills']} spills to SSD, {stats['promotions']} promotions back, {stats['evictions']} evictions"
    )
    verdict = "every reused block matched bit for bit" if t.mismatches == 0 else f"{t.mismatches} TENSORS DIFFERED"
    print(f"  check                      {verdict}")
    print(f"  done in {elapsed:.1f} s", flush=True)
