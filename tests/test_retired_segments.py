"""Clients let go of the segments the worker retires (kvstrata.store.tiers.memory: emptied for a value larger than a
segment, their pages given back to the kernel). A client that page-locked one with CUDA would keep its pages from
the kernel for as long as it lives, so the worker tells every client it sent a segment to, with its next reply; the
client unregisters and unmaps it once none of its copies can read it any more (kvstrata.client.device.Registrations:
the calls that copy from placement hints, in flight when it heard, have returned and the copy streams ran past them).
"""

from __future__ import annotations

import numpy as np
import pytest

import kvstrata
from kv_helpers import worker_fixtures
from kvstrata.client import device

MB = 1 << 20

worker, kv = worker_fixtures("retired-segments-worker", memory=8 * MB, segment=2 * MB, modes=("unix",))


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def fake_cuda(monkeypatch):
    """Registrations' CUDA calls recorded, not made; the copy streams' events under the test's control."""
    calls: dict[str, list] = {"register": [], "unregister": [], "events": []}

    def register(addr: int, nbytes: int) -> bool:
        calls["register"].append(addr)
        return True

    def events() -> list:
        calls["events"].append(e := _Event())
        return [e]

    monkeypatch.setattr(device, "register_segment", register)
    monkeypatch.setattr(device, "unregister_segment", calls["unregister"].append)
    monkeypatch.setattr(device, "_copy_stream_events", events)
    return calls


def _registered(regs: device.Registrations, *indices: int) -> None:
    regs.ensure(indices, lambda i: 4096 * (i + 1), lambda i: 4096)


def test_a_retired_segment_waits_for_the_calls_that_could_read_it_then_for_their_copies(fake_cuda):
    regs = device.Registrations()
    _registered(regs, 0, 1)
    in_flight = regs.enter()  # a cold read that may have read a placement hint into segment 1
    let_go: list[int] = []
    regs.retire([1], let_go.append)
    assert fake_cuda["unregister"] == [] and let_go == [] and regs.retiring == 1
    later = regs.enter()  # began after the retirement was heard of: the segment is out of its reach
    regs.exit(in_flight)
    # the call returned, but its copies may still run on the copy streams: an event recorded after it holds the rest
    assert len(fake_cuda["events"]) == 1 and fake_cuda["unregister"] == [] and 1 in regs.bases
    regs.exit(later)
    assert fake_cuda["unregister"] == [] and let_go == []
    fake_cuda["events"][0].done = True
    _registered(regs, 0)  # any later call lets it go
    assert fake_cuda["unregister"] == [8192] and let_go == [1] and regs.retiring == 0
    assert regs.bases == {0: 4096}
    _registered(regs, 1)  # a retired segment is never registered again (a stale hint's copy reads it pageable)
    assert fake_cuda["register"] == [4096, 8192] and 1 not in regs.bases
    regs.undo()
    assert fake_cuda["unregister"] == [8192, 4096]


def test_with_no_call_in_flight_a_retired_segment_goes_at_once(fake_cuda, monkeypatch):
    monkeypatch.setattr(device, "_copy_stream_events", lambda: [])  # no copy stream (nothing copied yet)
    regs = device.Registrations()
    _registered(regs, 0, 1, 2)
    let_go: list[int] = []
    regs.retire([0, 2], let_go.append)
    assert fake_cuda["unregister"] == [4096, 12288] and let_go == [0, 2] and regs.retiring == 0
    regs.retire([5], None)  # never registered here: nothing to undo, no hook
    assert fake_cuda["unregister"] == [4096, 12288] and regs.retiring == 0


def test_retire_never_waits_for_the_lock_a_registration_holds(fake_cuda, monkeypatch):
    # A registration holds the lock while it asks the worker for a segment, under the connection's lock; the
    # connection hears of retirements under that same lock: retire() must not wait, or the two threads deadlock.
    monkeypatch.setattr(device, "_copy_stream_events", lambda: [])
    regs = device.Registrations()
    _registered(regs, 0)
    let_go: list[int] = []
    with regs._lock:
        regs.retire([0], let_go.append)
        assert let_go == [] and regs.retiring == 1
    regs.reap()
    assert let_go == [0] and fake_cuda["unregister"] == [4096]


def test_the_worker_tells_its_clients_and_they_unmap_what_it_retired(kv, worker):
    keys = [f"small/{i}" for i in range(4)]
    for i, key in enumerate(keys):  # one per 2 MiB segment: the 8 MiB tier is fully mapped
        kv.set(key, np.full(2 * MB - 64 * 1024, i + 1, dtype=np.uint8), write_mode="evictable")
    with kvstrata.connect(worker.address, timeout=5) as other:
        assert len(other._backend._segments) == 4  # every segment there is, mapped at the handshake
        before = len(worker._store.retired_segments)
        kv.set("big", np.full(5 * MB, 9, dtype=np.uint8))  # three small segments retired for its own segment
        retired = set(worker._store.retired_segments[before:])
        assert len(retired) == 3
        # the writer was told with the set's reply; the other client with its next one
        assert not retired & set(kv._backend._segments) and not retired & set(kv._backend.segment_limits)
        assert retired <= set(other._backend._segments)
        other.exists(["big"])
        assert not retired & set(other._backend._segments) and not retired & set(other._backend.segment_limits)
        assert other._registrations.retiring == 0
        assert not other._backend.maps(min(retired), 0, 1)  # no placement hint may point there any more
        assert np.array_equal(np.frombuffer(other.get("big"), dtype=np.uint8), np.full(5 * MB, 9, dtype=np.uint8))
    for session in list(worker._sessions.values()):
        assert not retired & session.sent_segments


def test_a_client_connecting_after_a_retirement_is_told_of_none(kv, worker):
    kv.delete(["big", *(f"small/{i}" for i in range(4))])
    with kvstrata.connect(worker.address, timeout=5) as late:
        told: list = []
        late._backend.watch_retired_segments(lambda indices, let_go: told.append(indices))
        late.exists(["nothing"])
        assert told == []  # the retired segments were never sent to it


def test_an_embedded_client_hears_of_the_segments_its_store_retires(tmp_path):
    with kvstrata.connect(embedded=True, memory_bytes=8 * MB, segment_bytes=2 * MB) as kv:
        assert len(kv.store._retire_listeners) == 1
        for i in range(4):
            kv.set(f"small/{i}", np.full(2 * MB - 64 * 1024, i + 1, dtype=np.uint8), write_mode="evictable")
        kv.set("big", np.full(5 * MB, 9, dtype=np.uint8))
        assert len(kv.store.retired_segments) == 3
        assert kv._registrations._retired == set(kv.store.retired_segments) and kv._registrations.retiring == 0
        assert np.array_equal(np.frombuffer(kv.get("big"), dtype=np.uint8), np.full(5 * MB, 9, dtype=np.uint8))
    assert kv.store._retire_listeners == []  # a closed client stops listening


def test_a_malformed_retired_field_is_ignored_with_a_warning(kv, caplog):
    backend = kv._backend
    mapped = set(backend._segments)
    backend._segments_retired("not a list")
    backend._segments_retired([1, "x"])
    assert set(backend._segments) == mapped
    assert "retired segments" in caplog.text
