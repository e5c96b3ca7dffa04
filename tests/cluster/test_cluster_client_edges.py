"""ClusterClient edge cases, over workers listed in memory (inproc://, so fast): empty batches, a retry with no worker
left to stand in, async calls beyond the fan-out pool's size, calls after close(), bad arguments."""

from __future__ import annotations

import concurrent.futures
import threading
import uuid

import pytest
import torch

import kvstrata
from kvstrata.client.cluster import ClusterClient
from kvstrata.errors import ClosedError, InvalidType, InvalidValue


@pytest.fixture
def cluster_url() -> str:
    """(This module's workers fixture: an in-process member list only.)"""
    return f"inproc://edges-{uuid.uuid4().hex[:12]}"


def vanish(worker) -> None:
    """Stop ``worker`` without taking it off the list (as a crash leaves it until its lease runs out)."""
    worker.membership = None
    worker.stop()


def test_empty_batches_are_empty(workers):
    workers.start(2)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mset({}) == []
        assert kv.mset_d2h([], []) == []
        assert kv.mget_h2d([], []) == []


def test_a_replica_with_no_worker_left_to_stand_in(workers):
    """replicas=2 over two workers, one gone: the live one takes each key (no crash on the empty retry)."""
    a, b = workers.start(2, ttl=30, cluster_replicas=2)
    with kvstrata.connect(cluster=workers.url, replicas=2) as kv:
        assert kv.mset({"before": b"1"}) == [None]
        vanish(b)
        assert kv.mset({"k": b"v", "j": b"w"}) == [None, None]
        assert kv.nodes == [a.member.node_id]
        assert kv.mget(["k", "j", "before"]) == [b"v", b"w", b"1"]


def test_many_async_device_calls_at_once_do_not_starve_the_fan_out(workers):
    """More async calls than pool threads, each spanning both workers: each one's per-worker calls still run (on one
    pool, the async calls held every thread and waited forever for the per-worker calls queued behind them)."""
    workers.start(2)
    gate = threading.Event()

    class GatedKeys(list):  # (every async call is queued before the first one starts)
        def __iter__(self):
            gate.wait(10)
            return super().__iter__()

    with kvstrata.connect(cluster=workers.url) as kv:
        futures = [
            kv.async_mset_d2h(
                GatedKeys(f"a{i}/{j}" for j in range(8)), [[torch.full((4,), float(j))] for j in range(8)]
            )
            for i in range(80)
        ]
        gate.set()
        done, pending = concurrent.futures.wait(futures, timeout=8)
        if pending:  # (the deadlock: cancel what is queued, so that the calls holding the threads end, and close too)
            for pool in (kv._pool, getattr(kv, "_async_pool", None)):
                if pool is not None:
                    pool.shutdown(wait=False, cancel_futures=True)
        assert not pending, f"{len(pending)} of 80 async calls never finished"
        assert all(f.result() == [None] * 8 for f in done)
        dst = [[torch.empty(4)] for _ in range(8)]
        assert kv.async_mget_h2d([f"a79/{j}" for j in range(8)], dst).result(timeout=8) == [None] * 8
        assert dst[5][0].tolist() == [5.0] * 4


def test_calls_after_close_raise_closed_and_start_no_threads(workers):
    workers.start(2)
    kv = kvstrata.connect(cluster=workers.url)
    keys = [f"k{i}" for i in range(16)]  # (on both workers)
    assert kv.mset(dict.fromkeys(keys, b"v")) == [None] * 16
    kv.close()
    calls = {
        "mset": lambda: kv.mset(dict.fromkeys(keys, b"v")),
        "mget": lambda: kv.mget(keys),
        "exists": lambda: kv.exists(keys),  # (was [False] * 16: "no key is there")
        "size": lambda: kv.size(keys),  # (was [None] * 16)
        "delete": lambda: kv.delete(keys),
        "expire": lambda: kv.expire(keys, 5),
        "stats": kv.stats,
        "async_mset_d2h": lambda: kv.async_mset_d2h(["d"], [[torch.ones(2)]]),
        "async_mget_h2d": lambda: kv.async_mget_h2d(["d"], [[torch.ones(2)]]),
    }
    for name, call in calls.items():
        with pytest.raises(ClosedError):
            call()
            pytest.fail(f"{name} after close() did not raise ClosedError")
    assert kv._pool is None and getattr(kv, "_async_pool", None) is None
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvstrata-cluster")]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"timeout": "3"}, InvalidType, "timeout"),
        ({"timeout": 0}, InvalidValue, "timeout"),
        ({"timeout": float("nan")}, InvalidValue, "timeout"),
        ({"ttl": None}, InvalidType, "ttl"),
        ({"ttl": -1}, InvalidValue, "ttl"),
        ({"ttl": float("inf")}, InvalidValue, "ttl"),
        ({"ttl": True}, InvalidType, "ttl"),
    ],
)
def test_bad_timeouts_and_ttls_are_named(cluster_url, kwargs, error, match):
    with pytest.raises(error, match=match):
        ClusterClient(cluster_url, **kwargs)


def test_a_bad_wait_is_refused_even_when_every_key_is_there(workers):
    workers.start(2)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.set("k", b"v")
        for bad, error in (("1", InvalidType), (-1, InvalidValue)):
            with pytest.raises(error, match="timeout"):
                kv.mget(["k"], timeout=bad)
            with pytest.raises(error, match="timeout"):
                kv.mget_h2d(["k"], [[torch.empty(1, dtype=torch.uint8)]], timeout=bad)
        assert kv.get("k", timeout=None) == b"v"
