"""On each change of the member list, each worker hands its objects to their keys' new owners and drops the copies it
no longer owns (kvstrata.server.rebalance): keys stay readable across any number of joins, a worker that comes back
empty gets its keys back, ``replicas=2`` keeps two copies through a death, a newer value at the new owner wins, a write
that came after the first look is sent again and never dropped, and bad settings are named."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvstrata
from kv_helpers import wait_until
from kvstrata.cluster import owners
from kvstrata.cluster.membership import open_membership
from kvstrata.cluster.placement import Placement
from kvstrata.errors import InvalidValue
from kvstrata.server import WorkerConfig
from kvstrata.server.rebalance import Move, plan_moves, rebalance
from kvstrata.store import ObjectStore, StoreConfig


def values(n: int, seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 100, 5000, 70_000]  # (the largest go as attachments)
    return {f"key-{i}": rng.integers(0, 255, sizes[i % len(sizes)], dtype=np.uint8).tobytes() for i in range(n)}


# the plan (no workers) ----------------------------------------------------------------------------------------------
def _listing(keys):
    return [(k, None, i + 1) for i, k in enumerate(keys)]


def test_a_join_moves_the_keys_the_newcomer_now_owns_and_drops_them_here():
    keys = [f"k{i}" for i in range(400)]
    before, after = Placement(["a", "b"]), Placement(["a", "b", "c"])
    mine = [k for k in keys if before.owners(k)[0] == "a"]
    moves = plan_moves(_listing(mine), "a", before, after, 1)
    taken = [k for k in mine if after.owners(k)[0] == "c"]
    assert taken and [m.key for m in moves] == taken
    assert all(m.targets == ("c",) and m.drop for m in moves)


def test_with_two_replicas_only_the_first_old_owner_that_stays_sends_and_a_loser_sends_and_drops():
    keys = [f"k{i}" for i in range(600)]
    before, after = Placement(["a", "b", "c"]), Placement(["a", "b", "c", "d"])
    for me in "abc":
        held = [k for k in keys if me in before.owners(k, 2)]
        moves = {m.key: m for m in plan_moves(_listing(held), me, before, after, 2)}
        for key in held:
            was, now = before.owners(key, 2), after.owners(key, 2)
            gained = tuple(n for n in now if n not in was)
            if me not in now:  # (pushed out by d: sends it, then drops its copy)
                assert moves[key] == Move(key, None, moves[key].version, gained, drop=True)
            elif gained and was[0] == me:  # (every old owner stays after a join: the first of them sends)
                assert moves[key].targets == gained and not moves[key].drop
            else:
                assert key not in moves


def test_a_death_with_two_replicas_restores_the_second_copy_and_a_rejoin_gets_its_keys_back():
    keys = [f"k{i}" for i in range(300)]
    before, after = Placement(["a", "b", "c"]), Placement(["a", "b"])
    held = [k for k in keys if "a" in before.owners(k, 2)]
    moves = {m.key: m for m in plan_moves(_listing(held), "a", before, after, 2)}
    for key in held:
        if "c" in before.owners(key, 2):
            assert moves[key].targets == ("b",) and not moves[key].drop
        else:
            assert key not in moves
    # c back under its node id, empty: a (the first old owner that stays) sends it its keys again
    same = Placement(["a", "b", "c"])
    moves = {m.key: m for m in plan_moves(_listing(held), "a", same, same, 2, frozenset({"c"}))}
    for key in held:
        owners_now = same.owners(key, 2)
        if "c" in owners_now:
            assert moves[key].targets == ("c",) and not moves[key].drop
        else:
            assert key not in moves


def test_a_stray_goes_to_its_owners_and_is_dropped_unless_this_worker_owns_it_now():
    before, after = Placement(["a", "b"]), Placement(["a", "b", "c"])
    keys = [f"k{i}" for i in range(300)]
    strays = [k for k in keys if before.owners(k)[0] == "b"]
    moves = {m.key: m for m in plan_moves(_listing(strays), "a", before, after, 1)}
    for key in strays:
        owner = after.owners(key)[0]
        if owner == "a":
            assert key not in moves
        else:
            assert moves[key].targets == (owner,) and moves[key].drop


# a rebalance run against real workers -------------------------------------------------------------------------------
def test_a_newer_value_at_the_new_owner_wins_and_a_write_after_the_first_look_is_sent_again_not_dropped(workers):
    (target,) = workers.start(1, memory=32 << 20, cluster_rebalance=False)
    node = target.member.node_id
    before, after = Placement(["me"]), Placement(["me", node])
    keys = [f"k{i}" for i in range(200) if after.owners(f"k{i}")[0] == node][:3]
    newer, rewritten, plain = keys
    with ObjectStore(StoreConfig(memory_bytes=16 << 20)) as store:
        for key in keys:
            store.put(key, b"here:" + key.encode())
        with kvstrata.connect(address=target.address) as direct:
            direct.set(newer, b"newer at the new owner")
        looks = []

        def listing():
            looks.append(time.monotonic())
            if len(looks) == 2:  # (a client that had not seen the change wrote here during the grace)
                store.put(rewritten, b"written during the grace")
            return store.listing()

        report = rebalance(
            listing,
            lambda k: store.get_bytes(k, timeout=0),
            lambda ks, vs: store.delete(ks, versions=vs),
            "me",
            before,
            after,
            {node: target.member.address},
            grace=0.2,
        )
        assert report.present == 1 and report.moved == 3 and report.failed == 0  # plain, rewritten twice
        assert report.dropped == 3
        assert store.exists(keys) == [False, False, False]
        with kvstrata.connect(address=target.address) as direct:
            assert direct.get(newer) == b"newer at the new owner"
            assert direct.get(rewritten) == b"written during the grace"
            assert direct.get(plain) == b"here:" + plain.encode()


def test_a_copy_written_again_after_it_was_sent_is_not_dropped(workers):
    (target,) = workers.start(1, memory=32 << 20, cluster_rebalance=False)
    node = target.member.node_id
    before, after = Placement(["me"]), Placement(["me", node])
    key = next(f"k{i}" for i in range(200) if after.owners(f"k{i}")[0] == node)
    with ObjectStore(StoreConfig(memory_bytes=16 << 20)) as store:
        store.put(key, b"one")

        def drop(keys, versions):
            store.put(key, b"two")  # (written between the second look and the drop)
            return store.delete(keys, versions=versions)

        report = rebalance(
            store.listing, lambda k: store.get_bytes(k, timeout=0), drop, "me", before, after,
            {node: target.member.address}, grace=0.05,
        )  # fmt: skip
        assert report.moved == 1 and report.dropped == 0
        assert store.get_bytes(key) == b"two"


def test_a_rebalance_cancelled_drops_nothing_and_a_target_out_of_reach_is_counted(workers):
    before, after = Placement(["me"]), Placement(["me", "gone"])
    keys = [f"k{i}" for i in range(100) if after.owners(f"k{i}")[0] == "gone"]
    with ObjectStore(StoreConfig(memory_bytes=16 << 20)) as store:
        for key in keys:
            store.put(key, b"v")
        t0 = time.monotonic()
        report = rebalance(
            store.listing, lambda k: store.get_bytes(k, timeout=0), lambda ks, vs: store.delete(ks, versions=vs),
            "me", before, after, {"gone": "tcp://127.0.0.1:1"}, grace=0.05,
        )  # fmt: skip
        assert time.monotonic() - t0 < 10
        assert report.failed == len(keys) and report.dropped == 0 and report.errors
        cancel = threading.Event()
        cancel.set()
        report = rebalance(
            store.listing, lambda k: store.get_bytes(k, timeout=0), lambda ks, vs: store.delete(ks, versions=vs),
            "me", before, after, {"gone": "tcp://127.0.0.1:1"}, cancelled=cancel,
        )  # fmt: skip
        assert report.left == len(keys) and report.dropped == 0
        assert all(store.exists(keys))


def test_a_hand_off_to_a_worker_gone_stops_trying_to_connect_once_called_off():
    # (it tried for up to 5 s before: a rebalance to a worker that died was held that long after a newer list came)
    from kvstrata.server.handoff import HandoffReport, hand_off

    report, t0 = HandoffReport(), time.monotonic()
    plan = {"gone": [(f"k{i}", None, "memory") for i in range(10)]}
    hand_off(
        plan, lambda k: b"v", {"gone": "tcp://127.0.0.1:1"}, deadline=t0 + 30, name="t", report=report,
        cancelled=lambda: time.monotonic() - t0 > 0.3,
    )  # fmt: skip
    assert time.monotonic() - t0 < 2.0
    assert report.left == 10 and report.failed == 0 and not report.errors


def test_a_version_guarded_delete_spares_a_key_written_since_and_checks_its_arguments():
    with ObjectStore(StoreConfig(memory_bytes=8 << 20)) as store:
        store.put("a", b"1")
        store.put("b", b"1")
        versions = {k: v for k, _, v, _ in store.listing()}
        store.put("b", b"2")
        assert store.delete(["a", "b", "c"], versions=[versions["a"], versions["b"], 7]) == [True, False, False]
        assert store.get_bytes("b") == b"2"
        with pytest.raises(InvalidValue, match="one per key"):
            store.delete(["b"], versions=[1, 2])


# workers rebalancing on their own -----------------------------------------------------------------------------------
def test_joins_move_keys_to_their_new_owners_and_every_key_stays_readable(workers):
    workers.start(2, memory=64 << 20)
    data = values(300)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mset(data) == [None] * len(data)
    for n in (3, 4):  # (two joins: a client's fallback to the list before the last change covers only one)
        workers.start(1, memory=64 << 20)
        workers.settle(n)
    nodes = sorted(workers.by_node())
    where = workers.holders(list(data))
    assert all(where[k] == {owners(k, nodes, 1)[0]} for k in data)  # at its owner, nowhere else
    newcomers = {w.member.node_id for w in workers.started[2:]}
    assert any(where[k] & newcomers for k in data)
    with kvstrata.connect(cluster=workers.url) as kv:  # (a new client: no list from before the changes)
        assert kv.mget(list(data)) == list(data.values())
    stats = workers.started[0].stats()["cluster"]
    assert stats["rebalance"]["runs"] >= 1 and stats["rebalance"]["last"]["failed"] == 0
    # the large values went straight out of the stores, under leases: all given back
    assert all(w.store.stats()["leases"] == 0 for w in workers.by_node().values())


def test_with_two_replicas_a_death_leaves_two_copies_and_a_second_death_loses_nothing(workers):
    workers.start(3, memory=64 << 20, cluster_replicas=2)
    data = values(200, seed=1)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.replicas == 2  # (the workers' setting)
        assert kv.mset(data) == [None] * len(data)
    assert all(len(h) == 2 for h in workers.holders(list(data)).values())
    _die(workers, workers.started[0])
    workers.settle(2)
    assert all(len(h) == 2 for h in workers.holders(list(data)).values())
    workers.start(1, memory=64 << 20, cluster_replicas=2)
    workers.settle(3)
    nodes = sorted(workers.by_node())
    where = workers.holders(list(data))
    assert all(where[k] == set(owners(k, nodes, 2)) for k in data)
    _die(workers, workers.started[1])
    workers.settle(2)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mget(list(data)) == list(data.values())


def _die(workers, worker) -> None:
    """``worker`` gone as a crash would leave it: off the list (its lease ran out), no drain, its objects with it."""
    node = worker.member.node_id
    worker.stop(drain_s=0)
    if workers.url.startswith("inproc://"):
        open_membership(workers.url).expire(node)  # (stop() left already; for the shape of a death)


def test_a_worker_back_under_its_node_id_gets_its_keys_back(workers):
    workers.start(2, memory=64 << 20)
    (leaving,) = workers.start(1, memory=64 << 20, node_id="comes-back")
    workers.settle(3)
    data = values(200, seed=2)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.mset(data)
    its = [k for k in data if owners(k, sorted(workers.by_node()), 1)[0] == "comes-back"]
    assert its
    leaving.stop(drain_s=20)  # (its keys go to their owners without it)
    workers.settle(2)
    (back,) = workers.start(1, memory=64 << 20, node_id="comes-back")
    workers.settle(3)
    assert all(back.store.exists(its))
    where = workers.holders(list(data))
    assert all(where[k] == {"comes-back"} for k in its)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mget(list(data)) == list(data.values())


def test_without_rebalance_a_join_moves_nothing(workers):
    workers.start(2, memory=32 << 20, cluster_rebalance=False)
    data = values(100, seed=3)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.mset(data)
    (newcomer,) = workers.start(1, memory=32 << 20, cluster_rebalance=False)
    time.sleep(0.5)
    assert workers.started[0].rebalancer is None and "rebalance" not in workers.started[0].stats()["cluster"]
    assert not any(newcomer.store.exists(list(data)))


# settings ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 17, 1.5, True, "2"])
def test_a_bad_replica_count_is_named(bad):
    with pytest.raises(InvalidValue, match=r"cluster_replicas \(--cluster-replicas\)"):
        WorkerConfig(cluster_replicas=bad)


def test_replicas_and_rebalance_from_the_environment_and_flags(monkeypatch):
    config = WorkerConfig.load({}, environ={"KVSTRATA_CLUSTER_REPLICAS": "3", "KVSTRATA_NO_CLUSTER_REBALANCE": "1"})
    assert config.cluster_replicas == 3 and config.cluster_rebalance is False
    with pytest.raises(InvalidValue, match="cluster_rebalance"):
        WorkerConfig(cluster_rebalance="yes")


def test_a_client_that_chooses_its_replicas_keeps_them(workers):
    workers.start(2, memory=32 << 20, cluster_replicas=2)
    with kvstrata.connect(cluster=workers.url, replicas=1) as kv:
        assert kv.replicas == 1
    with pytest.raises(InvalidValue, match="replicas"):
        kvstrata.connect(cluster=workers.url, replicas=0)
    with pytest.raises(InvalidValue, match="only for a cluster client"):
        kvstrata.connect(embedded=True, replicas=2)


def test_a_worker_lists_its_replica_count(workers):
    (worker,) = workers.start(1, cluster_replicas=2)
    assert worker.member.info["replicas"] == 2
    assert worker.stats()["cluster"]["replicas"] == 2


def test_a_rebalance_that_failed_in_part_runs_again_until_everything_is_handed_on(workers, monkeypatch):
    """A key that could not be read (or a worker out of reach) fails its part; the rebalance runs again, backing off,
    and drops nothing it did not hand on."""
    from kvstrata.cluster.membership import Member
    from kvstrata.errors import ServerError
    from kvstrata.server import rebalance as rb

    monkeypatch.setattr(rb, "RETRY_FIRST_S", 0.05)
    (target,) = workers.start(1, memory=32 << 20, cluster_rebalance=False)
    node = target.member.node_id
    me = Member("me", "tcp://127.0.0.1:1")
    after = Placement(["me", node])
    keys = [f"k{i}" for i in range(100) if after.owners(f"k{i}")[0] == node][:5]
    failures = {"left": 2}
    with ObjectStore(StoreConfig(memory_bytes=16 << 20)) as store:
        for key in keys:
            store.put(key, key.encode())

        def read(key: str) -> bytes:
            if key == keys[0] and failures["left"]:
                failures["left"] -= 1
                raise ServerError("disk read failed")
            return store.get_bytes(key, timeout=0)

        rebalancer = rb.Rebalancer(
            "me", {"me": me}, listing=store.listing, read=read,
            drop=lambda ks, vs: store.delete(ks, versions=vs), grace=0.05,
        )  # fmt: skip
        try:
            rebalancer.update({"me": me, node: target.member})
            assert wait_until(lambda: rebalancer.runs >= 1, 10)
            assert rebalancer.last["failed"] == 1 and not rebalancer.settled()
            assert store.exists([keys[0]]) == [True]  # (not handed on: kept)
            assert rebalancer.wait_settled(10) and rebalancer.runs == 3 and rebalancer.retry_in == 0
            assert rebalancer.last["failed"] == 0 and rebalancer.last["present"] == 0  # (the rest went in try 1)
            assert not any(store.exists(keys))
        finally:
            rebalancer.close()
    with kvstrata.connect(address=target.address) as direct:
        assert direct.mget(keys) == [k.encode() for k in keys]


def test_a_moved_object_keeps_its_write_mode_and_time_to_live(workers):
    workers.start(2, memory=32 << 20)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.mset({f"e{i}": b"evictable" for i in range(60)}, write_mode="evictable", ttl=600)
        kv.mset({f"m{i}": b"plain" for i in range(60)})
    (newcomer,) = workers.start(1, memory=32 << 20)
    workers.settle(3)
    held = {key: (ttl, mode) for key, ttl, _, mode in newcomer.store.listing()}
    assert any(k.startswith("e") for k in held) and any(k.startswith("m") for k in held)
    for key, (ttl, mode) in held.items():
        if key.startswith("e"):
            assert mode == "evictable" and 500 < ttl <= 600
        else:
            assert mode == "memory" and ttl is None


def test_a_run_cut_short_by_a_newer_list_plans_the_next_from_the_list_it_was_for(workers):
    """Lists L0 = {me, T}, L1 = {me, T, X}, L2 = {me, T} (X died): a key written under L1 to (me, X) must reach T under
    L2, though L2 equals L0: the run for L1, cut short by L2, leaves L1 as the next run's base."""
    import threading as _threading

    from kvstrata.cluster.membership import Member
    from kvstrata.server import rebalance as rb

    (target,) = workers.start(1, memory=32 << 20, cluster_rebalance=False)
    node = target.member.node_id
    me, x = Member("me", "tcp://127.0.0.1:1"), Member("x", "tcp://127.0.0.1:1")
    l0 = l2 = {"me": me, node: target.member}
    l1 = l0 | {"x": x}
    key = next(f"k{i}" for i in range(500) if set(owners(f"k{i}", list(l1), 2)) == {"me", "x"})
    release = _threading.Event()
    with ObjectStore(StoreConfig(memory_bytes=16 << 20)) as store:
        store.put(key, b"written under L1")

        def read(k: str) -> bytes:
            release.wait(10)  # (the run for L1 is still going when L2 comes)
            return store.get_bytes(k, timeout=0)

        rebalancer = rb.Rebalancer(
            "me", l0, listing=store.listing, read=read, drop=lambda ks, vs: store.delete(ks, versions=vs),
            replicas=2, grace=0.05,
        )  # fmt: skip
        try:
            rebalancer.update(l1)
            assert wait_until(lambda: rebalancer.running, 5)
            rebalancer.update(l2)
            release.set()
            assert rebalancer.wait_settled(30)
            assert rebalancer.last["cancelled"] is False and rebalancer.last["moved"] == 1, rebalancer.last
        finally:
            rebalancer.close()
        assert store.exists([key]) == [True]  # (an owner under L2 too: kept)
    with kvstrata.connect(address=target.address) as direct:
        assert direct.get(key) == b"written under L1"
