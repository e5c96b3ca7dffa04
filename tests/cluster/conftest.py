"""Cluster-mode fixtures: a real etcd server (the ``etcd`` binary, started once per test session on free ports; its
tests skip where the binary is missing: CI installs it, ``.ci/run``), a fresh cluster name per test, and workers
that join a cluster (in this process, on TCP and a Unix socket each)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kv_helpers import wait_until
from kvstrata.bench._etcd import LocalEtcd
from kvstrata.server import Worker, WorkerConfig

#: an etcd to use instead of starting one (``http://HOST:PORT``)
ETCD_ENV = "KVSTRATA_TEST_ETCD"


@pytest.fixture(scope="session")
def etcd_endpoint() -> Iterator[str]:
    """``HOST:PORT`` of a running etcd v3 (started here, or ``$KVSTRATA_TEST_ETCD``)."""
    given = os.environ.get(ETCD_ENV, "").removeprefix("http://").strip("/")
    if given:
        yield given
        return
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (apt-get install etcd-server; .ci/run does)")
    with LocalEtcd() as etcd:
        yield etcd.endpoint


@pytest.fixture(params=["inproc", "etcd"])
def cluster_url(request: pytest.FixtureRequest) -> str:
    """A fresh cluster's address, on each membership backend."""
    name = f"t{uuid.uuid4().hex[:12]}"
    if request.param == "inproc":
        return f"inproc://{name}"
    return f"etcd://{request.getfixturevalue('etcd_endpoint')}/{name}"


@pytest.fixture
def etcd_cluster_url(etcd_endpoint: str) -> str:
    """A fresh cluster's address in the test etcd."""
    return f"etcd://{etcd_endpoint}/t{uuid.uuid4().hex[:12]}"


class Workers:
    """Workers of one cluster started in this process (each with a Unix socket and a TCP listener); stopped at the
    end of the test."""

    def __init__(self, url: str, folder: Path) -> None:
        self.url = url
        self.folder = folder
        self.started: list[Worker] = []

    def start(self, n: int = 1, *, memory: int = 16 << 20, ttl: float = 2.0, **settings) -> list[Worker]:
        out = []
        for _ in range(n):
            sock = self.folder / f"w{len(self.started)}.sock"
            config = WorkerConfig(
                socket=str(sock),
                memory=memory,
                disk_dir="",
                cluster=self.url,
                cluster_listen="tcp://127.0.0.1:0",
                cluster_ttl=ttl,
                spin_us=0,
                **settings,
            )
            worker = Worker(config).start()
            self.started.append(worker)
            out.append(worker)
        return out

    def by_node(self) -> dict[str, Worker]:
        """The running workers by node id."""
        return {w.member.node_id: w for w in self.started if w.member is not None and not w._stopped.is_set()}

    def holders(self, keys: list[str]) -> dict[str, set[str]]:
        """Per key, the running workers whose stores hold it."""
        out: dict[str, set[str]] = {k: set() for k in keys}
        for node, worker in self.by_node().items():
            for key, there in zip(keys, worker.store.exists(keys)):
                if there:
                    out[key].add(node)
        return out

    def settle(self, n_nodes: int, timeout: float = 20) -> None:
        """Wait until every running worker was told of a list of ``n_nodes`` workers and handed its objects on for
        it (kvstrata.server.rebalance)."""
        running = list(self.by_node().values())

        def done() -> bool:
            return all(len(w.rebalancer.nodes) == n_nodes and w.rebalancer.settled() for w in running)

        assert wait_until(done, timeout), [(w.rebalancer.nodes, w.rebalancer.settled()) for w in running]

    def stop_all(self) -> None:
        for worker in self.started:
            worker.stop()


@pytest.fixture
def workers(cluster_url: str, tmp_path: Path) -> Iterator[Workers]:
    group = Workers(cluster_url, tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def workers_at(tmp_path: Path) -> Iterator[Callable[[str], Workers]]:
    """``workers_at(url)``: a :class:`Workers` group of the cluster at ``url`` (for tests that run an etcd of their
    own: TLS, auth), each in a folder of its own; all stopped at the end of the test."""
    groups: list[Workers] = []

    def make(url: str) -> Workers:
        folder = tmp_path / f"group{len(groups)}"
        folder.mkdir()
        groups.append(Workers(url, folder))
        return groups[-1]

    try:
        yield make
    finally:
        for group in groups:
            group.stop_all()
