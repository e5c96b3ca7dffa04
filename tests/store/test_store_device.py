"""The HBM read cache. Without a GPU the tier runs on a torch CPU buffer (the same engine code)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.errors import CapacityError, KeyNotFound
from kvstrata.store import ObjectStore, StoreConfig

KB = 1024


def _tensor_bytes(store, lease) -> bytes:
    return store.device_tensor(lease.location).cpu().numpy().tobytes()


def test_device_copy_loaded_once_and_served(cpu_hbm, make_config):
    s = ObjectStore(make_config(gpu_bytes=256 * KB))
    s.put("a", bytes(range(256)) * 100)
    lease = s.acquire_device("a", owner=1)
    assert lease.location.segment == -1 and lease.size == 25600
    assert _tensor_bytes(s, lease) == bytes(range(256)) * 100
    lease2 = s.acquire_device("a", owner=2)
    assert lease2.location == lease.location and s.stats()["device_loads"] == 1
    s.release(lease.lease_id)
    s.release(lease2.lease_id)
    s.put("empty", b"")
    empty = s.acquire_device("empty", owner=1)
    assert s.device_tensor(empty.location).numel() == 0
    s.release(empty.lease_id)
    with pytest.raises(KeyNotFound):
        s.acquire_device("missing", owner=1)
    s.close()


def test_hbm_clock_evicts_unleased_copies_only(cpu_hbm, make_config):
    s = ObjectStore(make_config(gpu_bytes=256 * KB))
    for i in range(4):
        s.put(f"k{i}", bytes([i]) * (100 * KB))
    held = s.acquire_device("k0", owner=1)
    for i in (1, 2):
        s.release(s.acquire_device(f"k{i}", owner=1).lease_id)
    st = s.stats()
    assert st["device_loads"] == 3 and st["device_evictions"] == 1  # k1 went, k0 is leased
    assert _tensor_bytes(s, held) == bytes([0]) * (100 * KB)
    held2 = s.acquire_device("k2", owner=1)
    with pytest.raises(CapacityError, match="HBM"):
        s.acquire_device("k3", owner=1)  # both resident copies are leased
    s.release(held2.lease_id)
    s.release(s.acquire_device("k3", owner=1).lease_id)
    assert _tensor_bytes(s, held) == bytes([0]) * (100 * KB)
    s.release(held.lease_id)
    s.close()


def test_replace_keeps_leased_device_copy_until_release(cpu_hbm, make_config):
    s = ObjectStore(make_config(gpu_bytes=256 * KB))
    s.put("v", b"old" * 1000)
    lease = s.acquire_device("v", owner=1)
    s.put("v", b"new" * 1000)
    assert _tensor_bytes(s, lease) == b"old" * 1000
    fresh = s.acquire_device("v", owner=2)
    assert _tensor_bytes(s, fresh) == b"new" * 1000
    used = s.stats()["tiers"]["gpu"]["used"]
    s.release(lease.lease_id)
    assert s.stats()["tiers"]["gpu"]["used"] == used - 3008
    s.release(fresh.lease_id)
    s.delete(["v"])
    assert s.stats()["tiers"]["gpu"]["used"] == 0
    s.close()


def test_device_load_from_ssd_and_size_limits(cpu_hbm, tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20, gpu_bytes=512 * KB))
    for i in range(15):
        s.put(f"m{i}", bytes([i]) * (100 * KB))  # m0 spills to SSD
    lease = s.acquire_device("m0", owner=1)
    assert _tensor_bytes(s, lease) == bytes([0]) * (100 * KB)
    assert s.stats()["promotions"] >= 1
    s.release(lease.lease_id)
    s.put("big", bytes(600 * KB))
    with pytest.raises(CapacityError, match=str(600 * KB)):
        s.acquire_device("big", owner=1)
    s.close()


def test_no_hbm_tier_is_a_clear_error(store):
    store.put("a", b"x")
    with pytest.raises(ValueError, match="HBM"):
        store.acquire_device("a", owner=1)


@pytest.mark.gpu
def test_device_copy_on_cuda():
    s = ObjectStore(StoreConfig(memory_bytes=64 << 20, gpu_bytes=16 << 20, gpu_device=0, numa_node="auto"))
    payload = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    s.put("w", payload)
    lease = s.acquire_device("w", owner=1)
    t = s.device_tensor(lease.location)
    assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == 3 << 20
    assert torch.equal(t.cpu(), payload)
    assert s.stats()["tiers"]["gpu"]["host_registered"] >= 64 << 20  # DRAM page-locked for fast loads
    s.release(lease.lease_id)
    s.close()
