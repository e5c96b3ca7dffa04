"""A worker that stops on purpose hands its objects to the workers that own their keys without it
(kvstrata.server.drain): every key stays readable through any cluster client, a newer value already at the new owner
wins, time to live goes along, and a deadline, a worker out of reach or a key gone meanwhile are counted, never a hang
or a crash."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvstrata
from kv_helpers import wait_until
from kvstrata.cluster import owners
from kvstrata.errors import KeyNotFound
from kvstrata.server.drain import drain


def values(n: int, seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    sizes = [1, 100, 5000, 70_000, 300_000]  # (the largest go as attachments)
    return {f"key-{i}": rng.integers(0, 255, sizes[i % len(sizes)], dtype=np.uint8).tobytes() for i in range(n)}


def test_a_stopping_worker_hands_its_keys_to_their_new_owners(workers):
    started = workers.start(3, memory=64 << 20)
    data = values(200)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mset(data) == [None] * len(data)
        leaving = started[0]
        mine = [k for k in data if owners(k, kv.nodes, 1)[0] == leaving.member.node_id]
        assert mine
        leaving.stop(drain_s=30)
        assert leaving.drained["moved"] == len(mine) and leaving.drained["failed"] == leaving.drained["left"] == 0
        assert leaving.drained["bytes_moved"] == sum(len(data[k]) for k in mine)
        assert wait_until(lambda: len(kv.nodes) == 2, 10)
    workers.start(1, memory=64 << 20)  # (a second change: no read falls back to the list before the stop)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert wait_until(lambda: len(kv.nodes) == 3, 10)
        moved_again = [k for k in data if owners(k, kv.nodes, 1)[0] == workers.started[-1].member.node_id]
        workers.started[1].stop(drain_s=30)  # (and one more leaves, handing on its part)
        assert wait_until(lambda: len(kv.nodes) == 2, 10)
        got = kv.mget(list(data))
        missing = [k for k, v in zip(data, got) if isinstance(v, BaseException)]
        # keys the newcomer now owns were never handed to it (a join moves nothing): only those may miss
        assert set(missing) <= set(moved_again)
        assert all(v == data[k] for k, v in zip(data, got) if k not in missing)


def test_without_a_drain_the_stopped_workers_keys_are_gone(workers):
    started = workers.start(2, memory=32 << 20)
    data = values(60, seed=1)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.mset(data)
        gone = [k for k in data if owners(k, kv.nodes, 1)[0] == started[0].member.node_id]
        started[0].stop()  # (the default: cluster_drain 0)
        assert started[0].drained is None
        assert wait_until(lambda: len(kv.nodes) == 1, 10)
        got = kv.mget(gone)
        assert all(isinstance(v, KeyNotFound) for v in got)


def test_a_newer_value_at_the_new_owner_wins_and_ttl_goes_along(workers):
    started = workers.start(2, memory=32 << 20)
    by_node = workers.by_node()
    leaving, staying = started[0], started[1]
    with kvstrata.connect(cluster=workers.url) as kv:
        nodes = kv.nodes
        keys = [f"k{i}" for i in range(200) if owners(f"k{i}", nodes, 1)[0] == leaving.member.node_id]
        newer, timed, plain = keys[0], keys[1], keys[2]
        kv.set(newer, b"old")
        kv.set(timed, b"short-lived", ttl=1.5)
        kv.set(plain, b"plain")
        with kvstrata.connect(address=by_node[staying.member.node_id].address) as direct:
            direct.set(newer, b"new")  # (a client that saw the list without the leaving worker already)
        leaving.stop(drain_s=10)
        assert leaving.drained["present"] == 1 and leaving.drained["moved"] == 2
        assert wait_until(lambda: len(kv.nodes) == 1, 10)
        assert kv.get(newer) == b"new" and kv.get(plain) == b"plain" and kv.get(timed) == b"short-lived"
        assert wait_until(lambda: not kv.exists([timed])[0], 5)  # (its deadline came with it)
        assert kv.get(plain) == b"plain"


def test_a_drain_past_its_deadline_counts_what_is_left_and_stops(workers):
    started = workers.start(2, memory=32 << 20)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.mset(values(100, seed=2))
    t0 = time.monotonic()
    started[0].stop(drain_s=1e-9)
    assert time.monotonic() - t0 < 10
    report = started[0].drained
    assert report["moved"] == 0 and report["left"] > 0


def test_drain_counts_a_worker_out_of_reach_and_a_key_gone_meanwhile():
    listing = [("a", None), ("b", 3.0), ("gone", None), ("orphan", None)]

    def read(key: str) -> bytes:
        if key == "gone":
            raise KeyNotFound(key)
        return key.encode()

    owner = {"a": "n1", "b": "n1", "gone": "n1", "orphan": "n9"}
    t0 = time.monotonic()
    addresses = {"n1": "tcp://127.0.0.1:1"}
    report = drain(listing, read, lambda key: [owner[key]], addresses, deadline=time.monotonic() + 2, name="test")
    assert time.monotonic() - t0 < 5
    assert report.moved == 0 and report.failed == 4 and report.left == 0  # a, b, gone (not read: no n1) and orphan
    assert any("orphan" in e for e in report.errors) and any("n1" in e for e in report.errors)


@pytest.mark.parametrize("drain_s", [0.0, 5.0])
def test_stop_twice_is_harmless(workers, drain_s):
    (worker,) = workers.start(1)
    worker.stop(drain_s=drain_s)
    worker.stop(drain_s=drain_s)


def test_a_copy_the_leaving_worker_did_not_own_goes_to_the_keys_owner(workers):
    """A stray (written straight to a worker that does not own the key, or not dropped yet by a rebalance) is handed to
    the key's owner too, write-once: never 'no worker to take it'."""
    started = workers.start(3, memory=32 << 20, cluster_rebalance=False)
    leaving = started[0]
    nodes = sorted(w.member.node_id for w in started)
    stray = next(f"s{i}" for i in range(200) if owners(f"s{i}", nodes, 1)[0] != leaving.member.node_id)
    with kvstrata.connect(address=leaving.address) as direct:
        direct.set(stray, b"only here")
    leaving.stop(drain_s=10)
    assert leaving.drained["moved"] == 1 and leaving.drained["failed"] == 0
    with kvstrata.connect(cluster=workers.url) as kv:
        assert wait_until(lambda: len(kv.nodes) == 2, 10)
        assert kv.get(stray) == b"only here"
