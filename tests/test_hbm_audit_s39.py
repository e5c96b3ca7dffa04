"""Session 39's audit of the HBM tier and the device calls: one test per defect found (each failed before its fix).

Without a GPU the HBM tier runs on a torch CPU buffer (as in ``tests/store/test_store_device.py``): the same engine
code, the copies memcpys.
"""

from __future__ import annotations

import threading

import pytest

from kv_helpers import worker_fixtures
from kvstrata.errors import ClosedError, InvalidType, InvalidValue
from kvstrata.store import ObjectStore, StoreConfig
from kvstrata.store.device import GPU_SEGMENT
from kvstrata.store.tiers.base import Location

KB = 1024


def _config(tmp_path=None, *, memory=1 << 20, **kw) -> StoreConfig:
    return StoreConfig(
        memory_bytes=memory,
        segment_bytes=1 << 20,
        disk_dir=None if tmp_path is None else str(tmp_path / "ssd"),
        disk_bytes=0 if tmp_path is None else 32 << 20,
        numa_node=None,
        hugepages="off",
        **kw,
    )


def _device_bytes(store, lease) -> bytes:
    return store.device_tensor(lease.location).cpu().numpy().tobytes()


# ------------------------------------------------------------------------------------ store: the HBM tier
def test_device_read_of_a_key_another_reader_is_bringing_back_from_ssd_waits_for_that_load(cpu_hbm, tmp_path):
    """acquire_device of a key on SSD only, while a plain reader's promotion of it is reading the file, loaded it
    into DRAM a second time: one of the two DRAM blocks was never freed (the memory tier's bytes stayed used with
    no object left)."""
    s = ObjectStore(_config(tmp_path, gpu_bytes=512 * KB))
    keys = [f"m{i}" for i in range(15)]
    for i, key in enumerate(keys):
        s.put(key, bytes([i]) * (100 * KB))  # the first ones spill to SSD
    assert s._objects["m0"].loc is None and s._objects["m0"].on_disk
    reading, go_on = threading.Event(), threading.Event()
    real_read = s._disk.read_into
    reads: list[str] = []

    def read_into(key, dest):
        reads.append(key)
        if len(reads) == 1:  # the plain reader's promotion: held while the device read comes in
            reading.set()
            go_on.wait(10)
        return real_read(key, dest)

    s._disk.read_into = read_into
    leases = {}
    reader = threading.Thread(target=lambda: leases.setdefault("plain", s.acquire("m0", owner=1)))
    reader.start()
    assert reading.wait(10)
    got = {}
    device_reader = threading.Thread(target=lambda: got.setdefault("device", s.acquire_device("m0", owner=2)))
    device_reader.start()
    device_reader.join(0.2)  # it waits for the promotion under way rather than starting one of its own
    go_on.set()
    reader.join(10)
    device_reader.join(10)
    assert reads == ["m0"]
    assert _device_bytes(s, got["device"]) == bytes([0]) * (100 * KB)
    s.release(leases["plain"].lease_id)
    s.release(got["device"].lease_id)
    s.delete(keys)
    assert s.stats()["objects"] == 0
    assert s.stats()["tiers"]["memory"]["used"] == 0  # every DRAM block went back
    assert s.stats()["tiers"]["gpu"]["used"] == 0
    s.close()


def test_a_device_load_unpinning_its_source_lets_the_watermark_pass_evict_again(cpu_hbm):
    """The DRAM source of an HBM load is pinned (a lease) while it is copied; the watermark pass that found only
    pinned objects stops looking until a lease is released. The load's unpin did not say so: memory stayed above
    the high watermark, full of objects nobody held, until some other lease happened to go."""
    s = ObjectStore(_config(gpu_bytes=1 << 20))
    s.put("big", bytes(950 * KB), write_mode="evictable")  # above the 90 % high watermark of the 1 MiB tier
    real_write = s._gpu.write

    def write(location, src, **kw):
        s._evict_to_low()  # the background pass, while the copy runs: "big" is pinned, nothing can go
        return real_write(location, src, **kw)

    s._gpu.write = write
    lease = s.acquire_device("big", owner=1)
    s.release(lease.lease_id)
    s._evict_to_low()  # the background pass's next look
    assert s.stats()["tiers"]["memory"]["used"] == 0 and s.exists(["big"]) == [False]
    s.close()


@pytest.mark.parametrize(
    "location",
    [Location(GPU_SEGMENT, 250 * KB, 10 * KB), Location(GPU_SEGMENT, -4, 4), Location(GPU_SEGMENT, 0, -1)],
    ids=["past-the-end", "negative-offset", "negative-size"],
)
def test_device_tensor_refuses_a_location_outside_the_hbm_tier(cpu_hbm, location):
    """A location past the tier's end, or with a negative offset or size, gave a shorter tensor (or one at the
    buffer's end) rather than an error naming it."""
    s = ObjectStore(_config(gpu_bytes=256 * KB))
    with pytest.raises(InvalidValue, match="location"):
        s.device_tensor(location)
    s.close()


def test_device_reads_that_close_overtakes_raise_closed_error(cpu_hbm):
    """close() while acquire_device copied without the lock left that call to fail on the tier's dropped buffer with
    a bare TypeError, and a reader waiting for that copy to load the key again from a closed store."""
    s = ObjectStore(_config(gpu_bytes=1 << 20))
    s.put("a", b"x" * 100_000)
    copying, go_on = threading.Event(), threading.Event()
    real_write = s._gpu.write

    def write(location, src, **kw):
        copying.set()
        go_on.wait(10)
        return real_write(location, src, **kw)

    s._gpu.write = write
    got: dict = {}

    def read(name):
        try:
            got[name] = s.acquire_device("a", owner=name)
        except Exception as exc:
            got[name] = exc

    loader = threading.Thread(target=read, args=("loader",))
    loader.start()
    assert copying.wait(10)
    waiter = threading.Thread(target=read, args=("waiter",))
    waiter.start()
    waiter.join(0.1)  # waits for the loader's copy
    s.close()
    go_on.set()
    loader.join(10)
    waiter.join(10)
    assert isinstance(got["loader"], ClosedError), got
    assert isinstance(got["waiter"], ClosedError), got


# ------------------------------------------------------------------------------------ client: the device calls
worker, kv = worker_fixtures("hbm-audit-worker", memory=16 << 20, segment=4 << 20)


@pytest.mark.parametrize("call", ["async_mset_d2h", "async_mget_h2d"])
@pytest.mark.parametrize("lists", [5, [5], None, [None]], ids=["int", "int-in-list", "none", "none-in-list"])
def test_async_device_calls_name_malformed_tensor_lists(kv, call, lists):
    """The async calls looked for the caller's CUDA stream by iterating ``tensor_lists`` before any check: malformed
    lists raised a bare TypeError ("'int' object is not iterable"), where the same call made synchronously names
    ``tensor_lists`` (kvstrata.InvalidType)."""
    with pytest.raises(InvalidType, match=r"tensor_lists"):
        getattr(kv, call)(["audit/x"], lists).result(timeout=10)
    with pytest.raises(InvalidType, match=r"tensor_lists"):
        getattr(kv, call.removeprefix("async_"))(["audit/x"], lists)
    assert kv.exists(["audit/x"]) == [False]


def test_unregister_all_tries_every_region_when_one_fails(monkeypatch):
    """A CUDA error unregistering one host region left the regions after it registered (and listed) for good."""
    import kvstrata.memory
    from kvstrata.store.tiers.gpu import GpuTier

    tried = []

    def unregister(address):
        tried.append(address)
        if address == 2:
            raise RuntimeError("cudaHostUnregister failed")

    monkeypatch.setattr(kvstrata.memory, "unregister", unregister)
    tier = GpuTier.__new__(GpuTier)
    tier._registered = {1: 10, 2: 20, 3: 30}
    with pytest.raises(RuntimeError, match="cudaHostUnregister"):
        tier.unregister_all()
    assert tried == [1, 2, 3] and tier._registered == {}
