"""Idle clients' local-read caches give back what the worker needs (kvstrata.client.local_reads, the keeper thread).

Each client's cache may keep leases up to its budget (a sixteenth of the memory tier), including those of views the
application released. Clients that made no call since kept them, and the leases of keys deleted or rewritten since,
until their next call: fourteen idle clients pinned 28 MiB of a 32 MiB tier, and every write that needed room failed
with CapacityError (session 38's client audit). Now a write that finds no room but leased objects asks the caches for
their leases and waits for them a moment, and each client's keeper gives back stale entries' leases on its own.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvstrata
from kv_helpers import wait_until, worker_config
from kvstrata.errors import CapacityError
from kvstrata.server import Worker

MB = 1 << 20
READERS = 14


@pytest.fixture
def worker(tmp_path):
    with Worker(worker_config(tmp_path, memory=32 * MB, segment=8 * MB)).start() as w:
        yield w


@pytest.fixture
def readers(worker):
    """``READERS`` idle clients, each holding in its cache the lease of a 2 MiB object it viewed once."""
    with kvstrata.connect(worker.address, timeout=5) as writer:
        for i in range(READERS):
            writer.set(f"obj{i}", np.full(2 * MB, i + 1, dtype=np.uint8), write_mode="evictable")
    clients = []
    try:
        for i in range(READERS):
            client = kvstrata.connect(worker.address, timeout=5)
            clients.append(client)
            with client.get_buffers([f"obj{i}"])[0] as view:
                assert view.numpy()[0] == i + 1
        assert worker.stats()["leases"] == READERS  # kept by the caches: the views are gone
        yield clients
    finally:
        for client in clients:
            client.close()


def test_a_write_short_of_room_gets_the_leases_idle_caches_keep(worker, readers):
    with kvstrata.connect(worker.address, timeout=5) as writer:
        used = worker.stats()["tiers"]["memory"]["used"]
        assert used >= READERS * 2 * MB  # 28 of 32 MiB, every object leased
        writer.set("new", np.full(6 * MB, 7, dtype=np.uint8))  # (memory mode: never evicted, no SSD here)
        assert np.array_equal(np.frombuffer(writer.get("new"), dtype=np.uint8), np.full(6 * MB, 7, dtype=np.uint8))
    # the caches gave everything back; a reader's next get asks the worker (the evicted keys miss, the others read)
    assert worker.stats()["leases"] <= READERS
    for i, client in enumerate(readers):
        got = client.get(f"obj{i}") if client.exists([f"obj{i}"])[0] else None
        assert got is None or np.frombuffer(got, dtype=np.uint8)[0] == i + 1


def test_a_view_the_application_holds_is_never_given_back(worker, readers):
    holder = readers[0]
    view = holder.get_buffers(["obj0"])[0]  # held: its bytes must stay whatever the worker needs
    try:
        with kvstrata.connect(worker.address, timeout=5) as writer, pytest.raises(CapacityError):
            writer.set("huge", np.zeros(31 * MB, dtype=np.uint8))  # would need obj0's room too
        assert worker.stats()["leases"] == 1  # the view's lease alone stayed
        assert np.all(view.numpy() == 1)
    finally:
        view.release()


def test_an_idle_client_gives_back_the_leases_of_keys_deleted_since(worker, readers):
    with kvstrata.connect(worker.address, timeout=5) as writer:
        assert writer.delete([f"obj{i}" for i in range(READERS)]) == [True] * READERS
        # no reader makes a call: their keepers find their entries stale and give the leases back
        assert wait_until(lambda: worker.stats()["leases"] == 0), worker.stats()["leases"]
        assert worker.stats()["tiers"]["memory"]["used"] == 0
        writer.set("new", np.full(24 * MB, 3, dtype=np.uint8))  # the whole room is there, with no wait


def test_a_full_store_of_other_objects_is_refused_soon_after_asking(worker, readers, monkeypatch):
    from kvstrata.store import tiering

    # A wait for the caches' leases made long (the worker runs in this process): one taken shows as seconds, where a
    # bound near the real 0.1 s window would fail on a loaded machine
    monkeypatch.setattr(tiering, "RECLAIM_WAIT_S", 3.0)
    with kvstrata.connect(worker.address, timeout=5) as writer:
        start = time.monotonic()
        with pytest.raises(CapacityError):
            writer.set("too-big", np.zeros(33 * MB, dtype=np.uint8))  # larger than the tier: refused at once
        assert time.monotonic() - start < 2.0


def test_the_keeper_stops_with_its_client(worker):
    client = kvstrata.connect(worker.address, timeout=5)
    keeper = client._backend._keeper
    assert keeper is not None and keeper.is_alive()
    client.close()
    keeper.join(2)
    assert not keeper.is_alive()
