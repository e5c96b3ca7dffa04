"""The KV-cache offload path across a cluster: PrefixKVCache over a ClusterClient spreads a prompt's blocks over the
workers, and another client (a decode instance elsewhere) finds and loads the prefix bit for bit."""

from __future__ import annotations

import numpy as np
import torch

import kvstrata
from kvstrata.cluster import owners
from kvstrata.integrations import PrefixKVCache

BT = 16


def vllm_cache(seed, layers=2, blocks=16, heads=2, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, BT, heads, head_dim, generator=g).half() for _ in range(layers)]


def test_a_prefix_saved_through_one_cluster_client_is_loaded_through_another(workers):
    workers.start(3)
    tokens = np.random.default_rng(0).integers(0, 32000, 6 * BT).tolist()
    src, dst = vllm_cache(1), vllm_cache(2)
    with kvstrata.connect(cluster=workers.url) as prefill, kvstrata.connect(cluster=workers.url) as decode:
        saver = PrefixKVCache(prefill, src, model="tiny")
        assert saver.save(tokens, [5, 1, 9, 0, 12, 3]).stored == 6
        keys = saver.block_keys(tokens)
        assert len({owners(k, prefill.nodes, 1)[0] for k in keys}) > 1  # (spread over the workers)
        loader = PrefixKVCache(decode, dst, model="tiny")
        assert loader.lookup(tokens) == 6
        assert loader.load(tokens, [0, 1, 2, 3, 4, 5]) == 6
        for got, want in zip(range(6), [5, 1, 9, 0, 12, 3]):
            for a, b in zip(dst, src):
                assert torch.equal(a[:, got], b[:, want])
