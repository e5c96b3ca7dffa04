"""Which segments a value larger than a segment empties, and how: the cheapest to empty (few objects, little to write
to SSD) rather than the one holding the fewest bytes, with the lock let go every few thousand victims, and a victim
replaced meanwhile left alone."""

from __future__ import annotations

import threading
import time

import pytest

from kvstrata.errors import CapacityError
from kvstrata.store import ObjectStore, tiering

KB, MB = 1024, 1 << 20


def _config(make_config, tmp_path=None, **kw):
    # no watermark eviction: only the large value's clearing moves anything
    return make_config(tmp_path, memory=4 * MB, segment=1 * MB, high_watermark=1.0, low_watermark=1.0, **kw)


def test_a_large_value_empties_the_segments_with_few_objects_not_the_one_with_fewest_bytes(make_config):
    """Segment 0 holds 2,000 tiny objects (500 KB), segments 1-3 one object of 900 KB each: emptying two of those
    costs two evictions, emptying segment 0 two thousand (a segment of 240,000 tiny ones held the lock for seconds)."""
    s = ObjectStore(_config(make_config))
    try:
        tiny = [f"tiny/{i}" for i in range(2000)]
        s.put_many([(k, b"t" * 200) for k in tiny], write_mode="evictable")
        for i in range(3):
            s.put(f"large/{i}", bytes([i + 1]) * (900 * KB), write_mode="evictable")
        held = {}
        for e in s._objects.values():
            held.setdefault(e.loc.segment, set()).add(e.key.split("/")[0])
        assert held == {0: {"tiny"}, 1: {"large"}, 2: {"large"}, 3: {"large"}}
        assert s.stats()["tiers"]["memory"]["mapped"] == 4 * MB
        s.put("big", b"B" * (3 * MB // 2), write_mode="evictable")  # a segment of 2 MiB: two emptied
        assert all(s.exists(tiny))  # none of the tiny objects went
        assert sum(s.exists([f"large/{i}" for i in range(3)])) == 1 and s.stats()["evictions"] == 2
        assert s.get_bytes("big") == b"B" * (3 * MB // 2)
    finally:
        s.close()


def test_objects_that_write_nothing_to_ssd_are_cheaper_to_move_than_those_spilled(tmp_path, make_config):
    """Two segments hold one 1 MiB object each in ``memory`` mode (a spill writes it to SSD), two hold 16 objects with
    a clean SSD copy each (dropped from DRAM without a write): those two are emptied, though all hold 1 MiB."""
    s = ObjectStore(_config(make_config, tmp_path))
    try:
        for i in range(2):
            s.put(f"mem/{i}", b"m" * MB)
            s.put_many([(f"wt/{i}/{j}", bytes([j]) * (64 * KB)) for j in range(16)], write_mode="write_through")
        segments = {k: e.loc.segment for k, e in s._objects.items()}
        assert segments["mem/0"] == 0 and segments["mem/1"] == 2 and set(segments.values()) == {0, 1, 2, 3}
        s.put("big", b"B" * (3 * MB // 2))
        assert s._objects["mem/0"].loc is not None and s._objects["mem/1"].loc is not None
        assert s.stats()["spills"] == 32 and s._disk.stats()["files"] == 32  # no spill file written
        assert s.get_bytes("wt/1/7") == bytes([7]) * (64 * KB)
    finally:
        s.close()


@pytest.mark.parametrize("meanwhile", ["replaced", "leased"])
def test_emptying_segments_lets_the_lock_go_and_leaves_a_victim_changed_meanwhile(make_config, monkeypatch, meanwhile):
    """The victims of a large value's clearing are taken a few at a time, the lock let go between (other calls run
    then): a victim that another thread replaced meanwhile is not dropped (that would delete the new version), nor
    one a reader leased."""
    monkeypatch.setattr(tiering, "EVICT_CHUNK", 2)
    s = ObjectStore(_config(make_config))
    leases = []
    try:
        s.put_many([(f"v{i}", bytes([i]) * (100 * KB)) for i in range(8)], write_mode="evictable")  # segment 0
        for i in (1, 2):  # segments 1 and 2: partly full, leased: never emptied
            s.put(f"pinned{i}", b"p" * (600 * KB), write_mode="evictable")
            leases.append(s.acquire(f"pinned{i}", owner="pin"))
        s.put("large", b"L" * (900 * KB), write_mode="evictable")  # segment 3
        assert {s._objects[k].loc.segment for k in ("v0", "v7", "pinned1", "pinned2", "large")} == {0, 1, 2, 3}
        let_go = []
        real = s._let_others_in

        def other_thread():
            if meanwhile == "replaced":
                s.put("v5", b"NEW" * 100, write_mode="evictable")
            else:
                leases.append(s.acquire("v5", owner="reader"))

        def let_others_in():
            let_go.append(1)
            if len(let_go) == 1:  # another thread's call, while the lock is let go
                t = threading.Thread(target=other_thread)
                t.start()
                t0 = time.monotonic()
                while t.is_alive() and time.monotonic() - t0 < 5:
                    real()
                t.join()
            real()

        monkeypatch.setattr(s, "_let_others_in", let_others_in)
        if meanwhile == "replaced":
            s.put("big", b"B" * (3 * MB // 2), write_mode="evictable")  # empties segments 3 and 0
            assert s.get_bytes("v5") == b"NEW" * 100  # the new version, untouched
            assert s.get_bytes("big") == b"B" * (3 * MB // 2)
        else:
            with pytest.raises(CapacityError):  # segment 0 keeps the leased one: no room after all
                s.put("big", b"B" * (3 * MB // 2), write_mode="evictable")
            assert bytes(s.buffer(leases[-1].location)) == bytes([5]) * (100 * KB) and s.exists(["v5"]) == [True]
        assert len(let_go) >= 3
        assert s.exists([f"v{i}" for i in range(8)]) == [i == 5 for i in range(8)]
        assert s.stats()["evictions"] == 8  # "large" and v0..v7 but v5
    finally:
        for lease in leases:
            s.release(lease.lease_id)
        s.close()


def test_background_eviction_lets_the_lock_go_every_few_victims(make_config, monkeypatch):
    monkeypatch.setattr(tiering, "EVICT_CHUNK", 100)
    s = ObjectStore(make_config(memory=4 * MB, segment=1 * MB, high_watermark=0.9, low_watermark=0.1))
    try:
        let_go = []
        real = s._let_others_in
        monkeypatch.setattr(s, "_let_others_in", lambda: let_go.append(1) or real())
        with s._lock:
            s._high = s._mem.capacity  # (no background pass while filling)
        s.put_many([(f"k{i}", b"x" * 4000) for i in range(950)], write_mode="evictable")
        with s._lock:
            s._high = int(0.9 * s._mem.capacity)
        s._evict_to_low()
        assert s.stats()["evictions"] >= 700 and len(let_go) >= 7
    finally:
        s.close()


def test_victims_spilled_a_few_per_hold_of_the_lock_all_read_back(tmp_path, make_config, monkeypatch):
    monkeypatch.setattr(tiering, "EVICT_CHUNK", 3)
    s = ObjectStore(_config(make_config, tmp_path))
    try:
        modes = ["memory", "write_back", "write_through", "evictable"]
        keys = [(f"k{i}", modes[i % 4]) for i in range(36)]
        for i, (k, mode) in enumerate(keys):
            s.put(k, bytes([i]) * (100 * KB), write_mode=mode)
        s.put("big", b"B" * (3 * MB // 2))
        assert s.get_bytes("big") == b"B" * (3 * MB // 2)
        for i, (k, mode) in enumerate(keys):
            if mode != "evictable" or s.exists([k])[0]:
                assert s.get_bytes(k) == bytes([i]) * (100 * KB)
        with s._lock:
            assert not [e.key for e in s._objects.values() if e.leases or e.flushing]
    finally:
        s.close()


def test_objects_that_come_or_go_while_the_scan_lets_the_lock_go_are_handled(make_config, monkeypatch):
    """The resident objects are sorted by segment a few at a time, the lock let go between: a segment that got an
    object meanwhile (never seen by the scan) is not emptied, one that lost its object still counts as empty."""
    monkeypatch.setattr(tiering, "SCAN_CHUNK", 4)
    s = ObjectStore(_config(make_config))
    try:
        s.put_many([(f"a{i}", bytes([i]) * (100 * KB)) for i in range(8)], write_mode="evictable")  # segment 0
        for k in "bcd":  # segments 1-3
            s.put(k, k.encode() * (900 * KB), write_mode="evictable")
        assert [s._objects[k].loc.segment for k in "bcd"] == [1, 2, 3]
        real = s._let_others_in
        let_go = []

        def let_others_in():
            let_go.append(1)
            if len(let_go) == 1:
                t = threading.Thread(target=lambda: (s.delete(["b"]), s.put("e", b"e" * 1000, write_mode="evictable")))
                t.start()
                while t.is_alive():
                    real()
                t.join()
            real()

        monkeypatch.setattr(s, "_let_others_in", let_others_in)
        s.put("big", b"B" * (3 * MB // 2), write_mode="evictable")
        assert len(let_go) >= 3 and s.get_bytes("e") == b"e" * 1000  # (where it landed was not emptied)
        assert s.get_bytes("big") == b"B" * (3 * MB // 2)
        assert s.stats()["evictions"] == 1  # segment 1 (emptied by the delete) and one of the others
        assert all(s.exists([f"a{i}" for i in range(8)]))
    finally:
        s.close()


def test_an_empty_segment_is_the_cheapest_to_empty(make_config):
    s = ObjectStore(_config(make_config))
    try:
        for k in "abcd":  # one per segment
            s.put(k, k.encode() * (900 * KB), write_mode="evictable")
        s.delete(["a"])  # segment 0 empty: alone not enough for a 2 MiB segment, so nothing is retired yet
        s.put("big", b"B" * (3 * MB // 2), write_mode="evictable")
        assert s.stats()["evictions"] == 1 and s.get_bytes("big") == b"B" * (3 * MB // 2)
    finally:
        s.close()
