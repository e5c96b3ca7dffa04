"""PrefixKVCache: a paged KV cache's blocks offloaded and their prefixes loaded back, embedded and through a worker."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kvstrata
from kv_helpers import client_for, same, worker_fixtures
from kvstrata.errors import InvalidType, InvalidValue, KeyExists
from kvstrata.integrations import PrefixKVCache
from kvstrata.integrations.prefix_cache import STAGING_BYTES
from kvstrata.ops import KVLayout

SRC = str(Path(__file__).resolve().parents[1] / "src")
worker, kv = worker_fixtures("prefix-worker", memory=32 << 20, segment=8 << 20)

BT = 16  # tokens per block
#: blocks packed per copy call (Triton's kernel under the interpreter on CPU), or 0: every piece copied in place
STAGING = pytest.mark.parametrize("staged", [0, 3], ids=["pieces", "packed"])


def staging(cache_or_caches, staged: int) -> int:
    """``staging_bytes`` for ``staged`` blocks of this cache (0: none)."""
    layout = cache_or_caches if isinstance(cache_or_caches, KVLayout) else KVLayout.from_vllm(cache_or_caches)
    return staged * layout.block_bytes


def vllm_cache(layers=3, blocks=32, heads=4, head_dim=32, dtype=torch.float16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, BT, heads, head_dim, generator=g).to(dtype).to(device) for _ in range(layers)]


def block_of(caches, b):
    """Every layer's K and V of block ``b`` (vLLM layout), for comparing."""
    return [t[:, b].clone() for t in caches]


def prompt(n_tokens, seed=0):
    return np.random.default_rng(seed).integers(0, 32000, n_tokens).tolist()


@STAGING
def test_saved_prefix_is_found_and_loaded_into_other_blocks_bit_for_bit(kv, staged):
    src = vllm_cache(seed=1)
    cache = PrefixKVCache(kv, src, model=f"tiny-{staged}", staging_bytes=staging(src, staged))
    tokens = prompt(5 * BT + 7)  # 5 full blocks and a partial one
    assert cache.lookup(tokens) == 0
    saved = cache.save(tokens, [9, 3, 17, 4, 30])
    assert (saved.stored, saved.present, saved.refused) == (5, 0, 0)
    assert saved.stored_bytes == 5 * cache.block_bytes
    # A longer prompt sharing the first 3 blocks, then diverging: its cached prefix is 3 blocks
    longer = tokens[: 3 * BT] + prompt(4 * BT, seed=2)
    assert cache.lookup(longer) == 3
    dst = vllm_cache(seed=3)
    reader = PrefixKVCache(kv, dst, model=f"tiny-{staged}", staging_bytes=staging(dst, staged))
    assert reader.load(longer, [0, 1, 2]) == 3
    for got, want in ((0, 9), (1, 3), (2, 17)):
        assert all(same(a, b) for a, b in zip(block_of(dst, got), block_of(src, want)))
    assert all(same(a, b) for a, b in zip(block_of(dst, 5), block_of(vllm_cache(seed=3), 5)))  # others untouched
    assert (cache.stats.hit_blocks, reader.stats.loaded_blocks) == (3, 3)


def test_packed_and_piecewise_store_the_same_bytes(kv):
    src = vllm_cache(seed=23)
    tokens = prompt(5 * BT, seed=24)
    packed = PrefixKVCache(kv, src, model="fmt", staging_bytes=staging(src, 2))
    assert packed.save(tokens, [4, 0, 9, 1, 2]).stored == 5
    keys = packed.block_keys(tokens)
    stored = [kv.get(k) for k in keys]
    pieces = [b"".join(bytes(v[b].numpy()) for v in KVLayout.from_vllm(src).seg_views) for b in [4, 0, 9, 1, 2]]
    assert stored == pieces
    with pytest.raises(InvalidValue, match="staging_bytes: must be an int >= 0"):
        PrefixKVCache(kv, src, model="fmt", staging_bytes=-1)


def test_a_saved_block_is_looked_up_not_copied_again(kv):
    cache = PrefixKVCache(kv, vllm_cache(), model="again")
    tokens = prompt(4 * BT, seed=4)
    assert cache.save(tokens, [0, 1]).stored == 2
    r = cache.save(tokens, [0, 1, 2, 3])
    assert (r.stored, r.present) == (2, 2)
    assert cache.lookup(tokens) == 4
    r = cache.save(tokens, [0, 1, 2, 3], start=3)  # the first three just loaded: not looked up again
    assert (r.stored, r.present) == (0, 1)
    more = tokens + prompt(BT, seed=19)
    r = cache.save(more, [0, 1, 2, 3, 4], start=4)
    assert (r.stored, r.present) == (1, 0) and cache.lookup(more) == 5


def test_keys_chain_over_the_prefix_and_name_model_geometry_and_salt():
    with kvstrata.connect(embedded=True, memory_bytes="16MiB") as kv:
        cache = PrefixKVCache(kv, vllm_cache(), model="m")
        a = prompt(3 * BT, seed=5)
        b = [a[0] + 1, *a[1:]]  # differs in the first token only
        ka, kb = cache.block_keys(a), cache.block_keys(b)
        assert len(ka) == 3 and not set(ka) & set(kb)  # a change reaches every later block
        assert cache.block_keys([*a, 1, 2]) == ka  # the partial block has no key
        assert cache.block_keys(np.array(a)) == ka == cache.block_keys(torch.tensor(a, dtype=torch.int32))
        assert cache.block_keys(a, salt="lora-1") != ka != cache.block_keys(a, salt=b"img")
        assert ka[0].startswith("kv/m/vllm.6x4096.float16.16t/")
        other_model = PrefixKVCache(kv, vllm_cache(), model="m2")
        other_dtype = PrefixKVCache(kv, vllm_cache(dtype=torch.bfloat16), model="m")
        other_heads = PrefixKVCache(kv, vllm_cache(heads=2), model="m")
        for other in (other_model, other_dtype, other_heads):
            assert not set(other.block_keys(a)) & set(ka)
        cache.save(a, [0, 1, 2])
        assert other_heads.lookup(a) == 0 and cache.lookup(a, salt="lora-1") == 0 and cache.lookup(a) == 3


@STAGING
def test_a_missing_block_ends_the_loaded_prefix(staged):
    caches = vllm_cache()
    with kvstrata.connect(embedded=True, memory_bytes="16MiB") as kv:
        cache = PrefixKVCache(kv, caches, model="gap", staging_bytes=staging(caches, staged))
        tokens = prompt(8 * BT, seed=6)
        cache.save(tokens, list(range(8)))
        kv.delete(cache.block_keys(tokens)[4])  # evicted since the lookup, say (in the second packed chunk)
        assert cache.lookup(tokens) == 4
        for c in caches:
            c[:, 10:18] = 0
        assert cache.load(tokens, list(range(10, 18))) == 4
        assert cache.stats.load_misses == 4
        assert all(same(c[:, 10:14], c[:, 0:4]) for c in caches)


@STAGING
def test_no_room_counts_blocks_as_refused_and_serving_goes_on(staged):
    caches = vllm_cache(layers=4, blocks=64, heads=8, head_dim=64)  # 128 KiB blocks
    with kvstrata.connect(embedded=True, memory_bytes="1MiB", segment_bytes="1MiB", reserve_bytes=0) as kv:
        cache = PrefixKVCache(kv, caches, model="full", staging_bytes=staging(caches, staged))
        tokens = prompt(20 * BT, seed=7)
        r = cache.save(tokens, list(range(20)))
        assert r.stored + r.refused == 20 and 0 < r.stored < 20 and r.refused > 0
        n = cache.lookup(tokens)
        assert n == r.stored  # the first ones went in, the rest found no room
        dst = vllm_cache(layers=4, blocks=64, heads=8, head_dim=64, seed=9)
        reader = PrefixKVCache(kv, dst, model="full", staging_bytes=staging(dst, staged))
        assert reader.load(tokens, list(range(40, 40 + n))) == n
        assert all(same(a, b) for a, b in zip(block_of(dst, 40 + n - 1), block_of(caches, n - 1)))


@STAGING
def test_save_async_returns_a_future_of_the_result(kv, staged):
    src = vllm_cache(seed=11)
    cache = PrefixKVCache(kv, src, model=f"async-{staged}", staging_bytes=staging(src, staged))
    tokens = prompt(6 * BT, seed=8)
    cache.save(tokens, [0, 1])
    f = cache.save_async(tokens, [0, 1, 2, 3, 4, 5])
    r = f.result(timeout=30)
    assert (r.stored, r.present, r.refused) == (4, 2, 0)
    done = cache.save_async(tokens, [0, 1, 2])  # everything held: settled at once
    assert done.done() and done.result().present == 3
    dst = vllm_cache(seed=12)
    assert PrefixKVCache(kv, dst, model=f"async-{staged}").load(tokens, [7, 8, 9, 10, 11, 12]) == 6
    assert all(same(a, b) for a, b in zip(block_of(dst, 12), block_of(src, 5)))


@STAGING
@pytest.mark.parametrize("kind", ["sglang", "mla"])
def test_other_layouts_round_trip(kv, kind, staged):
    g = torch.Generator().manual_seed(13)
    if kind == "sglang":  # per layer K and V token pools [slots, heads, head_dim]; a block = a page of BT slots
        k = [torch.randn(8 * BT, 2, 16, generator=g) for _ in range(2)]
        v = [torch.randn(8 * BT, 2, 16, generator=g) for _ in range(2)]
        layout = KVLayout.from_sglang(k, v, page_size=BT)
        dst_k, dst_v = [torch.zeros_like(t) for t in k], [torch.zeros_like(t) for t in v]
        dst = KVLayout.from_sglang(dst_k, dst_v, page_size=BT)
    else:
        caches = [torch.randn(8, BT, 48, generator=g) for _ in range(3)]
        layout = KVLayout.from_mla(caches)
        dst_c = [torch.zeros_like(t) for t in caches]
        dst = KVLayout.from_mla(dst_c)
    tokens = prompt(2 * BT, seed=14)
    saver = PrefixKVCache(kv, layout, model=f"{kind}-{staged}", block_tokens=BT, staging_bytes=staging(layout, staged))
    assert saver.save(tokens, [5, 2]).stored == 2
    reader = PrefixKVCache(kv, dst, model=f"{kind}-{staged}", block_tokens=BT, staging_bytes=staging(layout, 1))
    assert reader.lookup(tokens) == 2 and reader.load(tokens, [0, 7]) == 2
    for s in range(layout.num_segments):
        assert same(dst.seg_views[s][0], layout.seg_views[s][5]) and same(dst.seg_views[s][7], layout.seg_views[s][2])


def test_prefill_process_saves_and_a_decode_process_loads_through_the_worker(worker):
    """Prefill-to-decode hand-off: another process, with its own cache, loads what this one saved."""
    src = vllm_cache(seed=15)
    tokens = prompt(4 * BT + 3, seed=16)
    with kvstrata.connect(worker.address, timeout=5) as prefill:
        assert PrefixKVCache(prefill, src, model="pd").save(tokens, [6, 7, 8, 9]).stored == 4
        code = textwrap.dedent(
            f"""
            import sys, torch, kvstrata
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from test_integrations_prefix_cache import vllm_cache
            from kvstrata.integrations import PrefixKVCache
            dst = vllm_cache(seed=99)
            with kvstrata.connect({worker.address!r}, timeout=5) as decode:
                cache = PrefixKVCache(decode, dst, model="pd")
                n = cache.lookup({tokens!r})
                assert cache.load({tokens!r}, list(range(n))) == n == 4
            torch.save([t[:, :4].clone() for t in dst], sys.argv[1])
            """
        )
        out = Path(worker.config.socket).parent / "decoded.pt"
        env = {"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}
        proc = subprocess.run(
            [sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
    decoded = torch.load(out)
    for layer, t in enumerate(decoded):
        assert same(t, src[layer][:, 6:10])


def test_bad_input_is_refused_with_a_clear_error_and_nothing_stored(kv):
    cache = PrefixKVCache(kv, vllm_cache(), model="bad")
    tokens = prompt(3 * BT, seed=17)
    cases = [
        (lambda: cache.save(tokens, [0, 1, 32]), InvalidValue, r"block_ids\[2\]: 32 is outside the cache's 32 blocks"),
        (lambda: cache.save(tokens, [0, -1]), InvalidValue, r"block_ids\[1\]: -1 is outside"),
        (lambda: cache.save(tokens, [0, 1, 2, 3]), InvalidValue, "4 blocks to save, but the tokens fill 3 full"),
        (lambda: cache.save(tokens, [0, 1.0]), InvalidType, r"block_ids\[1\]: must be an int, got float"),
        (lambda: cache.save(tokens, "01"), InvalidType, "block_ids: a sequence of block indices, got str"),
        (lambda: cache.save(tokens, torch.tensor([0.0])), InvalidValue, "1-D integer tensor"),
        (lambda: cache.load(tokens, [4, 4]), InvalidValue, "block 4 named twice"),
        (lambda: cache.save([[1, 2]] * BT, [0]), InvalidValue, "tokens: must be 1-D"),
        (lambda: cache.save([0.5] * BT, [0]), InvalidValue, "integer token ids, got float64"),
        (lambda: cache.save(torch.ones(BT), [0]), InvalidValue, "integer token ids, got torch.float32"),
        (lambda: cache.save("hello", [0]), InvalidType, "tokens: token ids"),
        (lambda: cache.lookup(tokens, salt=3), InvalidType, "salt: must be a str, bytes or None, got int"),
        (lambda: cache.save(tokens, [0, 1], start=3), InvalidValue, "start: must be an int from 0 to the 2 blocks"),
        (lambda: cache.save_async(tokens, [0], start=-1), InvalidValue, "start: must be an int from 0"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert not any(kv.exists(cache.block_keys(tokens)))
    assert cache.save(tokens, np.array([0, 1, 2])).stored == 3  # numpy ids are ints too
    assert cache.load(tokens, torch.tensor([5, 6, 7])) == 3


def test_bad_construction_is_refused():
    with kvstrata.connect(embedded=True, memory_bytes="16MiB") as kv:
        caches = vllm_cache()
        with pytest.raises(InvalidValue, match=r"block_tokens: 8, but the cache's blocks hold 16 tokens"):
            PrefixKVCache(kv, caches, model="m", block_tokens=8)
        with pytest.raises(InvalidValue, match="block_tokens: needed with a KVLayout"):
            PrefixKVCache(kv, KVLayout.from_vllm(caches), model="m")
        with pytest.raises(InvalidValue, match="model: must be a non-empty str"):
            PrefixKVCache(kv, caches, model="")
        with pytest.raises(InvalidType, match="not one tensor"):
            PrefixKVCache(kv, caches[0], model="m")
        with pytest.raises(InvalidValue, match="key prefix"):
            PrefixKVCache(kv, caches, model="x" * 1000)
        with pytest.raises(InvalidValue, match="not encodable as UTF-8"):
            PrefixKVCache(kv, caches, model="m\udc80")


def test_a_foreign_value_under_a_block_key_is_a_miss_not_garbage(kv):
    cache = PrefixKVCache(kv, vllm_cache(), model="foreign")
    tokens = prompt(2 * BT, seed=18)
    kv.set(cache.block_keys(tokens)[0], b"not a block")
    with pytest.raises(KeyExists):
        kv.set(cache.block_keys(tokens)[0], b"x", nx=True)
    assert cache.load(tokens, [0, 1]) == 0 and cache.stats.load_misses == 2


@pytest.mark.gpu
@pytest.mark.parametrize("staging_bytes", [None, 0], ids=["packed", "pieces"])
def test_gpu_cache_round_trip_through_a_worker(worker, staging_bytes):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    src = vllm_cache(layers=4, blocks=64, heads=8, head_dim=128, dtype=torch.bfloat16, seed=19, device="cuda")
    dst = vllm_cache(layers=4, blocks=64, heads=8, head_dim=128, dtype=torch.bfloat16, seed=20, device="cuda")
    tokens = prompt(12 * BT, seed=21)
    model = f"gpu-{staging_bytes}"
    with client_for("unix", worker, memory=32 << 20, segment=8 << 20) as kv:
        saver = PrefixKVCache(kv, src, model=model, staging_bytes=staging_bytes)
        assert saver.staging_blocks == (0 if staging_bytes == 0 else STAGING_BYTES // saver.block_bytes)
        assert saver.save(tokens, list(range(12))).stored == 12
        reader = PrefixKVCache(kv, dst, model=model, staging_bytes=staging_bytes)
        assert reader.lookup(tokens) == 12
        f = saver.save_async(tokens + prompt(2 * BT, seed=22), list(range(14)))
        assert f.result(timeout=30).stored == 2
        assert reader.load(tokens, list(range(40, 52))) == 12
        torch.cuda.synchronize()
        for t_src, t_dst in zip(src, dst):
            assert torch.equal(t_dst[:, 40:52], t_src[:, :12])
        # A side stream: the packing is ordered on it, and the data is right once it is synchronized
        side = torch.cuda.Stream()
        longer = tokens + prompt(2 * BT, seed=22)
        with torch.cuda.stream(side):
            assert reader.load(longer, list(range(20, 34)), stream=side) == 14
        side.synchronize()
        assert all(torch.equal(d[:, 32:34], s[:, 12:14]) for s, d in zip(src, dst))
