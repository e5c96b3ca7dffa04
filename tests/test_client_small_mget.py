"""A mget of fewer keys than MGET_SHARED_MIN_KEYS: keys read once go the copying way (one round trip); keys read
again go the leasing way, whose kept leases then answer later reads from shared memory with no round trip."""

from __future__ import annotations

from kv_helpers import worker_fixtures
from kvstrata.client import remote

worker, kv = worker_fixtures("small-mget-worker", memory=32 << 20, segment=8 << 20, modes=("unix",))


def requests(worker) -> int:
    return worker.stats()["requests"]


def test_keys_read_again_are_answered_from_shared_memory(worker, kv):
    keys = [f"small/{i}" for i in range(5)]
    values = {k: bytes([i]) * 4096 for i, k in enumerate(keys)}
    assert kv.mset(values) == [None] * 5
    assert len(keys) < remote.MGET_SHARED_MIN_KEYS
    before = requests(worker)
    assert kv.mget(keys) == list(values.values())  # first read: copied by the worker
    assert kv.mget(keys) == list(values.values())  # read again: leased (and the leases kept)
    after_two = requests(worker)
    assert after_two - before == 2
    for _ in range(5):
        assert kv.mget(keys) == list(values.values())
    assert requests(worker) == after_two  # answered here, no request
    kv.set(keys[2], b"changed")  # a change is seen at once (the worker bumps the key's generation)
    assert kv.mget(keys)[2] == b"changed"


def test_keys_read_once_each_go_the_copying_way(worker, kv, monkeypatch):
    leased = []
    real = kv._b().acquire
    monkeypatch.setattr(kv._b(), "acquire", lambda *a, **k: leased.append(a) or real(*a, **k))
    for r in range(20):
        keys = [f"once/{r}/{i}" for i in range(4)]
        kv.mset({k: b"v" * 100 for k in keys})
        assert kv.mget(keys) == [b"v" * 100] * 4
    assert leased == []
    monkeypatch.setattr(remote, "SMALL_READS_REMEMBERED", 8)
    for r in range(5):  # (the memory of keys read is bounded)
        kv.mget([f"flood/{r}/{i}" for i in range(4)])
    assert len(kv._b()._small_reads) <= 8
