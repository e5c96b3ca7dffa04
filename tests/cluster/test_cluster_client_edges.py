"""ClusterClient edge cases, over workers listed in memory (inproc://, so fast): empty batches, a retry with no worker
left to stand in, async calls beyond the fan-out pool's size, calls after close(), bad arguments."""

from __future__ import annotations

import uuid

import pytest

import kvstrata


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
    a, b = workers.start(2, ttl=30)
    with kvstrata.connect(cluster=workers.url, replicas=2) as kv:
        assert kv.mset({"before": b"1"}) == [None]
        vanish(b)
        assert kv.mset({"k": b"v", "j": b"w"}) == [None, None]
        assert kv.nodes == [a.member.node_id]
        assert kv.mget(["k", "j", "before"]) == [b"v", b"w", b"1"]
