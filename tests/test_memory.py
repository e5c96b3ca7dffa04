import ctypes
import gc
import threading

import pytest
import torch

from kvstrata.memory import (
    alloc_numa_pinned_tensor,
    alloc_pinned,
    device_ptr,
    device_view,
    get_device_ptr,
    host_register,
    is_registered,
    pinned,
    register,
    unregister,
)

HAS_CUDA = torch.cuda.is_available()


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.fixture
def buf():
    t = torch.zeros(4096, dtype=torch.uint8)
    yield t
    if is_registered(t.data_ptr()):
        unregister(t)


def test_register_range_lookup(buf):
    addr = buf.data_ptr()
    dev = register(buf)
    assert device_ptr(addr) == dev
    assert device_ptr(addr + 4095) == dev + 4095
    assert is_registered(addr, 4096)
    assert not is_registered(addr, 4097)
    assert not is_registered(addr - 1)
    with pytest.raises(ValueError, match=hex(addr + 4096)):
        device_ptr(addr + 4096)
    # A range inside a registered region reuses it; a partial overlap is refused.
    assert register(addr + 100, 50) == dev + 100
    with pytest.raises(ValueError, match="overlaps"):
        register(addr + 4000, 200)
    unregister(addr + 100)  # each registration is undone by one unregister
    assert is_registered(addr, 4096)
    unregister(buf)
    assert not is_registered(addr)
    with pytest.raises(ValueError, match="host_ptr"):
        get_device_ptr(addr)
    with pytest.raises(ValueError, match="no registered region"):
        unregister(buf)


def test_register_raw_address_and_aliases():
    raw = (ctypes.c_uint8 * 8192)()
    addr = ctypes.addressof(raw)
    with pytest.raises(ValueError, match="nbytes"):
        register(addr)
    dev = register(addr, 8192)
    assert get_device_ptr(addr + 8) == dev + 8
    unregister(addr)
    t = torch.zeros(16)
    assert host_register(t) == device_ptr(t.data_ptr())
    unregister(t)


def test_register_bad_arguments():
    with pytest.raises(ValueError, match="contiguous"):
        register(torch.zeros(8, 8).t())
    with pytest.raises(TypeError, match="tensor_or_addr"):
        register("0x1000", 10)
    with pytest.raises(ValueError, match="nbytes"):
        register(torch.zeros(0))


def test_registry_thread_safe():
    tensors = [torch.zeros(256, dtype=torch.uint8) for _ in range(64)]
    errors = []

    def work(chunk):
        try:
            for t in chunk:
                register(t)
                assert device_ptr(t.data_ptr() + 1) - 1 == device_ptr(t.data_ptr())
                unregister(t)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(tensors[i::4],)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert not any(is_registered(t.data_ptr()) for t in tensors)


def test_device_view_requires_registration(buf):
    with pytest.raises(ValueError, match="not registered"):
        device_view(buf)
    with pytest.raises(ValueError, match="not registered"):
        pinned.device_alias(buf)
    register(buf)
    view = device_view(buf[10:20])
    alias = pinned.device_alias(buf[10:20])
    if not HAS_CUDA:
        assert view.data_ptr() == alias.data_ptr() == buf.data_ptr() + 10


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU fallbacks")
def test_alloc_pinned_without_gpu_says_so(caplog):
    caplog.set_level("INFO", logger="kvstrata.memory.pinned")
    t = alloc_pinned(3 << 20)
    info = t.pinned_info
    assert t.dtype == torch.uint8 and t.shape == (3 << 20,)
    assert info.nbytes == 3 << 20 and not info.cuda_registered
    assert info.numa_node is None and not info.numa_bound
    assert info.hugepages in ("explicit", "transparent", "none")
    assert any("no CUDA" in f for f in info.fallbacks)
    assert any("NUMA" in f for f in info.fallbacks)
    for reason in info.fallbacks:
        assert reason in caplog.text
    assert is_registered(t.data_ptr(), t.numel())
    assert bool((t == 0).all())
    assert alloc_numa_pinned_tensor(4096).pinned_info.nbytes == 4096


def test_alloc_pinned_bad_arguments():
    for bad in ("x", -1, 1.5, True):
        with pytest.raises(ValueError, match="numa"):
            alloc_pinned(4096, numa=bad)
    with pytest.raises(ValueError, match="numa"):
        alloc_pinned(4096, numa=10_000)  # not an online node
    with pytest.raises(ValueError, match="nbytes"):
        alloc_pinned(0)
    with pytest.raises(ValueError, match="hugepages"):
        alloc_pinned(4096, hugepages="yes")
    with pytest.raises(MemoryError, match=f"could not map {1 << 60} bytes"):  # beyond any address space
        alloc_pinned(1 << 60)


@pytest.mark.parametrize("accepted", [True, False])
def test_alloc_pinned_binds_to_requested_node(monkeypatch, accepted):
    calls = []

    def fake_bind(addr, nbytes, node):
        calls.append((addr, nbytes, node))
        return accepted

    monkeypatch.setattr(pinned._numa, "bind", fake_bind)
    t = alloc_pinned(10000, numa=0, hugepages="none")
    assert calls and calls[0][0] == t.data_ptr() and calls[0][1] >= 10000 and calls[0][2] == 0
    assert t.pinned_info.numa_node == 0
    assert t.pinned_info.numa_bound is accepted
    assert t.pinned_info.hugepages == "none"
    assert any("mbind" in f for f in t.pinned_info.fallbacks) is (not accepted)


def test_alloc_pinned_no_binding_when_numa_none(monkeypatch):
    monkeypatch.setattr(pinned._numa, "bind", lambda *a: pytest.fail("bind called"))
    t = alloc_pinned(4096, numa=None)
    assert t.pinned_info.numa_node is None and not t.pinned_info.numa_bound


def test_alloc_pinned_freed_when_last_view_dies():
    t = alloc_pinned(1 << 20, numa=None)
    addr = t.data_ptr()
    view = t[100:200]
    t[150] = 7
    del t
    gc.collect()
    assert is_registered(addr) and _mapped(addr) and int(view[50]) == 7
    del view
    gc.collect()
    assert not is_registered(addr)
    assert not _mapped(addr)


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_alloc_pinned_registered_and_pinned():
    t = alloc_pinned(8 << 20)
    info = t.pinned_info
    assert info.cuda_registered
    assert t.is_pinned()
    assert info.numa_node == pinned._numa.numa_node(torch.cuda.current_device())
    dev = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    t.copy_(torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8))
    dev.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), t)


@pytest.mark.gpu
def test_gpu_device_view_aliases_host_memory():
    t = alloc_pinned(1 << 20).view(torch.bfloat16).view(512, 1024)
    view = device_view(t)
    assert view.is_cuda and view.dtype == torch.bfloat16 and view.shape == t.shape and view.stride() == t.stride()
    assert view.data_ptr() == device_ptr(t.data_ptr())
    view[3].fill_(2.5)  # write through the view, read on the host
    torch.cuda.synchronize()
    assert bool((t[3] == 2.5).all()) and bool((t[4] == 0).all())
    t[5] = 1.25  # and the reverse
    assert float(view[5].float().sum()) == 1.25 * 1024
    fp8 = t.view(torch.uint8)[:256].view(torch.float8_e4m3fn)
    assert device_view(fp8).dtype == torch.float8_e4m3fn
    alias = pinned.device_alias(t[:, 8:16])  # the ops' cheap non-owning alias, strided
    assert alias.is_cuda and alias.data_ptr() == t[:, 8:16].data_ptr() and alias.stride() == t.stride()
    alias[7].fill_(-1.0)
    torch.cuda.synchronize()
    assert bool((t[7, 8:16] == -1.0).all()) and bool((t[7, :8] == 0).all())


@pytest.mark.gpu
def test_gpu_register_torch_tensor_and_view():
    t = torch.arange(1024, dtype=torch.float32)
    register(t)
    try:
        assert t.is_pinned()
        assert torch.equal(device_view(t).cpu(), t)
    finally:
        unregister(t)
    assert not t.is_pinned()


def test_registry_counts_nested_registrations():
    """Two users of one range (e.g. a client and the store's HBM tier) each undo their own use; the
    region stays registered until the last one does."""
    import mmap

    from kvstrata.memory import is_registered, register, unregister

    m = mmap.mmap(-1, 1 << 16)
    t = torch.frombuffer(m, dtype=torch.uint8)
    addr = t.data_ptr()
    register(addr, 1 << 16)
    register(addr + 4096, 4096)  # inside: one more use of the same region
    unregister(addr + 4096)
    assert is_registered(addr, 1 << 16)
    unregister(addr)
    assert not is_registered(addr)
    with pytest.raises(ValueError, match="no registered region"):
        unregister(addr)
    del t
    m.close()


def test_freeing_a_buffer_the_caller_also_registered_leaves_no_region():
    """HeteroFusedKernels' pairing (allocate, then register): the second registration counted one more use, and the
    buffer's release dropped only one, so the registry went on vouching for unmapped memory."""
    buf = alloc_numa_pinned_tensor(1 << 16)
    addr, n = buf.data_ptr(), buf.numel()
    host_register(buf)
    del buf
    gc.collect()
    assert not is_registered(addr, n)


def test_register_checks_sizes_and_addresses():
    t = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="more than the tensor's 1024"):
        register(t, 1 << 30)  # CUDA would pin pages the tensor does not own
    with pytest.raises(TypeError, match="nbytes"):
        register(t, 1.9)
    with pytest.raises(TypeError, match="nbytes"):
        register(t, "16")
    for addr in (0, -100):
        with pytest.raises(ValueError, match="host address > 0"):
            register(addr, 100)


@pytest.mark.parametrize("nbytes", [2**63 - 1, 2**64])
def test_alloc_pinned_beyond_an_address_space_is_a_memory_error(nbytes):
    with pytest.raises(MemoryError, match=str(nbytes)):
        alloc_pinned(nbytes, numa=None)
