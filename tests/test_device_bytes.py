"""Device calls through a worker over TCP (no shared memory: kvstrata.client.device_bytes): the same objects as the
shared-memory path, bit for bit, both ways; write-once; sizes checked; bad tensors named; the async variants."""

from __future__ import annotations

import pytest
import torch

import kvstrata
from kvstrata.errors import InvalidType, InvalidValue, KeyExists, KeyNotFound, Timeout
from kvstrata.server import Worker, WorkerConfig

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]


@pytest.fixture
def tcp_worker(tmp_path):
    """One worker on a Unix socket and on TCP (as a cluster worker is): returns (unix client, tcp client)."""
    w = Worker(
        WorkerConfig(
            socket=str(tmp_path / "w.sock"), memory=64 << 20, disk_dir="", cluster="inproc://device-bytes-" +
            tmp_path.name, cluster_listen="tcp://127.0.0.1:0",
        )
    ).start()  # fmt: skip
    local = kvstrata.connect(address=w.address)
    remote = kvstrata.connect(address=w.member.address)
    try:
        assert not remote._b().shm and local._b().shm
        yield local, remote
    finally:
        local.close()
        remote.close()
        w.stop()


def tensors(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 255, (3, 40), generator=g, dtype=torch.uint8)
    return [raw.view(torch.int8).to(dtype), torch.arange(7)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tcp_and_shared_memory_store_the_same_objects(tcp_worker, dtype):
    local, remote = tcp_worker
    src = [tensors(i, dtype) for i in range(4)]
    assert remote.mset_d2h(["r0", "r1"], src[:2]) == [None, None]
    assert local.mset_d2h(["l0", "l1"], src[2:]) == [None, None]
    for reader in (local, remote):
        dst = [[torch.empty_like(t) for t in ts] for ts in src]
        assert reader.mget_h2d(["r0", "r1", "l0", "l1"], dst) == [None] * 4
        assert all(same(a, b) for a, b in zip(src, dst))
    assert remote.get("r0") == local.get("r0") == b"".join(bytes(t.view(torch.uint8).numpy()) for t in src[0])


def test_large_tensors_over_tcp_come_back_bit_for_bit(tcp_worker):
    """Values of 64 KiB and more travel as attachments and are read into the tensors from the reply's own buffer."""
    local, remote = tcp_worker
    g = torch.Generator().manual_seed(3)
    src = [[torch.randn(n, generator=g), torch.randint(0, 9, (5,), generator=g)] for n in (16_384, 1 << 20, 10)]
    assert remote.mset_d2h(["a", "b", "c"], src) == [None] * 3
    for reader in (remote, local):
        dst = [[torch.empty_like(t) for t in ts] for ts in src]
        assert reader.mget_h2d(["a", "b", "c"], dst) == [None] * 3
        assert all(same(a, b) for a, b in zip(src, dst))


def test_tcp_device_calls_are_write_once_and_check_sizes(tcp_worker):
    _, remote = tcp_worker
    src = [torch.ones(8), torch.zeros(2, dtype=torch.int32)]
    assert remote.mset_d2h(["k"], [src]) == [None]
    again = remote.mset_d2h(["k", "new"], [[torch.full((8,), 2.0)], [torch.ones(1)]])
    assert isinstance(again[0], KeyExists) and again[1] is None
    dst = [torch.empty(8), torch.empty(2, dtype=torch.int32)]
    assert remote.mget_h2d(["k"], [dst]) == [None] and torch.equal(dst[0], src[0])
    untouched = torch.full((3,), 7.0)
    wrong = remote.mget_h2d(["k", "absent"], [[untouched], [torch.empty(1)]])
    assert (
        isinstance(wrong[0], InvalidValue)
        and "40 bytes" in str(wrong[0])
        and torch.equal(untouched, torch.full((3,), 7.0))
    )
    assert isinstance(wrong[1], KeyNotFound)
    assert isinstance(remote.async_mget_h2d(["never"], [[torch.empty(1)]], timeout=0.1).result(timeout=10)[0], Timeout)
    assert isinstance(remote.mget_h2d(["never"], [[torch.empty(1)]], timeout=0.1)[0], Timeout)


def test_tcp_device_calls_refuse_bad_tensors_by_name(tcp_worker):
    _, remote = tcp_worker
    with pytest.raises(ValueError, match=r"tensor_lists\[0\]\[0\]"):
        remote.mset_d2h(["k"], [[torch.ones(4, 4).t()]])  # not contiguous
    with pytest.raises(InvalidType, match=r"tensor_lists\[0\]"):
        remote.mset_d2h(["k"], ["not tensors"])
    with pytest.raises(ValueError, match="tensor_lists"):
        remote.mget_h2d(["a", "b"], [[torch.empty(1)]])
    assert not remote.exists("k")


def test_tcp_async_device_calls(tcp_worker):
    _, remote = tcp_worker
    src = [[torch.randn(32)] for _ in range(3)]
    futures = [remote.async_mset_d2h([f"a{i}"], [src[i]]) for i in range(3)]
    assert [f.result(timeout=30) for f in futures] == [[None]] * 3
    dst = [[torch.empty(32)] for _ in range(3)]
    assert remote.async_mget_h2d(["a0", "a1", "a2"], dst).result(timeout=30) == [None] * 3
    assert all(same(a, b) for a, b in zip(src, dst))
    failed = remote.async_mset_d2h(["bad"], [[torch.ones(2, 2).t()]])
    with pytest.raises(ValueError):
        failed.result(timeout=30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensors_over_tcp(tcp_worker):
    local, remote = tcp_worker
    src = [[torch.randn(1024, device="cuda"), torch.arange(9, device="cuda")] for _ in range(3)]
    stream = torch.cuda.Stream()
    assert remote.mset_d2h(["g0", "g1", "g2"], src, stream=stream) == [None] * 3
    dst = [[torch.empty(1024, device="cuda"), torch.empty(9, dtype=torch.long, device="cuda")] for _ in range(3)]
    assert local.mget_h2d(["g0", "g1", "g2"], dst) == [None] * 3
    assert all(same(a, b) for a, b in zip(src, dst))
    dst2 = [[torch.empty_like(t) for t in ts] for ts in src]
    assert remote.async_mget_h2d(["g0", "g1", "g2"], dst2).result() == [None] * 3
    assert all(same(a, b) for a, b in zip(src, dst2))
