"""A cluster whose workers ask for a token (``--auth-token-file``): clients holding it (``$KVSTRATA_TOKEN``) use it as
any cluster, the workers hand objects to each other with it (a rebalance on a join, a drain on a stop), and a client
without it is told so, not that no worker can be reached."""

from __future__ import annotations

import pytest

import kvstrata
from kv_helpers import wait_until
from kvstrata.cluster import owners
from kvstrata.errors import AuthenticationError
from kvstrata.transport.core import TOKEN_ENV


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    path = tmp_path / "cluster.token"
    path.write_text("cluster-secret-9f2c41d7\n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return str(path)


def test_a_guarded_cluster_serves_token_holders_and_hands_objects_on_between_its_workers(
    workers, token_file, monkeypatch
):
    workers.start(2, memory=32 << 20, auth_token_file=token_file, cluster_drain=20)
    data = {f"k{i}": b"v%d" % i * (i * 997 % 70_000 + 1) for i in range(80)}
    monkeypatch.setenv(TOKEN_ENV, "cluster-secret-9f2c41d7")
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mset(data) == [None] * len(data)
    (newcomer,) = workers.start(1, memory=32 << 20, auth_token_file=token_file, cluster_drain=20)
    nodes = sorted(workers.by_node())
    theirs = [k for k in data if owners(k, nodes, 1)[0] == newcomer.member.node_id]
    assert theirs
    assert wait_until(lambda: all(newcomer.store.exists(theirs)), 20)  # (the old workers' rebalance: authenticated)
    workers.started[0].stop()  # (its drain, authenticated too)
    assert workers.started[0].drained["failed"] == 0
    with kvstrata.connect(cluster=workers.url) as kv:
        assert wait_until(lambda: len(kv.nodes) == 2, 10)
        assert kv.mget(list(data)) == list(data.values())
    monkeypatch.delenv(TOKEN_ENV)
    with _tcp_client(workers.url) as kv:  # (over TCP: a worker's Unix socket asks for no token)
        got = kv.mget(["k1"])
        assert isinstance(got[0], AuthenticationError) and TOKEN_ENV in str(got[0])


def _tcp_client(url: str):
    from kvstrata.client.cluster import ClusterClient

    return ClusterClient(url, prefer_local=False)
