"""Clock policy, watermarks, spill + promote, evictable drop, leases pinning, capacity limits."""

from __future__ import annotations

import time

import pytest

from kv_helpers import held_back, quiet, returns_within
from kvstrata.errors import CapacityError, KeyNotFound
from kvstrata.store import ObjectStore
from kvstrata.store.eviction import ClockPolicy

KB = 1024


class _Obj:
    def __init__(self, name, evictable=True):
        self.name = name
        self.referenced = False
        self.evictable = evictable


def test_clock_second_chance_order():
    clock = ClockPolicy()
    objs = {n: _Obj(n) for n in "abcd"}
    for n, o in objs.items():
        clock.add(n, o)
    objs["b"].referenced = True
    objs["c"].evictable = False
    pick = lambda: clock.next_victim(lambda o: o.evictable).name
    assert pick() == "a"
    assert pick() == "d"  # b had its second chance, c is pinned
    assert pick() == "b"
    assert clock.next_victim(lambda o: o.evictable) is None  # only the pinned one is left
    assert len(clock) == 1 and "c" in clock


def test_clock_remove_only_matching_entry():
    clock = ClockPolicy()
    old, new = _Obj("old"), _Obj("new")
    clock.add("k", old)
    clock.add("k", new)
    clock.remove("k", old)  # a stale version must not evict the current one's slot
    assert "k" in clock
    clock.remove("k", new)
    assert "k" not in clock


def _wait(pred, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_watermarks_evict_oldest_unreferenced_down_to_low(make_config):
    s = ObjectStore(make_config(memory=1 << 20, segment=1 << 20, high_watermark=0.9, low_watermark=0.5))
    for i in range(14):  # 14 x 64 KiB = 87.5%: below the high watermark, nothing moves
        s.put(f"k{i}", bytes([i]) * (64 * KB), write_mode="evictable")
    time.sleep(0.1)
    assert s.stats()["evictions"] == 0
    s.get_bytes("k0")  # referenced: gets a second chance
    s.put("k14", bytes(64 * KB), write_mode="evictable")  # 93.75% > 90%: background eviction to 50%
    assert _wait(lambda: s.stats()["tiers"]["memory"]["used"] <= (1 << 20) // 2)
    present = s.exists([f"k{i}" for i in range(15)])
    assert present[0], "k0 was referenced and must survive the first sweep"
    assert present[1:8] == [False] * 7 and all(present[8:])
    assert s.stats()["evictions"] == 7 and s.stats()["spills"] == 0
    s.close()


def test_evictable_dropped_memory_mode_spilled_and_promoted(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    for i in range(8):
        s.put(f"e{i}", bytes([i]) * (100 * KB), write_mode="evictable")
    for i in range(16):
        s.put(f"m{i}", bytes([100 + i]) * (100 * KB))  # 1.6 MiB of MEMORY data in a 1 MiB tier
    st = s.stats()
    assert st["spills"] > 0 and st["tiers"]["disk"]["files"] == st["spills"]
    for i in range(16):  # nothing acknowledged is lost: each comes back from SSD as needed
        assert s.get_bytes(f"m{i}") == bytes([100 + i]) * (100 * KB)
    assert s.stats()["promotions"] > 0
    assert not any(s.exists([f"e{i}" for i in range(8)]))  # evictable data went first, and not to SSD
    with pytest.raises(KeyNotFound):
        s.get_bytes("e0")
    s.close()


def test_leased_object_is_never_evicted(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    s.put("pinned", b"P" * (200 * KB), write_mode="evictable")
    lease = s.acquire("pinned", owner="reader")
    for i in range(20):
        s.put(f"f{i}", bytes(100 * KB), write_mode="evictable")
    assert bytes(s.buffer(lease.location)) == b"P" * (200 * KB)
    assert s.exists(["pinned"]) == [True]
    s.release(lease.lease_id)
    for i in range(20):
        s.put(f"g{i}", bytes(100 * KB), write_mode="evictable")
    assert s.exists(["pinned"]) == [False]  # once released it is an ordinary candidate
    s.close()


def test_no_room_anywhere_rejects_new_write_and_keeps_old(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20, disk=600 * KB))
    written = []
    with pytest.raises(CapacityError):
        for i in range(100):
            s.put(f"m{i}", bytes([i]) * (100 * KB))
            written.append(i)
    assert 10 <= len(written) < 20
    for i in written:
        assert s.get_bytes(f"m{i}") == bytes([i]) * (100 * KB)
    s.close()


def test_memory_mode_without_ssd_is_never_dropped(make_config):
    s = ObjectStore(make_config(memory=1 << 20, segment=1 << 20))
    written = []
    with pytest.raises(CapacityError, match="nothing more can be evicted"):
        for i in range(20):
            s.put(f"m{i}", bytes([i]) * (100 * KB))
            written.append(i)
    assert len(written) == 10
    assert [s.get_bytes(f"m{i}")[:1] for i in written] == [bytes([i]) for i in written]
    s.close()


def test_write_through_copy_lets_eviction_free_dram_without_io(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    for i in range(15):
        s.put(f"w{i}", bytes([i]) * (100 * KB), write_mode="write_through")
    st = s.stats()
    # Their DRAM copies dropped with no write (the SSD copy is current): spills, not evictions (nothing was lost).
    assert st["spills"] > 0 and st["evictions"] == 0 and st["tiers"]["disk"]["files"] == 15
    assert st["tiers"]["disk"]["used"] == sum(s._disk.file_bytes(f"w{i}", 100 * KB) for i in range(15))
    assert s.get_bytes("w0") == bytes([0]) * (100 * KB)
    s.close()


def test_spill_and_promotion_io_do_not_block_other_readers(tmp_path, make_config, monkeypatch):
    import threading

    # The background pass stopped: it would spill at the high watermark itself (9 x 100 KiB + "hot" is past it)
    s = quiet(ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20)))
    s.put("hot", b"h" * 1000, write_mode="evictable")
    lease = s.acquire("hot", owner="r")  # keeps "hot" resident
    for i in range(9):
        s.put(f"m{i}", bytes([i]) * (100 * KB))
    # The file I/O waits for the test: a reader served meanwhile did not wait for it (one that did fails here)
    writing, write_go = held_back(monkeypatch, s._disk, "write_temp")
    t = threading.Thread(target=lambda: s.put("m9", bytes(200 * KB)))  # must spill: a held-back write
    t.start()
    assert writing.wait(5)
    got = returns_within(lambda: s.get_bytes("hot"), what="a reader beside a spill's file write")
    assert got == b"h" * 1000
    write_go.set()
    t.join()
    assert s.stats()["spills"] >= 1
    reading, read_go = held_back(monkeypatch, s._disk, "read_into")
    t = threading.Thread(target=lambda: s.get_bytes("m0"))  # spilled: a held-back promotion
    t.start()
    assert reading.wait(5)
    got = returns_within(lambda: (s.exists(["hot"]), s.get_bytes("hot")), what="a reader beside a promotion")
    assert got == ([True], b"h" * 1000)
    read_go.set()
    t.join()
    assert s.stats()["promotions"] >= 1
    s.release(lease.lease_id)
    s.close()


def test_a_write_waits_for_the_write_back_flush_that_holds_the_room_it_needs(tmp_path, make_config, monkeypatch):
    """The only objects that could make room are being flushed to SSD (pinned while their files are written, the
    lock released): the write waits for the flush and then drops them, instead of failing with CapacityError."""
    import threading

    # The background pass stopped: each write-back put wakes it, and it could flush them all before the test's own
    # flush below starts (nothing would be left to wait for)
    s = quiet(ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20)))
    for i in range(9):
        s.put(f"wb{i}", bytes([i]) * (100 * KB), write_mode="write_back")  # dirty: a spill or a flush must write them
    disk = s._disk
    slow_write = disk.write_temp
    writing = threading.Event()

    def write_temp(*a, **kw):
        writing.set()
        time.sleep(0.02)
        return slow_write(*a, **kw)

    monkeypatch.setattr(disk, "write_temp", write_temp)
    flusher = threading.Thread(target=s._flush_pass)  # what the background write-back thread does
    flusher.start()
    assert writing.wait(5)
    s.put("big", b"B" * (500 * KB))  # needs five of them gone: all pinned by the flush now
    flusher.join()
    assert s.get_bytes("big") == b"B" * (500 * KB)
    assert all(s.get_bytes(f"wb{i}") == bytes([i]) * (100 * KB) for i in range(9))  # flushed, dropped, read back
    s.close()


def test_spilled_object_read_from_ssd_when_dram_is_all_leased(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    s.put("cold", b"C" * (300 * KB))
    leases = []
    for i in range(9):  # fill DRAM with leased objects: "cold" is spilled, nothing else may go
        s.put(f"h{i}", bytes([i]) * (100 * KB))
        leases.append(s.acquire(f"h{i}", owner="pin"))
    assert s.stats()["spills"] == 1
    assert s.get_bytes("cold") == b"C" * (300 * KB)  # served straight from SSD
    assert s.read("cold", 1000, 10) == b"C" * 10
    assert s.stats()["promotions"] == 0
    with pytest.raises(CapacityError):
        s.acquire("cold", owner=1)  # a zero-copy lease needs DRAM
    s.release_owner("pin")
    lease = s.acquire("cold", owner=1)
    assert bytes(s.buffer(lease.location)) == b"C" * (300 * KB) and s.stats()["promotions"] == 1
    s.release(lease.lease_id)
    s.close()


def test_failing_ssd_keeps_data_in_dram_and_refuses_new_writes(tmp_path, make_config, monkeypatch, caplog):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    for i in range(9):
        s.put(f"m{i}", bytes([i]) * (100 * KB))

    def broken(*a, **kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(s._disk, "write_temp", broken)
    with pytest.raises(CapacityError):
        s.put("more", bytes(300 * KB))
    assert "spilling" in caplog.text
    assert [s.get_bytes(f"m{i}")[:1] for i in range(9)] == [bytes([i]) for i in range(9)]
    monkeypatch.undo()
    s.put("more", bytes(300 * KB))  # the SSD works again: spilling resumes
    assert s.stats()["spills"] >= 1 and s.stats()["tiers"]["disk"]["reserved"] == 0
    s.close()


def test_moves_between_tiers_are_logged_each_and_summed_up(tmp_path, make_config, caplog, monkeypatch):
    import logging

    from kvstrata.store import tiering

    monkeypatch.setattr(tiering, "MOVES_REPORT_S", 0.0)  # a summary at every move
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20))
    try:
        with caplog.at_level(logging.DEBUG, logger="kvstrata.store"):
            for i in range(12):  # 1.2 MiB into a 1 MiB tier: the oldest leave DRAM
                s.put(f"mem{i}", bytes([i]) * (100 * KB), write_mode="memory" if i % 2 else "evictable")
            assert _wait(lambda: s.stats()["spills"] > 0 and s.stats()["evictions"] > 0)
            assert s.get_bytes("mem1") == bytes([1]) * (100 * KB)  # spilled first, promoted back
        text = caplog.text
        assert "evictable dropped 'mem0' (102400 bytes)" in text
        assert "spilled to SSD 'mem1' (102400 bytes)" in text
        assert "promoted back 'mem1' (102400 bytes)" in text
        summaries = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert any("evictable dropped (100.0 KiB)" in m and m.startswith("memory tier ") for m in summaries)
    finally:
        s.close()
