"""mget_h2d in one pass where this client kept every lease (kvstrata.client.kept_reads): taken only then, exact,
per-key results, its batches, its leases back on every path; and the local-read cache's all-or-nothing lookup."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvstrata
from _stages import PLANNER_IDS, PLANNERS, _Stream, batch_call, fake_gpu, native_planner, outcomes
from kv_helpers import worker_fixtures
from kvstrata.client import batching, device, kept_reads
from kvstrata.ops import tensor_runs
from kvstrata.ops.copy_engine import CopyEngineError

MEMORY = 64 << 20


worker, kv = worker_fixtures("kept-worker", memory=MEMORY, segment=16 << 20, modes=("unix",))


# a key's bad tensor list, the error it raises and what the error says
BAD_TENSOR_LISTS = [
    ([torch.zeros(32, 32).t()], ValueError, "contiguous"),
    (["not a tensor"], TypeError, r"expected a torch.Tensor"),
    ("not a list", TypeError, "must be a list of tensors"),
]


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
    assert kv._backend._holders == holders  # no hold per key
    assert not kv._backend._pins and not kv._backend._parked  # every call's pin went back


def test_every_lease_is_taken_in_one_lookup_before_the_first_copy(kv, monkeypatch):
    keys, src = _written(kv, "one-lookup", 40)
    kv.mget_h2d(keys, _poisoned(src))
    backend = kv._backend
    sizes, real = [], backend.kept_leases
    monkeypatch.setattr(backend, "kept_leases", lambda ks: sizes.append(len(ks)) or real(ks))
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 40
    assert sizes == [40]
    assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))


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


@pytest.mark.parametrize("bad, exc, match", BAD_TENSOR_LISTS)
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
    assert not kv._backend._pins  # the call's pin went back too
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 6  # the client goes on


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ("", ValueError, "must not be empty"),
        (["a", "list"], TypeError, "must be a str"),
        (7, TypeError, "must be a str"),
    ],
)
def test_a_bad_key_raises_naming_it_before_anything_is_copied(kv, monkeypatch, bad, exc, match):
    keys, src = _written(kv, "bad-key", 20)
    kv.mget_h2d(keys, _poisoned(src))
    holders = dict(kv._backend._holders)
    took = outcomes(monkeypatch, kept_reads)
    for at in (0, 13):
        dst = _poisoned(src)
        with pytest.raises(exc, match=rf"^keys\[{at}\]: {match}"):
            kv.mget_h2d([*keys[:at], bad, *keys[at + 1 :]], dst)
        assert all(torch.equal(t, torch.full_like(t, 0xAB)) for ts in dst for t in ts)  # nothing copied
        assert kv._backend._holders == holders
        assert not kv._backend._pins  # a kept prefix's pin went back
    assert True not in took  # no path served either call: the keys were checked before any copy
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 20


def test_a_call_whose_every_key_is_kept_checks_no_key_before_its_copies(kv, monkeypatch):
    # The local-read cache keeps only keys that were checked: a call it serves whole needs no check of its keys,
    # and one it serves in part checks them all before its first copy (the test above).
    keys, src = _written(kv, "unchecked", 8)
    kv.mget_h2d(keys, _poisoned(src))
    checked = []
    real = kept_reads.P.check_keys
    monkeypatch.setattr(kept_reads.P, "check_keys", lambda ks, *a: checked.append(len(ks)) or real(ks, *a))
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 8
    assert checked == []
    assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))
    got = kv.mget_h2d([*keys, "unchecked/missing"], [*_poisoned(src), []])
    assert got[:8] == [None] * 8 and isinstance(got[8], kvstrata.KvstrataError)
    assert checked[0] == 9  # one key not kept: every key checked, before the first copy


def test_a_rewritten_key_ends_the_kept_pass_and_a_missing_first_key_skips_it(kv, worker, monkeypatch):
    keys, src = _written(kv, "changed", 5)
    kv.mget_h2d(keys, _poisoned(src))
    took = outcomes(monkeypatch, kept_reads)
    with kvstrata.connect(worker.address) as other:
        other.delete(keys[3])
        new = [torch.full((1024,), 7, dtype=torch.uint8)]
        assert other.mset_d2h([keys[3]], [new]) == [None]
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 5  # keys 0-2 kept, key 3 is not: 3-4 go cold
    assert torch.equal(torch.cat(dst[3]), new[0])  # the new value, not the kept one
    assert all(torch.equal(a, b) for i in (0, 1, 2, 4) for a, b in zip(src[i], dst[i]))
    kv.delete(keys[0])
    res = kv.mget_h2d(keys, _poisoned(src))
    assert took == [True, False] and isinstance(res[0], kvstrata.KeyNotFound)


def _kept_then_changed(kv, worker, prefix, n, *, rewrite=(), delete=()):
    """``n`` keys read once (leases kept), then some rewritten by another client and some deleted."""
    keys, src = _written(kv, prefix, n)
    kv.mget_h2d(keys, _poisoned(src))
    with kvstrata.connect(worker.address) as other:
        other.delete([keys[i] for i in (*rewrite, *delete)])
        for i in rewrite:
            src[i] = [torch.full((1000,), i, dtype=torch.uint8), torch.full((24,), 200 + i, dtype=torch.uint8)]
            assert other.mset_d2h([keys[i]], [src[i]]) == [None]
        assert other.exists(keys[:1]) == [True]  # its objects shown before the read
    return keys, src


@pytest.mark.parametrize("cold", ["placed", "staged"])
def test_keys_past_a_chunk_not_all_kept_go_the_cold_way_with_exact_per_key_results(kv, worker, monkeypatch, cold):
    # Key 9 rewritten ends the kept pass there; key 12 is gone.
    keys, src = _kept_then_changed(kv, worker, f"part-{cold}", 14, rewrite=(9,), delete=(12,))
    backend = kv._backend
    holders = dict(backend._holders)
    if cold == "staged":
        monkeypatch.setattr(backend, "placement_hints", lambda keys: None)  # no table: stages
    from kvstrata.client import placed_reads

    took, placed = outcomes(monkeypatch, kept_reads), outcomes(monkeypatch, placed_reads)
    dst = _poisoned(src)
    res = kv.mget_h2d(keys, dst)
    assert took == [True] and placed == [cold == "placed"]
    assert isinstance(res[12], kvstrata.KeyNotFound) and "part-" in str(res[12])
    assert [r is None for r in res] == [i != 12 for i in range(14)]
    assert all(torch.equal(a, b) for i in range(14) if i != 12 for a, b in zip(src[i], dst[i]))
    # every hold the call took went back: what the worker counts is what the local-read cache keeps
    assert all(backend._holders.get(k, 0) <= v for k, v in holders.items())
    assert kv.stats()["leases"] == len(backend._local._entries) == 13
    assert kv.mget_h2d([k for i, k in enumerate(keys) if i != 12], _poisoned(src[:12] + src[13:])) == [None] * 13
    assert took[-1] is True  # all kept again


def test_a_bad_tensor_past_the_kept_keys_names_its_index_and_every_lease_goes_back(kv, worker, monkeypatch):
    keys, src = _kept_then_changed(kv, worker, "part-bad", 10, rewrite=(5,))
    backend = kv._backend
    holders = dict(backend._holders)
    leases = kv.stats()["leases"]
    dst = _poisoned(src)
    dst[7] = [torch.zeros(32, 32).t()]
    took = outcomes(monkeypatch, kept_reads)
    with pytest.raises(ValueError, match=r"^tensor_lists\[7\]\[0\]: tensor must be contiguous"):
        kv.mget_h2d(keys, dst)  # keys 0-4 kept; key 5 rewritten: 5-9 go cold
    assert took == [True]
    assert backend._holders == {k: v for k, v in holders.items() if k in backend._holders}
    assert kv.stats()["leases"] <= leases  # nothing held past the call (key 5's stale lease may be gone too)
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 10  # the client goes on


def test_the_cold_rest_of_a_kept_call_waits_for_a_missing_key_within_its_timeout(kv, worker):
    keys, src = _kept_then_changed(kv, worker, "part-wait", 6, delete=(4,))
    later = [torch.full((1000,), 9, dtype=torch.uint8), torch.full((24,), 8, dtype=torch.uint8)]

    def write_later():
        time.sleep(0.2)
        with kvstrata.connect(worker.address) as other:
            assert other.mset_d2h([keys[4]], [later]) == [None]

    writer = threading.Thread(target=write_later)
    writer.start()
    dst = _poisoned(src)
    try:
        assert kv.mget_h2d(keys, dst, timeout=10) == [None] * 6
    finally:
        writer.join()
    assert all(torch.equal(a, b) for a, b in zip(later, dst[4]))
    assert all(torch.equal(a, b) for i in (0, 1, 2, 3, 5) for a, b in zip(src[i], dst[i]))


def test_async_mget_h2d_of_a_partly_kept_call(kv, worker, monkeypatch):
    keys, src = _kept_then_changed(kv, worker, "part-async", 8, rewrite=(3,), delete=(6,))
    took = outcomes(monkeypatch, kept_reads)
    dst = _poisoned(src)
    res = kv.async_mget_h2d(keys, dst).result(timeout=30)
    assert took == [True]
    assert [r is None for r in res] == [i != 6 for i in range(8)] and isinstance(res[6], kvstrata.KeyNotFound)
    assert all(torch.equal(a, b) for i in range(8) if i != 6 for a, b in zip(src[i], dst[i]))


def test_both_waits_for_each_part(monkeypatch):
    done = []

    class Ev:
        def __init__(self, name, ready=True):
            self.name, self.ready = name, ready

        def synchronize(self):
            done.append(self.name)

        def query(self):
            return self.ready

    a, b = Ev("a"), Ev("b", ready=False)
    assert device.both(None, None) is None and device.both(a, None) is a and device.both(None, b) is b
    pair = device.both(a, b)
    assert pair.query() is False
    pair.synchronize()
    assert done == ["a", "b"]


def test_entries_prefix_stops_at_the_first_key_not_current_and_leaves_a_stale_entry_for_the_slow_path(kv, worker):
    keys, src = _written(kv, "prefix", 4)
    kv.mget_h2d(keys, _poisoned(src))
    local = kv._backend._local
    got = local.entries_prefix(keys)
    assert [e[1].size for e in got] == [1024] * 4
    assert len(local.entries_prefix([*keys[:2], "never-read", *keys[2:]])) == 2
    assert local.entries_prefix(["never-read", *keys]) == []
    with kvstrata.connect(worker.address) as other:
        other.delete(keys[2])
    assert len(local.entries_prefix(keys)) == 2
    assert keys[2] in local._entries  # still there: dropped (its lease given back) by the staged path's lookup
    assert local.entries(keys)[2] is None and keys[2] not in local._entries


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_locations_prefix_natively_or_not_stops_where_entries_prefix_does(kv, worker, monkeypatch, native):
    from kvstrata.client import local_reads

    assert tensor_runs.native(wait=True) is not None
    monkeypatch.setattr(local_reads, "NATIVE_PREFIX", native)
    keys, src = _written(kv, "locs", 5)
    kv.mget_h2d(keys, _poisoned(src))
    local = kv._backend._local
    hits = local.hits
    assert local.locations_prefix(keys) == [e[1] for e in local.entries_prefix(keys)]
    assert local.hits == hits + 10 and local._touch_later[-1] == keys
    assert local.locations_prefix([*keys[:2], "never-read", *keys[2:]]) == [local._entries[k][1] for k in keys[:2]]
    assert local.locations_prefix(["never-read", *keys]) == []
    assert local.locations_prefix([*keys[:3], 7, keys[3]]) == [local._entries[k][1] for k in keys[:3]]  # not a str
    with kvstrata.connect(worker.address) as other:
        other.delete(keys[3])
    gen = local.generation()
    assert [loc.size for loc in local.locations_prefix(keys)] == [1024] * 3
    assert all(local._entries[k][4] == gen for k in keys[:3])  # found current since the delete
    assert keys[3] in local._entries  # the stale one left for the slow path's lookup to drop


def test_the_embedded_client_never_keeps_leases(tmp_path):
    with kvstrata.connect(embedded=True, memory_bytes=16 << 20) as kv:
        keys, src = _written(kv, "embedded", 3)
        assert kv._backend.kept_leases(keys) is None
        dst = _poisoned(src)
        assert kv.mget_h2d(keys, dst) == [None] * 3
        assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))


@pytest.mark.parametrize("native", PLANNERS, ids=PLANNER_IDS)
@pytest.mark.parametrize(
    "n, sizes, run_bytes, expected, expected_native",
    [
        # keys of RUN_BYTES: 3 keys (the first batch, in one driver call), 6, 12, then 16s, and what is left
        (40, (4096,), 4096, [3, 6, 12, 16, 3], [3, 6, 12, 16, 3]),
        # small keys: runs as many as the cut, 16 at most; natively planned a batch holds 4x as many (12, 24, 48, up
        # to 64), the first 3 in a driver call of their own
        (40, (4096,), 1 << 20, [3, 6, 12, 16, 3], [3, 9, 24, 4]),
        # five tensors a key: key 0's 5 runs, 3 of them first, then 2 keys, 3, the rest; natively keys 0-2 (15 runs)
        # then keys 3-7 (25 runs, past 24) in one call
        (8, (512,) * 5, 1 << 20, [3, 2, 10, 15, 10], [3, 12, 25]),
    ],
)
def test_device_copies_start_after_three_runs_then_go_in_batches_twice_as_large(
    kv, monkeypatch, n, sizes, run_bytes, expected, expected_native, native
):
    monkeypatch.setattr(batching, "RUN_BYTES", run_bytes)
    keys, src = _written(kv, f"batches/{len(sizes)}", n, sizes=sizes)
    kv.mget_h2d(keys, _poisoned(src))
    batches, registered, passes = fake_gpu(monkeypatch, native)
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * n
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    assert kept_reads.FIRST_RUNS == 3
    assert batches == (expected_native if native else expected)
    assert registered  # every segment the copies read was offered to CUDA before them
    assert batches.bindings == (0 if native == "copies" else len(batches))  # a native pass queued its own copies
    if native:  # one pass a batch, each ending where the batch is full (the segment's address looked up once)
        assert [why for _, why in passes if why != tensor_runs.NO_BASE] == [tensor_runs.CUT] * (len(passes) - 2) + [
            tensor_runs.DONE
        ]


@pytest.mark.parametrize("native", PLANNERS, ids=PLANNER_IDS)
def test_under_a_gpu_a_mismatch_a_repeated_key_and_empty_tensors_take_either_pass(kv, monkeypatch, native):
    keys, src = _written(kv, "fake-gpu", 6, sizes=(64, 0, 16))
    kv.mget_h2d(keys, _poisoned(src))
    _, _, passes = fake_gpu(monkeypatch, native)
    wanted = [src[1], src[1], src[0], src[3], src[4], src[5]]
    dst = _poisoned(wanted)
    dst[3] = [torch.zeros(81, dtype=torch.uint8)]  # 81 bytes for an object of 64 + 0 + 16
    res = kv.mget_h2d([keys[1], keys[1], keys[0], keys[3], keys[4], keys[5]], dst)
    assert isinstance(res[3], ValueError) and "81 bytes for 'fake-gpu/3', which holds 80" in str(res[3])
    assert [r is None for r in res] == [True, True, True, False, True, True]
    assert torch.equal(dst[3][0], torch.zeros(81, dtype=torch.uint8))  # nothing copied into it
    assert all(torch.equal(a, b) for i in (0, 1, 2, 4, 5) for a, b in zip(wanted[i], dst[i]))
    assert bool(passes) == bool(native)


@pytest.mark.parametrize("native", PLANNERS, ids=PLANNER_IDS)
@pytest.mark.parametrize("bad, exc, match", BAD_TENSOR_LISTS)
def test_under_a_gpu_a_bad_tensor_raises_after_the_keys_before_it_landed(kv, monkeypatch, bad, exc, match, native):
    keys, src = _written(kv, "fake-gpu-bad", 12, sizes=(1000,))
    kv.mget_h2d(keys, _poisoned(src))
    holders = dict(kv._backend._holders)
    _, _, passes = fake_gpu(monkeypatch, native)
    monkeypatch.setattr(batching, "RUN_BYTES", 1000)  # batches of 3 keys, then 6, 12
    dst = _poisoned(src)
    dst[10] = bad
    with pytest.raises(exc, match=r"^tensor_lists\[10\]") as raised:
        kv.mget_h2d(keys, dst)
    assert raised.match(match)
    assert all(torch.equal(a, b) for i in range(9) for a, b in zip(src[i], dst[i]))  # batches of 3 and 6 landed
    assert kv._backend._holders == holders and not kv._backend._pins
    if native:
        assert passes[-1] == (9, tensor_runs.PYTHON_PATH)  # the last pass left key 10 to the Python loop
    assert kv.mget_h2d(keys, _poisoned(src)) == [None] * 12  # the client goes on


def test_under_a_gpu_a_batch_the_driver_refuses_raises_after_the_batches_before_it_landed(kv, monkeypatch):
    keys, src = _written(kv, "fake-gpu-refused", 12, sizes=(1000,))
    kv.mget_h2d(keys, _poisoned(src))
    holders = dict(kv._backend._holders)
    batches, _, passes = fake_gpu(monkeypatch, "copies")
    monkeypatch.setattr(batching, "RUN_BYTES", 1000)  # batches of 3 keys, then 6, then the rest
    alive, address = batch_call(batches, fail_at=9)  # the third batch's call is refused
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(device, "native_copies", lambda *args: (cuda, _Stream(), (address, 13000, 1)))
    dst = _poisoned(src)
    with pytest.raises(CopyEngineError, match=r"cuMemcpyBatchAsync failed: .*\(1\)") as raised:
        kv.mget_h2d(keys, dst)
    assert raised.value.queued == 0 and batches == [3, 6]  # none of the refused call's runs went
    assert all(torch.equal(a, b) for i in range(9) for a, b in zip(src[i], dst[i]))  # the batches before it landed
    assert kv._backend._holders == holders and not kv._backend._pins  # every lease went back
    assert [why for _, why in passes if why != tensor_runs.NO_BASE] == [
        tensor_runs.CUT,
        tensor_runs.CUT,
        tensor_runs.DONE,
    ]
    del alive
    fake_gpu(monkeypatch, "copies")
    dst = _poisoned(src)
    assert kv.mget_h2d(keys, dst) == [None] * 12  # the client goes on
    assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))


def test_a_lease_dropped_from_the_cache_mid_call_stays_held_until_the_call_ends(kv, worker, monkeypatch):
    # Another thread of this client may find an entry stale (its key rewritten) and drop it while a one-pass read
    # copies from its lease: the read's pin keeps the lease, so the old bytes stay put until the copy is done.
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
            backend.release([])  # what is due would go now: the read's pin parks it
            assert backend._parked
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
    assert kv.stats()["leases"] == leases_before - 1  # the call's pin went with it: the stale lease is released
    assert not backend._pins and not backend._parked
    kv.delete(keys)


def test_a_lease_let_go_of_under_a_pin_goes_back_once_the_pins_taken_before_it_are_given_back(kv, worker):
    # Pins that keep overlapping (async reads back to back) must not hold a parked lease for ever: it waits for the
    # pins already held when it was parked, not for later ones.
    keys, src = _written(kv, "epochs", 4, sizes=(4096,))
    kv.mget_h2d(keys, _poisoned(src))
    backend = kv._backend
    leases = kv.stats()["leases"]
    first, _ = backend.kept_leases(keys)

    def rewrite(i):
        with kvstrata.connect(worker.address) as other:
            other.delete([keys[i]])
            assert other.mset_d2h([keys[i]], [[torch.zeros(4096, dtype=torch.uint8)]]) == [None]
        assert backend._local.entries([keys[i]]) == [None]  # found stale: its lease due back

    rewrite(0)
    assert kv.exists(keys[1:2]) == [True]  # a request: it would carry the lease, which the first pin parks
    second, _ = backend.kept_leases(keys[1:])  # a read that began after the lease was parked
    rewrite(1)
    backend.release([])  # parked behind both pins
    assert kv.stats()["leases"] == leases
    backend.release(first)  # the first lease was parked under the first pin alone: it goes
    assert kv.stats()["leases"] == leases - 1
    assert kv.exists(keys[2:3]) == [True]  # nothing else goes while the second pin is held
    assert kv.stats()["leases"] == leases - 1
    backend.release(second)
    assert kv.stats()["leases"] == leases - 2
    assert not backend._pins and not backend._parked


@pytest.mark.gpu
@pytest.mark.parametrize("planner", ["lists", "copies"])
def test_a_kept_read_on_the_gpu_is_planned_natively_and_a_cpu_key_hands_over_to_the_python_loop(
    kv, monkeypatch, planner
):
    n = 40
    keys = [f"gpu-native/{i}" for i in range(n)]
    kv.delete(keys)
    g = torch.Generator(device="cuda").manual_seed(3)
    src = [[torch.randn(size, device="cuda", generator=g) for size in (4096, 100)] for _ in range(n)]
    assert kv.mset_d2h(keys, src) == [None] * n
    kv.mget_h2d(keys, [[torch.empty_like(t) for t in ts] for ts in src])
    passes = native_planner(monkeypatch, planner)
    monkeypatch.setattr(batching, "NATIVE_CUDA", True)
    dst = [[torch.full_like(t, -1.0) for t in ts] for ts in src]
    got = []
    thread = threading.Thread(target=lambda: got.append(kv.mget_h2d(keys, dst)))  # a thread new to CUDA
    thread.start()
    thread.join()
    assert got == [[None] * n]
    assert all(torch.equal(a, b) for x, y in zip(src, dst) for a, b in zip(x, y))
    assert passes and passes[-1][1] == tensor_runs.DONE
    passes.clear()
    dst = [[torch.full_like(t, -1.0) for t in ts] for ts in src]
    dst[17] = [torch.full((4096,), -1.0), torch.full((100,), -1.0)]  # CPU tensors: the Python loop copies them
    assert kv.mget_h2d(keys, dst) == [None] * n
    assert all(torch.equal(a.cpu(), b.cpu()) for x, y in zip(src, dst) for a, b in zip(x, y))
    assert passes[-1][1] == tensor_runs.PYTHON_PATH and passes[-1][0] <= 17  # the last pass stopped at key 17


@pytest.mark.gpu
def test_a_kept_read_on_the_gpu_whose_tensors_are_on_another_device_than_the_current_one_still_lands(kv):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    keys = [f"gpu-other/{i}" for i in range(8)]
    src = [[torch.randn(1000, device="cuda:1")] for _ in keys]
    assert kv.mset_d2h(keys, src) == [None] * 8
    kv.mget_h2d(keys, [[torch.empty_like(t) for t in ts] for ts in src])
    dst = [[torch.full_like(t, -1.0) for t in ts] for ts in src]
    with torch.cuda.device(0):  # the copies are the driver's in device 1's context: the native pass leaves them
        assert kv.mget_h2d(keys, dst) == [None] * 8
    assert all(torch.equal(a[0], b[0]) for a, b in zip(src, dst))
    kv.delete(keys)
