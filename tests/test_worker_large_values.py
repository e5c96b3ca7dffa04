"""A worker whose small values once mapped its whole memory tier still takes a value larger than a segment (whole
segments emptied and retired: kvstrata.store.tiers.memory), and its clients, old and new, read everything back; a
client connecting afterwards is not handed the retired segments."""

from __future__ import annotations

import numpy as np
import pytest

import kvstrata
from kv_helpers import worker_fixtures
from kvstrata.cli.status import render
from kvstrata.server.metrics import to_prometheus

MB = 1 << 20

worker, kv = worker_fixtures("large-values-worker", memory=8 * MB, segment=2 * MB, modes=("unix",))


def _value(i: int, size: int) -> np.ndarray:
    return np.full(size, i % 251 + 1, dtype=np.uint8)


def test_a_large_value_after_the_tier_filled_with_small_ones_and_a_client_connecting_afterwards(kv, worker):
    keys = [f"small/{i}" for i in range(4)]
    for i, key in enumerate(keys):  # one per 2 MiB segment: the 8 MiB tier is fully mapped
        kv.set(key, _value(i, 2 * MB - 64 * 1024), write_mode="evictable")
    assert kv.stats()["tiers"]["memory"]["mapped"] == 8 * MB
    kv.set("big", _value(77, 5 * MB))  # 5 MiB: a 6 MiB segment of its own, three small segments go
    retired = worker._store.retired_segments
    assert len(retired) == 3
    assert np.array_equal(np.frombuffer(kv.get("big"), dtype=np.uint8), _value(77, 5 * MB))
    with kvstrata.connect(worker.address, timeout=5) as other:
        backend = other._backend
        assert not set(retired) & set(backend._segments)  # never mapped by a client that came later
        assert backend.request({"op": "segments", "indices": retired}) is not None
        assert not set(retired) & set(backend._segments)  # nor handed out when asked for
        with other.get_buffers(["big"])[0] as view:  # a zero-copy view in the value's own segment
            assert np.array_equal(view.numpy(), _value(77, 5 * MB))
    stats = kv.stats()["tiers"]["memory"]
    assert stats["retired_segments"] == 3 and stats["mapped"] <= 8 * MB
    assert "3 segments retired" in render(kv.stats(), worker.address)  # kvstrata status says so
    assert "kvstrata_tier_retired_segments" in to_prometheus(kv.stats())
    # the evicted small values miss; the one left reads back whole
    left = [key for key in keys if kv.exists([key])[0]]
    for key in left:
        assert np.array_equal(np.frombuffer(kv.get(key), dtype=np.uint8), _value(keys.index(key), 2 * MB - 64 * 1024))


@pytest.mark.gpu
def test_a_gpu_client_that_page_locked_the_retired_segments_reads_the_large_value_into_cuda(kv, worker):
    import torch

    from kvstrata.memory import is_registered

    keys = [f"gpu-small/{i}" for i in range(3)]  # (a fourth would pass the high watermark: one evicted)
    kv.delete([*keys, "gpu-big", "big", *(f"small/{i}" for i in range(4))])  # the first test's too
    for i, key in enumerate(keys):
        kv.set(key, _value(i, 2 * MB - 64 * 1024), write_mode="evictable")
    dst = [[torch.empty(2 * MB - 64 * 1024, dtype=torch.uint8, device="cuda")] for _ in keys]
    assert kv.mget_h2d(keys, dst) == [None] * 3  # this client registers the segments they lie in with CUDA
    src = torch.randint(0, 256, (7 * MB,), dtype=torch.uint8, device="cuda")
    retired = len(worker._store.retired_segments)
    registered = dict(kv._registrations.bases)  # segment -> address, page-locked by this client
    assert registered and all(is_registered(addr) for addr in registered.values())
    assert kv.mset_d2h(["gpu-big"], [[src]]) == [None]  # the whole tier: every segment this client registered goes
    gone = set(worker._store.retired_segments[retired:])
    assert gone
    out = torch.zeros_like(src)
    assert kv.mget_h2d(["gpu-big"], [[out]]) == [None]
    assert torch.equal(out, src)
    # told with a reply, the client unregistered what it had page-locked (its pages would stay out of the kernel's
    # hands for as long as the client lives) and unmapped it, once its copies could no longer read it
    assert gone & set(registered) and kv._registrations.retiring == 0
    for index in gone & set(registered):
        assert not is_registered(registered[index]) and index not in kv._registrations.bases
        assert index not in kv._backend._segments
