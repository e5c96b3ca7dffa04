"""mget_h2d in one pass where this client kept every lease (kvstrata.client.kept_reads): taken only then, exact,
per-key results, its batches, its leases back on every path; and the local-read cache's all-or-nothing lookup."""

from __future__ import annotations

import ctypes

import pytest
import torch

import kvstrata
from _stages import outcomes
from kv_helpers import worker_config
from kvstrata.client import device, kept_reads
from kvstrata.ops import copy_engine
from kvstrata.server import Worker

MEMORY = 64 << 20


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    config = worker_config(tmp_path_factory.mktemp("kept-worker"), memory=MEMORY, segment=16 << 20)
    with Worker(config).start() as w:
        yield w


@pytest.fixture
def kv(worker):
    with kvstrata.connect(worker.address) as client:
        yield client


def _lists(n, sizes=(1000, 24), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 255, (s,), generator=g, dtype=torch.uint8) for s in sizes] for _ in range(n)]


def _poisoned(lists):
    return [[torch.full_like(t, 0xAB) for t in ts] for ts in lists]


def _written(kv, prefix, n, **kw):
    keys = [f"{prefix}/{i}" for i in range(n)]
    kv.delete(keys)
    src = _lists(n, **kw)
    assert kv.mset_d2h(keys, src) == [None] * n
    return keys, src


def test_kept_leases_go_in_one_pass_with_no_request_and_exact_bytes(kv, worker, monkeypatch):
    keys, src = _written(kv, "one-pass", 12)
    took = outcomes(monkeypatch, kept_reads)
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 12  # first read: leases asked for, then kept
    holders = dict(kv._backend._holders)
    before = worker.counters["requests"]
    for _ in range(3):
        dst = _poisoned(src)
        assert kv.mget_h2d(keys, dst) == [None] * 12
        assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))
    assert took == [False, True, True, True]
    assert worker.counters["requests"] == before  # no round trip at all
    assert kv._backend._holders == holders  # every hold the calls took went back


def test_a_key_named_twice_and_empty_tensors(kv):
    keys, src = _written(kv, "twice", 3, sizes=(64, 0, 16))
    kv.mget_h2d(keys, _poisoned(src))
    holders = dict(kv._backend._holders)
    dst = _poisoned([src[1], src[1], src[0]])
    assert kv.mget_h2d([keys[1], keys[1], keys[0]], dst) == [None] * 3
    assert all(torch.equal(a, b) for x, y in zip([src[1], src[1], src[0]], dst) for a, b in zip(x, y))
    assert kv._backend._holders == holders


def test_a_size_mismatch_is_its_keys_error_and_the_others_are_filled(kv, monkeypatch):
    keys, src = _written(kv, "mismatch", 4)
    kv.mget_h2d(keys, _poisoned(src))
    took = outcomes(monkeypatch, kept_reads)
    dst = _poisoned(src)
    dst[2] = [torch.zeros(1000, dtype=torch.uint8)]  # 1,000 bytes for an object of 1,024
    res = kv.mget_h2d(keys, dst)
    assert took == [True]
    assert isinstance(res[2], ValueError) and "1000 bytes for 'mismatch/2', which holds 1024" in str(res[2])
    assert [r is None for r in res] == [True, True, False, True]
    assert torch.equal(dst[2][0], torch.zeros(1000, dtype=torch.uint8))  # nothing copied into it
    assert all(torch.equal(a, b) for i in (0, 1, 3) for a, b in zip(src[i], dst[i]))


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([torch.zeros(32, 32).t()], ValueError, "contiguous"),
        (["not a tensor"], TypeError, r"expected a torch.Tensor"),
        ("not a list", TypeError, "must be a list of tensors"),
    ],
)
def test_a_bad_tensor_raises_and_gives_every_lease_back(kv, worker, monkeypatch, bad, exc, match):
    keys, src = _written(kv, "bad", 6)
    kv.mget_h2d(keys, _poisoned(src))
    holders = dict(kv._backend._holders)
    took = outcomes(monkeypatch, kept_reads)
    dst = _poisoned(src)
    dst[4] = bad
    with pytest.raises(exc, match=match) as raised:
        kv.mget_h2d(keys, dst)
    assert str(raised.value).startswith("tensor_lists[4]")
    assert took == ["raised"]
    assert kv._backend._holders == holders
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 6  # the client goes on


def test_a_rewritten_or_missing_key_takes_the_staged_path(kv, worker, monkeypatch):
    keys, src = _written(kv, "changed", 5)
    kv.mget_h2d(keys, _poisoned(src))
    took = outcomes(monkeypatch, kept_reads)
    with kvstrata.connect(worker.address) as other:
        other.delete(keys[3])
        new = [torch.full((1024,), 7, dtype=torch.uint8)]
        assert other.mset_d2h([keys[3]], [new]) == [None]
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 5
    assert torch.equal(torch.cat(dst[3]), new[0])  # the new value, not the kept one
    kv.delete(keys[1])
    res = kv.mget_h2d(keys, _poisoned(src))
    assert took == [False, False] and isinstance(res[1], kvstrata.KeyNotFound)


def test_entries_if_all_is_all_or_nothing_and_leaves_a_stale_entry_for_the_slow_path(kv, worker):
    keys, src = _written(kv, "all-or-nothing", 4)
    kv.mget_h2d(keys, _poisoned(src))
    local = kv._backend._local
    got = local.entries_if_all(keys)
    assert got is not None and [e[1].size for e in got] == [1024] * 4
    assert local.entries_if_all([*keys, "never-read"]) is None
    with kvstrata.connect(worker.address) as other:
        other.delete(keys[0])
    assert local.entries_if_all(keys) is None
    assert keys[0] in local._entries  # still there: dropped (its lease given back) by the staged path's lookup
    assert local.entries(keys)[0] is None and keys[0] not in local._entries


def test_the_embedded_client_never_keeps_leases(tmp_path):
    with kvstrata.connect(embedded=True, memory_bytes=16 << 20) as kv:
        keys, src = _written(kv, "embedded", 3)
        assert kv._backend.kept_leases(keys) is None
        dst = _poisoned(src)
        assert kv.mget_h2d(keys, dst) == [None] * 3
        assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))


class _Stream:
    """A copy stream without a GPU: ``device.start``'s result, as the batches see it."""

    cuda_stream, device_index = 1, 0

    def synchronize(self):
        pass


def test_device_copies_start_after_two_keys_then_go_in_batches_twice_as_large(kv, monkeypatch):
    """Without a GPU: CPU tensors taken as CUDA ones, the copy engine's batches done by memmove."""
    n = 40
    keys, src = _written(kv, "batches", n, sizes=(4096,))
    kv.mget_h2d(keys, _poisoned(src))
    real_check = device.check_key
    cuda = torch.device("cuda", 0)

    def check_key(ts, i):  # the pieces as CUDA ones (a device run per key: no two tensors continue each other)
        pieces, total, _ = real_check(ts, i)
        return [(*p[:2], True, p[3], p[0]) for p in pieces], total, cuda

    batches: list[int] = []

    def memcpy_raw(dsts, srcs, sizes, handle):
        batches.append(len(sizes))
        for d, s, z in zip(dsts, srcs, sizes):
            ctypes.memmove(d, s, z)

    monkeypatch.setattr(device, "check_key", check_key)
    monkeypatch.setattr(device, "start", lambda dev, stream=None: _Stream())
    monkeypatch.setattr(device, "mark", lambda stream: None)
    monkeypatch.setattr(copy_engine, "memcpy_raw", memcpy_raw)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    registered = []
    monkeypatch.setattr(device, "register_segment", lambda addr, nbytes: registered.append(addr) or False)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * n
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    # 2 (the first batch), 4, 8, then 16s, and what is left at the end
    assert batches == [2, 4, 8, 16, 10]
    assert registered  # every segment the copies read was offered to CUDA before them


def test_a_lease_dropped_from_the_cache_mid_call_stays_held_until_the_call_ends(kv, worker, monkeypatch):
    # Another thread of this client may find an entry stale (its key rewritten) and drop it while a one-pass read
    # copies from its lease: the read's own hold keeps the lease, so the old bytes stay put until the copy is done.
    keys, src = _written(kv, "held", 3, sizes=(4096,))
    kv.mget_h2d(keys, _poisoned(src))
    backend = kv._backend
    leases_before = kv.stats()["leases"]
    during = []
    real_enqueue = device.enqueue

    def enqueue(runs, *args, **kwargs):
        if not during:
            during.append(None)  # once (the rewrite below enqueues too)
            with kvstrata.connect(worker.address) as other:  # keys[0] rewritten under the read
                other.delete([keys[0]])
                assert other.mset_d2h([keys[0]], [[torch.zeros(4096, dtype=torch.uint8)]]) == [None]
            assert backend._local.entries([keys[0]]) == [None]  # found stale: dropped, its lease due back
            backend.release([])  # what is due goes now: not the lease the read holds
            during[0] = kv.stats()["leases"]
        return real_enqueue(runs, *args, **kwargs)

    monkeypatch.setattr(device, "enqueue", enqueue)
    took = outcomes(monkeypatch, kept_reads)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 3
    assert took == [True]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))  # the old version, whole
    assert during == [leases_before]  # the stale lease still held: the worker counts every lease it counted
    monkeypatch.undo()
    assert kv.stats()["leases"] == leases_before - 1  # the call's hold went with it: the stale lease is released
    kv.delete(keys)
