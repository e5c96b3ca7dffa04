"""What a ClusterClient reads after the live workers change without the member list changing: keys written to a
stand-in while a worker was skipped are found once it is back, a worker restarted under its node id and address is
not skipped for its predecessor's failure, and a key no worker could answer for is an error, not a miss."""

from __future__ import annotations

import socket
import time
import uuid

import pytest

import kvstrata
from kvstrata.client.cluster import ClusterClient
from kvstrata.errors import ConnectionLost, KeyExists, TransportError
from kvstrata.server import Worker, WorkerConfig


@pytest.fixture
def cluster_url() -> str:
    """(This module's workers fixture: an in-process member list only.)"""
    return f"inproc://views-{uuid.uuid4().hex[:12]}"


class Blockable:
    """A ClusterClient's connect that refuses the addresses in ``blocked`` (a worker out of reach for a while)."""

    def __init__(self) -> None:
        self.blocked: set[str] = set()

    def __call__(self, *, address: str, timeout: float, name: str | None):
        if address in self.blocked:
            raise TransportError(f"could not connect to {address} (blocked by the test)")
        return kvstrata.connect(address, timeout=timeout, name=name)


def test_keys_written_while_a_worker_was_skipped_are_found_once_it_is_back(workers):
    started = workers.start(3)
    connect = Blockable()
    with ClusterClient(workers.url, ttl=0.2, connect=connect) as kv:
        away = started[0]
        connect.blocked = {away.address, away.member.address}
        keys = [f"k{i}" for i in range(60)]
        assert kv.mset({k: k.encode() for k in keys}) == [None] * 60  # (the first fails over: away is skipped)
        assert away.member.node_id not in kv.nodes
        stood_in = [k for k in keys if kv.owners(k)[0] != away.member.node_id]
        connect.blocked = set()
        time.sleep(0.3)  # (the skip lapses)
        assert away.member.node_id in kv.nodes
        moved = [k for k in keys if kv.owners(k)[0] == away.member.node_id]
        assert moved and len(stood_in) == 60  # (while away, every key went to the others)
        assert kv.mget(keys) == [k.encode() for k in keys]  # (the moved ones from where they were written)
        assert kv.exists(moved) == [True] * len(moved)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_restarted_on_the_same_address_is_not_skipped_for_its_predecessor(workers, tmp_path):
    """A crash and a restart the client's watch did not see between (the list went from one run of node 'a' to the
    next): the client's connection to the old run fails once, and the new run serves at once."""
    port = _free_port()

    def worker_a() -> Worker:
        config = WorkerConfig(
            socket=str(tmp_path / "a.sock"), memory=16 << 20, disk_dir="", cluster=workers.url,
            cluster_listen=f"tcp://127.0.0.1:{port}", node_id="a", spin_us=0,
        )  # fmt: skip
        return Worker(config).start()

    first = worker_a()
    workers.started.append(first)
    with kvstrata.connect(cluster=workers.url) as kv:
        kv.set("k", b"1")
        assert kv.get("k") == b"1"  # (connected to the first run)
        kv._stop_watch()  # (so that it does not see the gap)
        membership, first.membership = first.membership, None
        first.stop()  # a crash: the entry stays
        membership.expire("a")  # its lease runs out...
        second = worker_a()  # ...and it restarts at once, on the same socket and port
        workers.started.append(second)
        kv.refresh()  # the list the client now reads: node 'a' again, another run
        kv.set("k", b"2")
        assert kv.get("k") == b"2" and kv.nodes == ["a"]


def test_a_key_no_worker_could_answer_for_is_an_error_not_a_miss(workers):
    started = workers.start(2, cluster_replicas=2)
    connect = Blockable()
    with ClusterClient(workers.url, replicas=2, ttl=30, connect=connect) as kv:
        assert kv.mset({"k": b"v"}) == [None]
        connect.blocked = {started[0].address}  # one replica out of reach: the other answers
        kv._clients.clear()
        assert kv.exists(["k", "absent"]) == [True, False] and kv.size("k") == 1
        connect.blocked |= {started[1].address}
        kv._clients.clear()
        kv._suspects.clear()
        with pytest.raises((ConnectionLost, TransportError)):
            kv.exists("k")
        kv._suspects.clear()
        with pytest.raises((ConnectionLost, TransportError)):
            kv.size("k")


def test_a_worker_restarted_with_its_predecessors_pid_waits_out_its_lease(etcd_cluster_url, tmp_path):
    """A container restarted with the same hostname and pid (often 1) finds its predecessor's entry under its pid:
    it waits for that lease to run out rather than refusing to start (two live workers of one process under one id
    are still refused)."""

    def config(name: str) -> WorkerConfig:
        return WorkerConfig(
            socket=str(tmp_path / f"{name}.sock"), memory=16 << 20, disk_dir="", cluster=etcd_cluster_url,
            cluster_listen="tcp://127.0.0.1:0", node_id="p", cluster_ttl=1, spin_us=0,
        )  # fmt: skip

    first = Worker(config("first")).start()
    membership, first.membership = first.membership, None
    membership._stop_renewing.set()  # a crash: its lease is no longer renewed, nor revoked
    first.stop()
    second = Worker(config("second")).start()  # (same pid: waits ~1 s for the lease to lapse)
    try:
        assert second.member.node_id == "p"
        with pytest.raises(Exception, match="already a member"):
            Worker(config("third")).start()  # a live worker of this process holds it: refused
    finally:
        second.stop()
        membership.close()


def test_connect_names_a_bad_timeout_for_a_cluster():
    from kvstrata.errors import InvalidType

    with pytest.raises(InvalidType, match="timeout"):
        kvstrata.connect(cluster=f"inproc://t-{uuid.uuid4().hex[:8]}", timeout=None)


def test_a_write_once_refused_by_one_replica_is_taken_back_from_the_others(workers):
    """nx / mset_d2h with replicas: where one owner holds the key already, the others do not keep the new value (the
    replicas would then disagree)."""
    import torch

    started = workers.start(2, cluster_replicas=2)
    with kvstrata.connect(cluster=workers.url, replicas=2) as kv:
        first_owner = kv.owners("k")[0]
        direct = {w.member.node_id: kvstrata.connect(w.address) for w in started}
        try:
            direct[first_owner].set("k", b"old")  # (on one replica only, as a write that half failed leaves it)
            direct[first_owner].mset_d2h(["t"], [[torch.zeros(4)]])
            with pytest.raises(KeyExists):
                kv.set("k", b"new", nx=True)
            assert isinstance(kv.mset_d2h(["t"], [[torch.ones(4)]])[0], KeyExists)
            other = next(n for n in direct if n != first_owner)
            assert direct[other].exists(["k", "t"]) == [False, False]
            assert direct[first_owner].get("k") == b"old"
        finally:
            for c in direct.values():
                c.close()
