"""Small gets answered from shared memory without a round trip, and never stale."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import pytest

import kvstrata
from kvstrata.errors import KeyNotFound
from kvstrata.server import Worker, WorkerConfig
from kvstrata.server.protocol import INLINE_MAX

sys.path.insert(0, str(Path(__file__).parent))
import _e2e_jobs as jobs


@pytest.fixture
def worker(tmp_path):
    config = WorkerConfig.load(
        {"socket": str(tmp_path / "w.sock"), "memory": "32MiB", "disk_dir": "", "numa_node": "none"}, environ={}
    )
    with Worker(config).start() as w:
        yield w


def requests(w):
    return w.counters["requests"]


def test_repeated_gets_skip_the_worker(worker):
    with kvstrata.connect(worker.address) as kv:
        kv.set("hot", b"v" * 4096)
        assert kv.get("hot") == b"v" * 4096  # leases it
        before = requests(worker)
        for _ in range(200):
            assert kv.get("hot") == b"v" * 4096
        assert requests(worker) == before
        assert kv._backend._local.hits >= 200


def test_changes_by_others_are_seen_at_once(worker):
    with kvstrata.connect(worker.address) as reader, kvstrata.connect(worker.address) as writer:
        writer.set("k", b"one")
        assert reader.get("k") == b"one"
        assert reader.get("k") == b"one"
        writer.set("k", b"two")
        assert reader.get("k") == b"two"
        with writer.create("k", 5) as buf:
            buf.write(b"three")
        assert reader.get("k") == b"three"
        writer.delete("k")
        with pytest.raises(KeyNotFound):
            reader.get("k")
        writer.set("k", b"four")
        assert reader.get("k") == b"four"
        writer.expire("k", 0.2)  # from now on it has a TTL: read through the worker, expiring on time
        time.sleep(0.4)
        with pytest.raises(KeyNotFound):
            reader.get("k")
        writer.set("k", b"five")
        assert reader.get("k") == b"five"
        writer.incref("k")
        assert writer.decref("k") == 0  # deleted at zero
        with pytest.raises(KeyNotFound):
            reader.get("k")


def test_what_is_not_kept(worker):
    with kvstrata.connect(worker.address) as kv:
        kv.set("ttl", b"t", ttl=30)
        kv.set("big", b"b" * INLINE_MAX)
        buf = kv.create("mutable", 3)
        buf.write(b"pub")
        buf.publish()
        for key in ("ttl", "big", "mutable"):
            kv.get(key)
            before = requests(worker)
            kv.get(key)
            assert requests(worker) > before, key  # went to the worker
        assert len(kv._backend._local) == 0


def test_kept_leases_are_bounded_and_given_back(worker):
    with kvstrata.connect(worker.address) as kv:
        kv.mset({f"n{i}": bytes([i % 256]) * 100 for i in range(300)})
        for i in range(300):
            assert kv.get(f"n{i}") == bytes([i % 256]) * 100
        local = kv._backend._local
        assert len(local) == local.max_entries  # the count bounds it here, the bytes below
        assert kv.stats()["leases"] == local.max_entries  # (in order after the one-way releases)
        kv.set("other", b"x")  # any change: every kept lease goes back with the next message
        kv.exists("other")
        assert len(local) == 0 and worker.store.stats()["leases"] == 0
        kv.delete([f"n{i}" for i in range(300)])
        kv.mset({f"b{i}": b"b" * 60_000 for i in range(100)})
        for i in range(100):
            kv.get(f"b{i}")
        assert len(local) * 60_000 <= local.max_bytes < (len(local) + 1) * 60_000


def test_no_stale_read_under_a_concurrent_writer(worker):
    ctx = multiprocessing.get_context("spawn")
    with kvstrata.connect(worker.address) as kv:
        kv.set("ctr", b"0")
        writer = ctx.Process(target=jobs.count_up, args=(worker.address, "ctr", 300))
        writer.start()
        last = 0
        while writer.is_alive() or last < 300:
            value = int(kv.get("ctr"))
            assert value >= last, f"went back from {last} to {value}"
            last = value
            if not writer.is_alive() and writer.exitcode != 0:
                pytest.fail("writer failed")
        writer.join(10)
        assert writer.exitcode == 0 and int(kv.get("ctr")) == 300


def test_a_dead_worker_is_not_read_from(tmp_path):
    import signal

    from test_worker_e2e import start_worker, stop

    proc, address = start_worker(tmp_path)
    kv = kvstrata.connect(address)
    kv.set("hot", b"cached")
    assert kv.get("hot") == b"cached" and kv.get("hot") == b"cached"
    stop(proc, signal.SIGKILL)
    with pytest.raises(kvstrata.ConnectionLost):
        kv.get("hot")
    kv.close()
