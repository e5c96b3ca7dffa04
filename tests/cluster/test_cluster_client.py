"""ClusterClient over real workers (in this process, on TCP and Unix sockets), on both membership backends: keys
land on their owners and only there, reads find them from any client, replicas survive a worker's loss, a join or
a departure loses no key written before it, device-object calls route too, and bad input is refused by name."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import kvstrata
from kv_helpers import wait_until
from kvstrata.client.cluster import ClusterClient, NoWorkers
from kvstrata.cluster import open_membership, owners
from kvstrata.errors import ClosedError, InvalidType, InvalidValue, KeyExists, KeyNotFound, Timeout


def direct(worker):
    """A plain client of one worker (its Unix socket)."""
    return kvstrata.connect(address=worker.address, timeout=10)


def holders(workers, key) -> set[str]:
    found = set()
    for node, worker in workers.by_node().items():
        with direct(worker) as kv:
            if kv.exists(key):
                found.add(node)
    return found


def test_keys_land_on_their_owner_and_any_client_reads_them(workers):
    workers.start(3)
    items = {f"req{i}/block{i % 7}": bytes([i % 256]) * (100 + 977 * i) for i in range(60)}
    with kvstrata.connect(cluster=workers.url) as writer, kvstrata.connect(cluster=workers.url) as reader:
        assert len(writer.nodes) == 3
        assert writer.mset(items) == [None] * len(items)
        nodes = list(workers.by_node())
        per_node = {n: 0 for n in nodes}
        for key in items:
            (owner,) = owners(key, nodes, 1)
            assert holders(workers, key) == {owner}
            per_node[owner] += 1
        assert all(count > 5 for count in per_node.values()), per_node  # (spread, not all on one)
        assert reader.mget(list(items)) == list(items.values())
        key = next(iter(items))
        assert reader.get(key) == items[key]
        assert reader.read(key, 10, 20) == items[key][10:30]
        assert reader.size([key, "absent"]) == [len(items[key]), None]
        assert reader.exists([key, "absent"]) == [True, False]
        assert isinstance(reader.mget(["absent"])[0], KeyNotFound)
        with pytest.raises(KeyNotFound):
            reader.get("absent")
        assert reader.delete([key, "absent"]) == [True, False]
        assert holders(workers, key) == set()
        assert reader.expire(list(items)[1], 60) is True


def test_single_key_calls_and_write_options_pass_through(workers):
    workers.start(2)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.set("a", np.arange(1000, dtype=np.float32))
        assert np.frombuffer(kv.get("a"), np.float32).tolist() == list(range(1000))
        with pytest.raises(KeyExists):
            kv.set("a", b"again", nx=True)
        kv.set("short", b"v", ttl=0.2)
        assert wait_until(lambda: not kv.exists("short"), 10), "a ttl did not reach the worker"
        with pytest.raises(InvalidValue, match="write_mode"):
            kv.set("b", b"v", write_mode="sometimes")


def test_replicas_keep_keys_readable_when_a_worker_stops(workers):
    started = workers.start(3, cluster_replicas=2)  # (the workers keep what the client writes)
    with kvstrata.connect(cluster=workers.url, replicas=2) as kv:
        items = {f"k{i}": b"x%d" % i for i in range(40)}
        assert kv.mset(items) == [None] * 40
        for key in items:
            assert len(holders(workers, key)) == 2
        started[0].stop()  # (leaves the list at once)
        assert wait_until(lambda: len(kv.nodes) == 2, 10), "the client never saw the worker leave"
        assert kv.mget(list(items)) == list(items.values())


def test_a_worker_that_vanishes_without_leaving_is_skipped(workers):
    """A worker whose connections fail while the list still shows it (its lease has not run out): reads go to the
    key's other replica, writes to the next-ranked live worker, at once."""
    started = workers.start(3, ttl=30, cluster_replicas=2)
    with kvstrata.connect(cluster=workers.url, replicas=2) as kv:
        items = {f"k{i}": b"x%d" % i for i in range(40)}
        assert kv.mset(items) == [None] * 40
        victim = started[1]
        node = victim.member.node_id
        membership, victim.membership = victim.membership, None  # (not told to leave: as a crash leaves it)
        victim.stop()
        assert node in {n for n in open_membership(workers.url).members()} or workers.url.startswith("inproc")
        assert kv.mget(list(items)) == list(items.values())
        assert node not in kv.nodes
        assert kv.mset({"new": b"n"}) == [None]
        assert len(holders(workers, "new") - {node}) == 2
        membership.close()


def test_keys_written_before_a_join_are_still_found(workers):
    workers.start(2)
    with kvstrata.connect(cluster=workers.url) as kv:
        items = {f"before{i}": b"b%d" % i for i in range(50)}
        assert kv.mset(items) == [None] * 50
        (new,) = workers.start(1)
        assert wait_until(lambda: len(kv.nodes) == 3, 10), "the client never saw the join"
        moved = [k for k in items if owners(k, kv.nodes, 1) == [new.member.node_id]]
        assert moved, "no key ranks the new worker first (50 keys, 3 workers)"
        assert kv.mget(list(items)) == list(items.values())  # (the moved ones from their old owners)
        assert kv.exists(moved) == [True] * len(moved)
        assert kv.delete(moved) == [True] * len(moved)
        assert kv.exists(moved) == [False] * len(moved)
        kv.set(moved[0], b"after")
        assert holders(workers, moved[0]) == {new.member.node_id}


def test_get_with_a_timeout_waits_for_a_key_another_client_writes(workers):
    workers.start(2)
    with kvstrata.connect(cluster=workers.url) as reader, kvstrata.connect(cluster=workers.url) as writer:
        timer = threading.Timer(0.3, lambda: writer.set("later", b"here"))
        timer.start()
        try:
            assert reader.get("later", timeout=20) == b"here"
        finally:
            timer.join()
        with pytest.raises(Timeout):
            reader.get("never", timeout=0.2)


def test_device_object_calls_route_each_key(workers):
    workers.start(3)
    keys = [f"kv/block{i}" for i in range(12)]
    src = [[torch.full((64,), float(i)), torch.arange(32, dtype=torch.int32) + i] for i in range(12)]
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mset_d2h(keys, src) == [None] * 12
        assert isinstance(kv.mset_d2h(keys[:1], src[:1])[0], KeyExists)  # (write-once)
        dst = [[torch.empty(64), torch.empty(32, dtype=torch.int32)] for _ in keys]
        assert kv.mget_h2d(keys, dst) == [None] * 12
        for a, b in zip(src, dst):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        dst2 = [[torch.empty(64), torch.empty(32, dtype=torch.int32)] for _ in keys]
        assert kv.async_mget_h2d(keys, dst2).result(timeout=30) == [None] * 12
        assert torch.equal(dst2[5][0], src[5][0])
        assert kv.async_mset_d2h(["kv/extra"], [[torch.ones(8)]]).result(timeout=30) == [None]
        missing = kv.mget_h2d(["kv/absent"], [[torch.empty(4)]])
        assert isinstance(missing[0], KeyNotFound)
        with pytest.raises(InvalidValue, match="tensor_lists"):
            kv.mget_h2d(keys, dst[:2])


def test_stats_and_ping_cover_every_worker(workers):
    workers.start(2)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.ping()
        stats = kv.stats()
        assert set(stats["nodes"]) == set(workers.by_node())
        assert all(s["cluster"]["node_id"] == node for node, s in stats["nodes"].items())


def test_tcp_only_clients_work_too(workers):
    """prefer_local=False: every worker through TCP, values inline (no shared memory)."""
    workers.start(2)
    with ClusterClient(workers.url, prefer_local=False) as kv:
        big = bytes(range(256)) * 8192  # 2 MiB: past the inline limit of a Unix-socket client
        kv.set("big", big)
        assert kv.get("big") == big
        assert all(c.address.startswith("tcp://") for c, _ in kv._clients.values())


@pytest.mark.parametrize("prefer_local", [True, False], ids=["unix", "tcp"])
def test_get_buffers_reads_each_key_from_its_workers_without_a_copy(workers, prefer_local):
    workers.start(3)
    items = {f"w/{i}": np.full(300_000 + i, i, dtype=np.uint8).tobytes() for i in range(8)}
    with ClusterClient(workers.url, prefer_local=prefer_local) as kv, kvstrata.connect(cluster=workers.url) as writer:
        assert writer.mset(items) == [None] * len(items)
        buffers = kv.get_buffers([*items, "w/absent"])
        assert [bytes(b) for b in buffers[:-1]] == list(items.values())
        assert isinstance(buffers[-1], KeyNotFound)
        assert all((b.lease_id is not None) == prefer_local for b in buffers[:-1])  # (leased in shared memory)
        assert buffers[2].numpy()[0] == 2 and buffers[2].memoryview().readonly
        for b in buffers[:-1]:
            b.release()
        (one,) = kv.get_buffers("w/3")
        assert bytes(one) == items["w/3"]
        one.release()
        timer = threading.Timer(0.3, lambda: writer.set("w/later", b"here"))
        timer.start()
        try:
            (later,) = kv.get_buffers(["w/later"], timeout=20)  # (waited for on its first owner)
        finally:
            timer.join()
        assert bytes(later) == b"here"
        assert kv.get_buffers([]) == []
        with pytest.raises(InvalidValue, match="timeout"):
            kv.get_buffers(["w/0"], timeout=-1)
    assert wait_until(lambda: all(w.store.stats()["leases"] == 0 for w in workers.by_node().values()), 10)


def test_no_workers_and_a_closed_client_are_named(cluster_url):
    with kvstrata.connect(cluster=cluster_url) as kv:
        with pytest.raises(NoWorkers, match="no worker is listed"):
            kv.set("k", b"v")
        with pytest.raises(NoWorkers):
            kv.get("k")
    with pytest.raises(ClosedError):
        kv.client("any")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"replicas": 0}, InvalidValue, "replicas"),
        ({"replicas": 1.5}, InvalidValue, "replicas"),
        ({"address": "unix:///tmp/x.sock"}, InvalidValue, "cluster"),
        ({"embedded": True}, InvalidValue, "cluster"),
    ],
)
def test_bad_cluster_client_arguments_are_named(cluster_url, kwargs, error, match):
    with pytest.raises(error, match=match):
        kvstrata.connect(cluster=cluster_url, **kwargs)


def test_bad_keys_and_items_are_named(workers):
    workers.start(1)
    with kvstrata.connect(cluster=workers.url) as kv:
        with pytest.raises(InvalidType):
            kv.set(7, b"v")  # type: ignore[arg-type]
        with pytest.raises(InvalidType, match="items"):
            kv.mset(b"not pairs")
        with pytest.raises(InvalidType, match=r"items\[0\]"):
            kv.mset([("only one",)])
        with pytest.raises(InvalidValue):
            kv.get("")
        assert kv.mget([]) == [] and kv.delete([]) == []


def test_replicas_only_with_a_cluster():
    with pytest.raises(InvalidValue, match="replicas"):
        kvstrata.connect(embedded=True, replicas=2, memory_bytes="1MiB")


def test_many_threads_share_one_cluster_client(workers):
    workers.start(3)
    errors: list[BaseException] = []
    with kvstrata.connect(cluster=workers.url) as kv:

        def run(t: int) -> None:
            try:
                for i in range(30):
                    key = f"t{t}/k{i}"
                    kv.set(key, b"%d" % (t * 1000 + i))
                    assert kv.get(key) == b"%d" % (t * 1000 + i)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(6)]
        started = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors[:3]
        assert time.monotonic() - started < 120
