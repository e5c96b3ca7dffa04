"""The etcd backend's watch and its resources: a watch wakes on its own cluster's changes only and misses none made
between a read and the next watch; close() ends the watch thread at once and leaves no connection to etcd open."""

from __future__ import annotations

import threading

import psutil
import pytest

pytest.importorskip("etcd3gw", reason="the etcd backend's tests need etcd3gw (pip install 'kvstrata[cluster]')")
from etcd3gw.client import Etcd3Client

from kv_helpers import wait_until
from kvstrata.cluster import Member, open_membership
from kvstrata.cluster.etcd import EtcdMembership


def etcd_connections(endpoint: str) -> int:
    port = int(endpoint.rsplit(":", 1)[1])
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_a_watch_wakes_on_its_own_cluster_only_and_misses_no_change(etcd_endpoint, etcd_cluster_url, monkeypatch):
    """With no timed re-read (refresh_s=60), another cluster's key changing does not wake the watch, and the join
    right after it is seen at once (before: the watch's key range was wrong, so it woke on keys of any cluster, then
    re-read, then watched from "now", missing a change made in between until the next timed re-read)."""
    seen: list[set[str]] = []
    reads = []
    post = Etcd3Client.post

    def counted(client, url, *args, **kwargs):
        if url.endswith("/kv/range") and threading.current_thread().name.startswith("kvstrata-etcd-watch"):
            reads.append(url)
        return post(client, url, *args, **kwargs)

    monkeypatch.setattr(Etcd3Client, "post", counted)
    other = f"etcd://{etcd_endpoint}/z{etcd_cluster_url.rsplit('/', 1)[1]}"  # (its keys sort after this cluster's)
    view = EtcdMembership(etcd_cluster_url, refresh_s=60)
    try:
        with open_membership(other) as elsewhere, open_membership(etcd_cluster_url) as here:
            view.watch(lambda members: seen.append(set(members)))
            assert wait_until(lambda: seen == [set()], 10), seen
            first_reads = len(reads)
            elsewhere.join(Member("n-other", "tcp://127.0.0.1:7001"), ttl=5)  # (another cluster's list)
            here.join(Member("n-here", "tcp://127.0.0.1:7002"), ttl=5)
            assert wait_until(lambda: {"n-here"} in seen, 10), f"the join was not seen: {seen}"
            assert len(reads) == first_reads + 1, "the watch woke for another cluster's change"
    finally:
        view.close()


def test_close_ends_the_watch_at_once_and_its_connections(etcd_endpoint, etcd_cluster_url):
    before = etcd_connections(etcd_endpoint)
    views = []
    for _ in range(3):
        view = EtcdMembership(etcd_cluster_url, refresh_s=60)
        called = threading.Event()
        view.watch(lambda members, called=called: called.set())
        assert called.wait(10)
        view.join(Member(f"n{len(views)}", "tcp://127.0.0.1:7000"), ttl=5)
        views.append(view)  # (kept: nothing is freed by the garbage collector)
    for view in views:
        view.close()
    watching = lambda: [t for t in threading.enumerate() if t.name.startswith("kvstrata-etcd-watch")]
    assert not watching(), "a watch thread outlived close()"
    assert wait_until(lambda: etcd_connections(etcd_endpoint) <= before, 5), (
        f"{etcd_connections(etcd_endpoint) - before} connections to etcd left open after close()"
    )


def test_a_renewal_relisting_while_the_member_leaves_does_not_list_it_again(etcd_cluster_url):
    """The renewer found the lease gone and was listing the member anew when leave() came: the new listing is taken
    back (before, it stayed listed, a ghost of a stopped worker, until its lease ran out)."""
    entered, go = threading.Event(), threading.Event()
    with open_membership(etcd_cluster_url, timeout=1) as a, open_membership(etcd_cluster_url) as reader:
        a.join(Member("n1", "tcp://127.0.0.1:7001"), ttl=1)
        real_list = a._list

        def held_list(member, ttl):
            entered.set()
            go.wait(10)
            return real_list(member, ttl)

        a._list = held_list
        renewer = a._renewer
        client = reader._clients[0]
        client.post(client.get_url("/kv/lease/revoke"), json={"ID": a._lease.id})  # (etcd forgot it)
        assert entered.wait(10), "the renewer never found its lease gone"
        a.leave()
        go.set()
        renewer.join(10)
        assert not renewer.is_alive()
        assert reader.members() == {}, "the member left, yet the renewer listed it again"
