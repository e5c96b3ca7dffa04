"""mget_h2d in one pass from the placement table's advice (kvstrata.client.placed_reads): when it is taken, and its
leases back on every path, the one request sent or not when a bad tensor stops it. The copies' order against the
request and the redoing of wrong advice: test_client_device's placement tests."""

from __future__ import annotations

import pytest
import torch

import kvstrata
from _stages import PLANNER_IDS, PLANNERS, _Stream, batch_call, batches_of, fake_gpu, outcomes
from kv_helpers import worker_fixtures
from kvstrata.client import device, placed_reads
from kvstrata.errors import KeyNotFound
from kvstrata.ops.copy_engine import CopyEngineError

worker, kv = worker_fixtures("placed-worker", memory=64 << 20, segment=16 << 20, modes=("unix",))


@pytest.fixture
def writer(worker):
    with kvstrata.connect(worker.address) as client:
        yield client


def _lists(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 255, (1000,), generator=g, dtype=torch.uint8)] for _ in range(n)]


def _poisoned(lists):
    return [[torch.full_like(t, 0xAB) for t in ts] for ts in lists]


def _written(writer, prefix, n, seed=0):
    keys = [f"{prefix}/{i}" for i in range(n)]
    writer.delete(keys)
    src = _lists(n, seed)
    assert writer.mset_d2h(keys, src) == [None] * n
    assert writer.exists(keys) == [True] * n  # shown (the landing word read) before the test's read
    return keys, src


#: the CPU path as it is (no GPU: host copies), or a GPU faked with CPU tensors and each planner of _stages.PLANNERS
GPUS = pytest.mark.parametrize("gpu", [None, *PLANNERS], ids=["cpu", *(f"fake-gpu-{i}" for i in PLANNER_IDS)])


def _gpu(monkeypatch, gpu):
    """As ``GPUS`` names it: nothing, or fake_gpu with that planner; the batch sizes of the copy engine's calls."""
    return [] if gpu is None else fake_gpu(monkeypatch, gpu)[0]


def _requests(monkeypatch, backend) -> list[int]:
    """The keys of each acquire request the client sends from here on."""
    sent: list[int] = []
    real = backend.send_tagged

    def send(msg, **kw):
        if msg.get("op") == "acquire":
            sent.append(len(msg["keys"]))
        return real(msg, **kw)

    monkeypatch.setattr(backend, "send_tagged", send)
    return sent


@GPUS
def test_a_cold_read_of_placed_keys_goes_in_one_pass_with_one_request(kv, writer, monkeypatch, gpu):
    keys, src = _written(writer, "placed", 10)
    batches = _gpu(monkeypatch, gpu)
    took, sent = outcomes(monkeypatch, placed_reads), _requests(monkeypatch, kv._backend)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 10
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    assert took == [True] and sent == [10]
    if gpu is not None:  # every key copied once, early (the table's advice held), 2 runs first, then batches of 4
        # runs in the Python loop, or one of up to 8 (4x the cut) natively, its 6 after the 2 in a driver call
        assert batches == ([2, 6, 2] if gpu else [2, 4, 4])
        assert batches.bindings == (0 if gpu == "copies" else len(batches))
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 10  # now kept: no request at all
    assert took == [True] and sent == [10]  # (the kept pass came first: placed_reads not asked)
    kv.delete(keys)
    assert kv.stats()["leases"] == 0


def test_it_is_not_taken_with_a_timeout_or_where_the_table_misses_the_first_key(kv, writer, monkeypatch):
    keys, src = _written(writer, "not-placed", 4)
    took = outcomes(monkeypatch, placed_reads)
    assert kv.mget_h2d(keys, _poisoned(src), timeout=0.5) == [None] * 4  # a waiting call: stage by stage
    table = kv._backend.placements
    real = table.lookup
    monkeypatch.setattr(table, "lookup", lambda ks: [None if k == keys[0] else h for k, h in zip(ks, real(ks))])
    writer.delete(keys)
    assert writer.mset_d2h(keys, src) == [None] * 4  # cold again
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    assert took == [False, False]
    kv.delete(keys)


@GPUS
@pytest.mark.parametrize("bad_at, request_sent", [(1, False), (7, True)])
def test_a_bad_tensor_gives_back_every_lease_taken(kv, writer, worker, monkeypatch, bad_at, request_sent, gpu):
    keys, src = _written(writer, f"placed-bad-{bad_at}", 9)
    _gpu(monkeypatch, gpu)
    batches_of(monkeypatch, 2, 1000)  # the request goes after the second batch: with key 3
    took, sent = outcomes(monkeypatch, placed_reads), _requests(monkeypatch, kv._backend)
    dst = _poisoned(src)
    dst[bad_at] = [torch.zeros(40, 25).t()]
    with pytest.raises(ValueError, match=rf"tensor_lists\[{bad_at}\]\[0\]"):
        kv.mget_h2d(keys, dst)
    assert took == ["raised"] and sent == ([9] if request_sent else [])
    assert kv.mget_h2d(keys[:2], _poisoned(src[:2])) == [None, None]  # the client goes on
    kv.delete(keys)
    assert kv.stats()["leases"] == 0  # none of the failed call's leases left behind


def test_a_batch_the_driver_refuses_gives_back_every_lease_taken(kv, writer, monkeypatch):
    keys, src = _written(writer, "placed-refused", 9)
    batches_of(monkeypatch, 2, 1000)  # batches of 2 keys: the request goes with the second
    batches = _gpu(monkeypatch, "copies")
    alive, address = batch_call(batches, fail_at=5)  # the third batch is refused
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(device, "native_copies", lambda *args: (cuda, _Stream(), (address, 13000, 1)))
    took, sent = outcomes(monkeypatch, placed_reads), _requests(monkeypatch, kv._backend)
    dst = _poisoned(src)
    with pytest.raises(CopyEngineError, match="cuMemcpyBatchAsync failed"):
        kv.mget_h2d(keys, dst)
    assert took == ["raised"] and sent == [9] and batches == [2, 2]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src[:4], dst[:4]))  # the batches before it landed
    del alive
    _gpu(monkeypatch, "copies")
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 9  # the client goes on
    kv.delete(keys)
    assert kv.stats()["leases"] == 0  # none of the failed call's leases left behind


@pytest.mark.parametrize("bad_at", [0, 5])
def test_a_bad_key_raises_naming_it_before_any_request_or_copy(kv, writer, monkeypatch, bad_at):
    keys, src = _written(writer, f"placed-bad-key-{bad_at}", 9)
    took, sent = outcomes(monkeypatch, placed_reads), _requests(monkeypatch, kv._backend)
    dst = _poisoned(src)
    with pytest.raises(TypeError, match=rf"^keys\[{bad_at}\]: must be a str, got int"):
        kv.mget_h2d([*keys[:bad_at], 5, *keys[bad_at + 1 :]], dst)
    assert took == [] and sent == []
    assert all(torch.equal(t, torch.full_like(t, 0xAB)) for ts in dst for t in ts)  # nothing copied
    assert kv.stats()["leases"] == 0  # none taken, none left behind
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 9
    kv.delete(keys)


@GPUS
def test_missing_keys_and_size_mismatches_are_their_own_slots(kv, writer, monkeypatch, gpu):
    keys, src = _written(writer, "placed-mixed", 6)
    _gpu(monkeypatch, gpu)
    advice = kv._backend.placement_hints(keys)
    writer.delete([keys[2], keys[3]])  # gone after the advice was read
    src[3] = _lists(1, seed=7)[0]
    assert writer.mset_d2h([keys[3]], src[3:4]) == [None]  # and written again: its early copy read the old place
    monkeypatch.setattr(kv._backend, "placement_hints", lambda ks: advice)
    took = outcomes(monkeypatch, placed_reads)
    dst = _poisoned(src)
    dst[4] = [torch.zeros(999, dtype=torch.uint8)]  # 999 bytes for 1,000: no early copy, a ValueError
    res = kv.mget_h2d(keys, dst)
    assert took == [True]
    assert isinstance(res[2], KeyNotFound) and isinstance(res[4], ValueError) and "which holds 1000" in str(res[4])
    assert all(res[i] is None and torch.equal(src[i][0], dst[i][0]) for i in (0, 1, 3, 5))  # key 3 copied again
    assert torch.equal(dst[4][0], torch.zeros(999, dtype=torch.uint8))
    kv.delete(keys)
    assert kv.stats()["leases"] == 0


def test_reads_racing_rewrites_see_whole_versions_and_leave_no_lease(kv, worker, monkeypatch):
    """Two threads of one client read 6 keys over and over (kept, placed or staged, as the cache and the table
    stand each time) while another client deletes and rewrites them with a new version: every key of every read is
    one version whole (its lease pins its bytes across the copy), or missing."""
    import threading
    import time

    n, size = 6, 4096
    keys = [f"race/{i}" for i in range(n)]
    versions = [torch.full((size,), v, dtype=torch.uint8) for v in range(1, 9)]
    kv.delete(keys)
    assert kv.mset_d2h(keys, [[versions[0]]] * n) == [None] * n
    errors: list[BaseException] = []
    seen: set[int] = set()
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                dst = [[torch.zeros(size, dtype=torch.uint8)] for _ in keys]
                res = kv.mget_h2d(keys, dst)
                for r, (t,) in zip(res, dst):
                    if r is None:
                        first = int(t[0])
                        assert first in range(1, 9) and bool((t == first).all()), "a torn or foreign value"
                        seen.add(first)
                    else:
                        assert isinstance(r, KeyNotFound), r
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        with kvstrata.connect(worker.address) as writer:
            for v in versions[1:]:
                for _ in range(5):
                    writer.delete(keys)
                    assert writer.mset_d2h(keys, [[v]] * n) == [None] * n
                    time.sleep(0.005)  # reads of unchanged keys between rewrites: kept leases too
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    assert not errors, errors
    assert len(seen) > 1  # the readers saw the versions change
    kv.delete(keys)
    assert kv.stats()["leases"] == 0  # none of the reads' leases left behind (the cache's went with the keys)
