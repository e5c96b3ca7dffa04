"""The member list, on both backends (inproc, and a real etcd): join, leave, watch, a node id taken twice, a
dead worker's lease running out, malformed entries and addresses, an etcd out of reach."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kv_helpers import wait_until
from kvstrata.cluster import Member, open_membership
from kvstrata.cluster.membership import advertised_address
from kvstrata.errors import InvalidType, InvalidValue, KeyExists, TransportError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def member(i: int) -> Member:
    return Member(f"node-{i}", f"tcp://127.0.0.1:{7000 + i}", socket="unix:///tmp/x.sock", host="h", info={"pid": i})


def test_join_lists_a_member_and_leave_takes_it_off(cluster_url):
    with open_membership(cluster_url) as a, open_membership(cluster_url) as reader:
        assert reader.members() == {}
        a.join(member(1), ttl=5)
        listed = reader.members()
        assert listed == {"node-1": member(1)} and listed["node-1"].info == {"pid": 1}
        a.leave()
        assert reader.members() == {}
        a.join(member(1), ttl=5)  # (may join again after leaving)
        assert set(reader.members()) == {"node-1"}
    with open_membership(cluster_url) as reader:  # closing a view leaves
        assert reader.members() == {}


def test_a_node_id_cannot_be_taken_twice(cluster_url):
    with open_membership(cluster_url) as a, open_membership(cluster_url) as b:
        a.join(member(1), ttl=5)
        with pytest.raises(KeyExists, match="node-1"):
            b.join(Member("node-1", "tcp://127.0.0.1:9999"), ttl=5)
        assert a.members()["node-1"].address == "tcp://127.0.0.1:7001"  # the first keeps it
        with pytest.raises(InvalidValue, match="already joined"):
            a.join(member(2), ttl=5)
        b.join(member(2), ttl=5)  # b is still free to join under another id
        assert set(a.members()) == {"node-1", "node-2"}


def test_watchers_see_each_change(cluster_url):
    seen: list[set[str]] = []
    changed = threading.Event()

    def on_change(members):
        seen.append(set(members))
        changed.set()

    with open_membership(cluster_url) as watcher, open_membership(cluster_url) as a:
        stop = watcher.watch(on_change)
        a.join(member(1), ttl=5)
        assert wait_until(lambda: {"node-1"} in seen, 10), "the watcher never saw the join"
        a.leave()
        assert wait_until(lambda: seen and seen[-1] == set(), 10), "the watcher never saw the leave"
        stop()
        count = len(seen)
        a.join(member(3), ttl=5)
        assert set(watcher.members()) == {"node-3"}
        changed.clear()
        changed.wait(0.5)
        assert len(seen) <= count + 1  # (at most a call already under way when it stopped)


def test_inproc_expiry_drops_a_member_as_a_lease_running_out_would():
    with open_membership("inproc://expiry") as a, open_membership("inproc://expiry") as reader:
        a.join(member(1), ttl=5)
        reader.expire("node-1")
        assert reader.members() == {}


JOIN_AND_WAIT = textwrap.dedent(
    """
    import sys, time
    from kvstrata.cluster import Member, open_membership
    m = open_membership(sys.argv[1])
    m.join(Member("doomed", "tcp://127.0.0.1:7999"), ttl=2)
    print("joined", flush=True)
    time.sleep(600)
    """
)


def test_a_killed_members_lease_runs_out(etcd_cluster_url):
    """A worker process SIGKILLed (nothing runs to leave) drops out of the etcd list once its ttl passes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", JOIN_AND_WAIT, etcd_cluster_url],
        env=dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", "")),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "joined"
        with open_membership(etcd_cluster_url) as reader:
            assert set(reader.members()) == {"doomed"}
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            # the lease: 2 s (etcd may keep it up to a second or so longer)
            assert wait_until(lambda: reader.members() == {}, 15), "the dead member stayed listed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_a_member_stays_listed_past_its_ttl_while_it_lives(etcd_cluster_url):
    import time

    with open_membership(etcd_cluster_url) as a, open_membership(etcd_cluster_url) as reader:
        a.join(member(1), ttl=2)
        lease = a._lease.id
        time.sleep(3)  # past the lease's 2 s: listed still only where it was renewed (every 2/3 s)
        assert set(reader.members()) == {"node-1"} and a._lease.id == lease


def test_a_member_whose_lease_was_revoked_behind_its_back_is_listed_again(etcd_cluster_url):
    """etcd forgot the lease (out of reach past ttl, or an operator revoked it): the renewer lists it anew."""
    with open_membership(etcd_cluster_url) as a, open_membership(etcd_cluster_url) as reader:
        a.join(member(1), ttl=1)
        lease_id = a._lease.id
        reader._clients[0].post(reader._clients[0].get_url("/kv/lease/revoke"), json={"ID": lease_id})
        listed_again = lambda: a._lease.id != lease_id and set(reader.members()) == {"node-1"}
        assert wait_until(listed_again, 10), "the member was not listed again"


def test_a_malformed_entry_in_etcd_is_skipped(etcd_cluster_url):
    with open_membership(etcd_cluster_url) as a:
        a.join(member(1), ttl=5)
        a._clients[0].put(a.prefix + "garbage", "not json")
        assert set(a.members()) == {"node-1"}


def test_an_etcd_out_of_reach_is_named():
    with pytest.raises(TransportError, match=r"cannot reach etcd.*127\.0\.0\.1:1"):
        open_membership("etcd://127.0.0.1:1/x", timeout=1)


def test_a_second_endpoint_stands_in_for_one_out_of_reach(etcd_endpoint):
    url = f"etcd://127.0.0.1:1,{etcd_endpoint}/two-endpoints"
    with open_membership(url, timeout=1) as m:
        m.join(member(1), ttl=5)
        assert set(m.members()) == {"node-1"}


@pytest.mark.parametrize(
    "url, match",
    [
        ("etcd-ish://h:1/x", "unknown scheme"),
        ("h:2379", "no scheme"),
        ("inproc://", "needs a name"),
        ("etcd://h:notaport/x", "not HOST:PORT"),
        ("etcd://h:2379/a/b", "name"),
    ],
)
def test_bad_cluster_addresses_are_named(url, match):
    with pytest.raises(InvalidValue, match=match):
        open_membership(url)


def test_bad_members_are_refused():
    with pytest.raises(InvalidValue, match="node_id"):
        Member("has space", "tcp://h:1")
    with pytest.raises(InvalidValue, match="node_id"):
        Member("", "tcp://h:1")
    with pytest.raises(InvalidType, match="node_id"):
        Member(7, "tcp://h:1")  # type: ignore[arg-type]
    with pytest.raises(InvalidValue, match="tcp://"):
        Member("n", "unix:///tmp/s")
    with pytest.raises(InvalidValue, match="malformed member entry"):
        Member.from_json('{"node_id": "n"}')
    with open_membership("inproc://ttl") as m, pytest.raises(InvalidValue, match="ttl"):
        m.join(member(1), ttl=0.2)
    with pytest.raises(InvalidType):
        open_membership(None)  # type: ignore[arg-type]


def test_advertised_address_replaces_a_wildcard_host():
    assert advertised_address("tcp://10.1.2.3:7390") == "tcp://10.1.2.3:7390"
    host, port = advertised_address("tcp://0.0.0.0:7390").removeprefix("tcp://").rsplit(":", 1)
    assert port == "7390" and host not in ("0.0.0.0", "")


def test_a_create_that_timed_out_after_it_took_is_not_taken_for_another_members(etcd_endpoint):
    """etcd made the entry, but the answer timed out; the retry on the next endpoint finds the entry: it is ours (our
    lease), not a live worker's under our id."""
    from etcd3gw import exceptions

    url = f"etcd://{etcd_endpoint},{etcd_endpoint}/timed-out-create"
    with open_membership(url) as m, open_membership(url) as reader:
        first = m._clients[0]
        real_create = first.create

        def create_then_time_out(*args, **kwargs):
            real_create(*args, **kwargs)
            raise exceptions.ConnectionTimeoutError("read timed out (after etcd applied it)")

        first.create = create_then_time_out
        m._current = 0
        m.join(member(1), ttl=5)
        assert set(reader.members()) == {"node-1"}
        m.leave()
        assert reader.members() == {}


def test_cluster_names_are_ascii():
    with pytest.raises(InvalidValue, match="name"):
        open_membership("etcd://h:1/caf\u00e9")
