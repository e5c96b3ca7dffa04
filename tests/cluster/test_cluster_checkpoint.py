"""Weights across a cluster: a state_dict saved through one cluster client spreads its objects over the workers and
loads bit for bit through another."""

from __future__ import annotations

import pytest
import torch

import kvstrata
from kvstrata.cluster import owners
from kvstrata.integrations import checkpoint_manifest, load_state_dict, save_state_dict
from kvstrata.integrations.checkpoint import _object_key


def test_a_checkpoint_saved_through_one_cluster_client_loads_through_another(workers):
    workers.start(3)
    torch.manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)} | {"ids": torch.arange(100)}
    with kvstrata.connect(cluster=workers.url) as trainer, kvstrata.connect(cluster=workers.url) as server:
        info = save_state_dict(trainer, "m@1", weights, chunk_bytes=16 << 10)
        manifest = checkpoint_manifest(server, "m@1")
        keys = [_object_key("m@1", manifest["version"], i) for i in range(info.objects)]
        assert len({owners(k, server.nodes, 1)[0] for k in keys}) > 1  # (spread over the workers)
        loaded = load_state_dict(server, "m@1")
        assert all(torch.equal(loaded[k], v) for k, v in weights.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_weights_go_through_a_cluster_and_back_to_the_gpu(workers):
    workers.start(2, memory=64 << 20)
    torch.manual_seed(1)
    weights = {f"w{i}": torch.randn(256, 256, device="cuda").half() for i in range(4)}
    with kvstrata.connect(cluster=workers.url) as trainer, kvstrata.connect(cluster=workers.url) as server:
        save_state_dict(trainer, "gpu@1", weights, chunk_bytes=64 << 10)
        loaded = load_state_dict(server, "gpu@1", device="cuda")
        assert all(t.is_cuda for t in loaded.values())
        assert all(torch.equal(loaded[k], v) for k, v in weights.items())
