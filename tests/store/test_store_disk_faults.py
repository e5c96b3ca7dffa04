"""SSD tier under faults: expiry changed during a flush, reservations when writes fail, unlink/commit/fsync errors,
close racing writers, damaged headers met by expire, a startup scan that fails. Faults are monkeypatched I/O."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest

from kvstrata.errors import CapacityError, ClosedError, KeyNotFound, ServerError
from kvstrata.store import ObjectStore, WriteMode
from kvstrata.store.tiers import disk as disk_mod
from kvstrata.store.tiers.disk import DiskTier, file_name

KB = 1 << 10


def _quiet(s: ObjectStore) -> ObjectStore:
    """Stop the background pass (write-back, eviction): the test drives every flush and spill itself."""
    s._stop.set()
    s._wake.set()
    s._thread.join()
    return s


def _files(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path / "ssd") if n != ".lock")


def _assert_all_back(s: ObjectStore) -> None:
    """Nothing is pinned, held or reserved, and no temp file is left."""
    with s._lock:
        assert not [k for k, e in s._objects.items() if e.leases or e.flushing]
        holds = sum(e.disk_hold for e in s._objects.values())
        assert s._disk.stats()["reserved"] == holds
    assert not [n for n in os.listdir(s._disk.directory) if n.endswith(".tmp")]


def _spill(s: ObjectStore, *keys: str) -> None:
    """Spill (or drop) ``keys`` now, as a large value's clearing of their segment would."""
    with s._lock:
        entries = [s._objects[k] for k in keys]
        s._make_room(sum(e.size for e in entries), iter(entries))


# -- 1. a deadline changed while the file is written ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["flush", "spill"])
@pytest.mark.parametrize(("ttl", "new_ttl"), [(100, None), (None, 100)])
def test_an_expiry_changed_while_the_file_is_written_is_what_the_file_records(
    tmp_path, make_config, monkeypatch, how, ttl, new_ttl
):
    cfg = make_config(tmp_path)
    s = _quiet(ObjectStore(cfg))
    s.put("wb", b"w" * (10 * KB), ttl=ttl, write_mode="write_back")
    real = s._disk.write_temp
    changed = []

    def write_temp(key, data, mode, expires_at=0.0):
        if not changed:  # the file's header is made with the old deadline; expire() comes in meanwhile
            changed.append(s.expire(["wb"], new_ttl))
        return real(key, data, mode, expires_at)

    monkeypatch.setattr(s._disk, "write_temp", write_temp)
    if how == "flush":
        s.flush()
    else:
        _spill(s, "wb")
    assert changed == [[True]] and s.stats()["dirty"] == 0
    assert (s._disk.index["wb"].expires_at > 0) == (new_ttl is not None)
    s.close()
    s2 = ObjectStore(cfg)  # the file's header, read back
    assert (s2._disk.index["wb"].expires_at > 0) == (new_ttl is not None)
    assert s2.get_bytes("wb") == b"w" * (10 * KB)
    s2.close()


# -- 2. a spill and a flush of one write-back object both failing ----------------------------------------------------
def test_a_spill_and_a_flush_of_one_write_back_object_failing_leak_no_ssd_reservation(
    tmp_path, make_config, monkeypatch
):
    s = _quiet(ObjectStore(make_config(tmp_path)))
    s.put("wb", b"b" * (200 * KB), write_mode="write_back")
    s.put("other", b"o" * (10 * KB), write_mode="write_back")
    hold = s._objects["wb"].disk_hold
    real = s._disk.write_temp
    calls = []

    def write_temp(key, data, mode, expires_at=0.0):
        calls.append(key)
        if key == "wb":
            if len(calls) == 1:  # the spill's write: the write-back flush runs meanwhile, and fails too
                s._flush_pass()
            raise CapacityError("SSD tier full: simulated ENOSPC")
        return real(key, data, mode, expires_at)

    monkeypatch.setattr(s._disk, "write_temp", write_temp)
    _spill(s, "wb")
    assert calls.count("wb") == 1  # the flush left it to the spill writing it
    assert s._objects["wb"].disk_hold == hold and s._disk.stats()["reserved"] == hold  # one hold, not two
    _assert_all_back(s)
    s._flush_pass()  # and again, a flush alone failing
    assert s._disk.stats()["reserved"] == hold
    monkeypatch.undo()
    s.flush()
    assert s._disk.stats()["reserved"] == 0 and s.get_bytes("wb") == b"b" * (200 * KB)
    s.delete(["wb", "other"])
    st = s._disk.stats()
    assert (st["reserved"], st["used"], st["files"]) == (0, 0, 0)
    s.close()


def test_failed_writes_of_every_kind_leave_nothing_reserved_once_all_is_deleted(tmp_path, make_config, monkeypatch):
    s = _quiet(ObjectStore(make_config(tmp_path, memory=2 << 20)))
    keys = []
    for i in range(6):
        for mode in ("write_back", "memory", "write_through"):
            keys.append(f"{mode}{i}")
            s.put(keys[-1], bytes([i]) * (50 * KB), write_mode=mode)
    real = s._disk.write_temp
    n = [0]

    def flaky(key, data, mode, expires_at=0.0):
        n[0] += 1
        if n[0] % 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(key, data, mode, expires_at)

    monkeypatch.setattr(s._disk, "write_temp", flaky)
    for _ in range(3):
        s._flush_pass()
        _spill(s, *[k for k in keys if s._objects[k].loc is not None])
    _assert_all_back(s)
    monkeypatch.undo()
    assert [s.get_bytes(k)[:1] for k in keys] == [bytes([i]) for i in range(6) for _ in range(3)]
    s.delete(keys)
    st = s._disk.stats()
    assert (st["reserved"], st["used"], st["files"]) == (0, 0, 0)
    s.close()


# -- 3. a file that cannot be deleted ------------------------------------------------------------------------------
def _failing_unlink(monkeypatch, key: str, err: int = errno.EROFS) -> list[str]:
    real, failed = os.unlink, []

    def unlink(path, *a, **kw):
        if str(path).endswith(file_name(key)):
            failed.append(path)
            raise OSError(err, os.strerror(err), path)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    return failed


def test_a_delete_whose_file_cannot_be_unlinked_keeps_the_key_and_names_it(tmp_path, make_config, monkeypatch):
    cfg = make_config(tmp_path)
    s = ObjectStore(cfg)
    s.put("a", b"secret v1", write_mode="write_through")
    s.put("b", b"other", write_mode="write_through")
    s.incref(["a"])
    disk_before = s._disk.stats()
    failed = _failing_unlink(monkeypatch, "a")
    with pytest.raises(ServerError, match="'a'") as info:
        s.delete(["a", "b"])
    assert "Read-only" in str(info.value) and failed
    assert s.exists(["a", "b"]) == [True, False]  # the others go; the one kept is unchanged
    assert s.get_bytes("a") == b"secret v1" and s.refcount("a") == 1
    assert s._disk.stats()["files"] == 1 and s._disk.stats()["used"] < disk_before["used"]
    with pytest.raises(ServerError):
        s.decref(["a"])  # the last reference: a delete, refused the same way
    assert s.refcount("a") == 1 and s.exists(["a"]) == [True]
    s.close()
    s = ObjectStore(cfg)  # still there after a restart, as the store said
    assert s.exists(["a", "b"]) == [True, False]
    monkeypatch.undo()
    assert s.delete(["a"]) == [True]
    s.close()
    s = ObjectStore(cfg)
    assert s.exists(["a"]) == [False] and s._disk.stats()["used"] == 0
    s.close()


@pytest.mark.parametrize("size", [200 * KB, 100])  # a large put, and a small one that would reuse the block
def test_an_overwrite_whose_old_file_cannot_be_unlinked_fails_and_keeps_the_old_version(
    tmp_path, make_config, monkeypatch, size
):
    cfg = make_config(tmp_path)
    s = ObjectStore(cfg)
    s.put("a", b"1" * size, write_mode="write_through")
    used = s.stats()["tiers"]["memory"]["used"]
    _failing_unlink(monkeypatch, "a", errno.EIO)
    for mode in ("memory", "write_back", "evictable"):
        with pytest.raises(ServerError, match="Input/output error"):
            s.put("a", b"2" * size, write_mode=mode)
        assert isinstance(s.put_many([("a", b"3" * size)], write_mode=mode)[0], ServerError)  # (a per-key result)
    assert s.seal_many(["a"], owner="w")[0] is not None  # nothing to seal: a KeyNotFound
    s.buffer(s.create("a", size, owner="w"))[:] = b"4" * size
    assert isinstance(s.seal_many(["a"], owner="w")[0], ServerError)
    st = s.stats()
    assert st["tiers"]["memory"]["used"] == used and st["objects"] == 1 and st["tiers"]["disk"]["reserved"] == 0
    assert s.get_bytes("a") == b"1" * size and s._objects["a"].on_disk
    s.close()
    s = ObjectStore(cfg)
    assert s.get_bytes("a") == b"1" * size
    monkeypatch.undo()
    s.put("a", b"5" * size)  # the file goes now: a memory version does not outlive the store
    s.close()
    s = ObjectStore(cfg)
    assert s.exists(["a"]) == [False]
    s.close()


def test_an_expired_key_whose_file_cannot_be_unlinked_is_a_miss_and_gone_after_restart(
    tmp_path, make_config, monkeypatch, caplog
):
    cfg = make_config(tmp_path)
    s = ObjectStore(cfg)
    s.put("t", b"t" * 100, write_mode="write_through", ttl=0.05)
    _failing_unlink(monkeypatch, "t")
    import time

    time.sleep(0.1)
    with pytest.raises(KeyNotFound):
        s.get_bytes("t")
    assert "its file stays" in caplog.text
    assert s._disk.stats()["files"] == 1  # still indexed: no file outside the index
    monkeypatch.undo()
    s.close()
    s = ObjectStore(cfg)
    assert s.exists(["t"]) == [False] and s._disk.stats()["files"] == 0  # its header's deadline passed
    s.close()


# -- 4. commits that fail under the lock ---------------------------------------------------------------------------
def test_a_failed_commit_in_a_spill_unpins_its_victim_and_the_others_are_spilled(tmp_path, make_config, monkeypatch):
    s = _quiet(ObjectStore(make_config(tmp_path, memory=2 << 20)))
    keys = [f"m{i}" for i in range(8)]
    for i, k in enumerate(keys):
        s.put(k, bytes([i]) * (100 * KB))
    real, calls = os.replace, []

    def replace(src, dst, *a, **kw):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error", src)
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    _spill(s, *keys)
    monkeypatch.undo()
    resident = [k for k in keys if s._objects[k].loc is not None]
    assert resident == ["m1"] and s.stats()["spills"] == 7  # the one whose commit failed stays in DRAM
    _assert_all_back(s)
    assert s._disk.stats()["reserved"] == 0 and len(_files(tmp_path)) == 7
    assert [s.get_bytes(k)[:1] for k in keys] == [bytes([i]) for i in range(8)]
    _spill(s, "m1")  # evictable again
    assert s._objects["m1"].loc is None
    s.delete(keys)
    assert s.stats()["tiers"]["memory"]["used"] == 0
    assert s._disk.stats() | {"capacity": 0} == {"used": 0, "capacity": 0, "files": 0, "reserved": 0, "corrupt": 0}
    s.close()


def test_a_failed_commit_of_a_write_back_flush_keeps_it_dirty_and_held(tmp_path, make_config, monkeypatch):
    s = _quiet(ObjectStore(make_config(tmp_path)))
    s.put("wb", b"w" * (50 * KB), write_mode="write_back")
    hold = s._objects["wb"].disk_hold
    real = os.replace

    def replace(src, dst, *a, **kw):
        raise OSError(errno.EIO, "Input/output error", src)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ServerError, match=r"1 write-back objects could not be written.*Input/output error"):
        s.flush()
    monkeypatch.setattr(os, "replace", real)
    assert s.stats()["dirty"] == 1 and s._objects["wb"].disk_hold == hold
    _assert_all_back(s)
    s.flush()
    assert s.stats()["dirty"] == 0 and s._disk.stats()["reserved"] == 0
    s.close()


@pytest.mark.parametrize("fault", ["fsync_dir", "replace"])
def test_a_failed_write_through_commit_fails_the_put_and_keeps_the_old_version(
    tmp_path, make_config, monkeypatch, fault
):
    cfg = make_config(tmp_path, memory=2 << 20)
    s = _quiet(ObjectStore(cfg))
    s.put("k", b"old" * 100_000, write_mode="write_through")
    mem, disk = s.stats()["tiers"]["memory"]["used"], s._disk.stats()
    if fault == "fsync_dir":  # after the rename: the new file is in place, and must be taken back
        real = disk_mod._fsync_dir

        def fsync_dir(path):
            monkeypatch.setattr(disk_mod, "_fsync_dir", real)
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(disk_mod, "_fsync_dir", fsync_dir)
    else:
        real = os.replace

        def replace(src, dst, *a, **kw):
            monkeypatch.setattr(os, "replace", real)
            raise OSError(errno.EIO, "Input/output error", src)

        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ServerError, match="Input/output error"):
        s.put("k", b"NEW" * 101_000, write_mode="write_through")
    assert s.stats()["tiers"]["memory"]["used"] == mem and s._disk.stats() == disk
    assert s.get_bytes("k") == b"old" * 100_000
    _spill(s, "k")  # out of DRAM: read back from its file, which must still be the old version's
    assert s._objects["k"].loc is None
    assert s.get_bytes("k") == b"old" * 100_000 and s.stats()["corrupt"] == 0
    assert not [n for n in _files(tmp_path) if n.endswith(".tmp")]
    s.close()
    s = ObjectStore(cfg)
    assert s.get_bytes("k") == b"old" * 100_000
    s.close()


def test_a_file_lost_to_a_second_commit_failure_is_written_again_from_dram(tmp_path, make_config, monkeypatch):
    """The folder's fsync fails after the rename, and putting the older file back fails too: that file is gone; the
    older version, resident, stays and is owed to SSD again (written by the next flush)."""
    cfg = make_config(tmp_path)
    s = _quiet(ObjectStore(cfg))
    s.put("k", b"old" * 1000, write_mode="write_through")
    real_replace, calls = os.replace, []

    def fsync_dir(path):
        raise OSError(errno.EIO, "Input/output error")

    def replace(src, dst, *a, **kw):
        calls.append(src)
        if len(calls) == 2:  # the second rename: the older file back into place
            raise OSError(errno.EIO, "Input/output error", src)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(disk_mod, "_fsync_dir", fsync_dir)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(ServerError):
        s.put("k", b"NEW" * 1000, write_mode="write_through")
    monkeypatch.undo()
    assert len(calls) == 2
    e = s._objects["k"]
    assert not e.on_disk and e.dirty and s.get_bytes("k") == b"old" * 1000  # kept, owed to SSD again
    assert _files(tmp_path) == [] and s._disk.stats()["used"] == 0  # the unacknowledged new file went too
    s.flush()
    s.close()
    s = ObjectStore(cfg)
    assert s.get_bytes("k") == b"old" * 1000
    s.close()


# -- 5. close racing writers ---------------------------------------------------------------------------------------
def test_writes_once_close_has_begun_are_refused_not_lost(tmp_path, make_config):
    cfg = make_config(tmp_path)
    s = ObjectStore(cfg)
    s.put("before", b"b" * 1000, write_mode="write_back")
    late: list[object] = []
    real_flush = s.flush

    def flush():
        real_flush()
        # a writer that got in right after close's flush: before the fix it was acknowledged, and lost
        for call in (
            lambda: s.put("late", b"l" * 1000, write_mode="write_back"),
            lambda: s.put("late", b"l" * (100 * KB), write_mode="write_back"),
            lambda: s.put_many([("late", b"l")], write_mode="write_back")[0],
            lambda: s.create("late", 10, owner="w"),
        ):
            try:
                late.append(call())
            except ClosedError as exc:
                late.append(exc)

    s.flush = flush
    s.close()
    assert all(isinstance(r, ClosedError) for r in late), late
    assert s.unflushed == 0
    s2 = ObjectStore(cfg)
    assert s2.exists(["before", "late"]) == [True, False]
    s2.close()


def test_a_write_waiting_for_room_when_close_begins_is_refused(tmp_path, make_config, monkeypatch):
    s = ObjectStore(make_config(tmp_path))
    real = s._allocate

    def allocate(size):
        loc = real(size)
        s._closing = True  # close() began while the lock was let go for room
        return loc

    monkeypatch.setattr(s, "_allocate", allocate)
    with pytest.raises(ClosedError):
        s.put("k", b"k" * 100, write_mode="write_back")
    assert s.stats()["tiers"]["memory"]["used"] == 0 and s._disk.stats()["reserved"] == 0
    s._closing = False
    monkeypatch.undo()
    s.close()


def test_close_reports_how_many_write_back_objects_were_lost_and_why(tmp_path, make_config, monkeypatch, caplog):
    s = _quiet(ObjectStore(make_config(tmp_path)))
    for i in range(3):
        s.put(f"wb{i}", b"w" * 1000, write_mode="write_back")

    def broken(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(s._disk, "write_temp", broken)
    with caplog.at_level(logging.ERROR):
        s.close()
    assert s.unflushed == 3
    lines = [r.getMessage() for r in caplog.records if "closing the store" in r.getMessage()]
    assert lines and "3 write-back objects" in lines[0] and "Input/output error" in lines[0]
    assert "SSD tier full" not in lines[0]


def test_flush_while_writers_keep_adding_writes_what_it_found_and_succeeds(tmp_path, make_config, monkeypatch):
    s = _quiet(ObjectStore(make_config(tmp_path)))
    s.put("wb0", b"w" * 1000, write_mode="write_back")
    real = s._disk.write_temp
    n = [0]

    def write_temp(key, data, mode, expires_at=0.0):
        n[0] += 1  # a writer adds a write-back object while each file is written
        s.put(f"late{n[0]}", b"l" * 1000, write_mode="write_back")
        return real(key, data, mode, expires_at)

    monkeypatch.setattr(s._disk, "write_temp", write_temp)
    s.flush()  # (it used to chase the writer for three passes, then say the SSD tier was full)
    monkeypatch.undo()
    assert not s._objects["wb0"].dirty and s.stats()["dirty"] >= 1
    s.close()
    assert s.unflushed == 0


def test_flush_of_a_full_ssd_tier_says_it_is_full(tmp_path, make_config):
    s = _quiet(ObjectStore(make_config(tmp_path, disk=64 * KB)))
    s.put("wb", b"w" * (40 * KB), write_mode="write_back")
    e = s._objects["wb"]
    with s._lock:  # (as if the room held for it had gone to other files)
        s._disk.unreserve(e.disk_hold)
        e.disk_hold = 0
        s._disk.reserve(60 * KB)
    with pytest.raises(CapacityError, match=r"1 write-back objects could not be written to SSD.*SSD tier full"):
        s.flush()
    with s._lock:
        s._disk.unreserve(60 * KB)
    s.close()


# -- 6. expire on a damaged file -----------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "mode_byte", "missing", "payload_length"])
def test_expire_on_a_damaged_file_is_a_miss_never_a_raw_error_nor_a_resealed_header(
    tmp_path, make_config, damage, caplog
):
    cfg = make_config(tmp_path)
    s = ObjectStore(cfg)
    for k in ("a", "t", "b"):
        s.put(k, k.encode() * 1000, write_mode="write_through")
    _spill(s, "t")  # (so that nothing in DRAM serves it)
    path = tmp_path / "ssd" / file_name("t")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(20)
    elif damage == "mode_byte":
        with open(path, "r+b") as f:  # write_through -> memory: restart would take it for a spill file
            f.seek(6)
            f.write(bytes([0]))
    elif damage == "missing":
        path.unlink()
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    with caplog.at_level(logging.ERROR):
        assert s.expire(["a", "t", "b"], 3600) == [True, False, True]  # the whole batch done
    assert "'t'" in caplog.text
    assert s.exists(["a", "t", "b"]) == [True, False, True]
    assert s.stats()["corrupt"] == 1 and s.stats()["misses"] == 1
    assert not path.exists()  # moved aside (or gone): never sealed with a fresh checksum
    s.close()
    s = ObjectStore(cfg)
    assert s.exists(["a", "t", "b"]) == [True, False, True]
    assert s._disk.index["a"].expires_at > 0
    s.close()


# -- 7. a startup scan that fails ----------------------------------------------------------------------------------
def test_an_undeletable_leftover_temp_file_is_logged_and_the_store_opens(tmp_path, make_config, monkeypatch, caplog):
    cfg = make_config(tmp_path)
    os.makedirs(tmp_path / "ssd")
    (tmp_path / "ssd" / ".999-0.tmp").write_bytes(b"x")
    real = os.unlink

    def unlink(path, *a, **kw):
        if str(path).endswith(".999-0.tmp"):
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    with caplog.at_level(logging.ERROR):
        s = ObjectStore(cfg)
    assert ".999-0.tmp" in caplog.text and "Operation not permitted" in caplog.text
    s.close()


def test_a_store_whose_ssd_scan_fails_releases_the_folder_and_memory(tmp_path, make_config, monkeypatch):
    cfg = make_config(tmp_path)
    closed = []

    def scan(self):
        raise OSError(errno.EIO, "Input/output error")

    from kvstrata.store.tiers import memory as memory_mod

    real_close = memory_mod.MemoryTier.close
    monkeypatch.setattr(memory_mod.MemoryTier, "close", lambda self: closed.append(1) or real_close(self))
    monkeypatch.setattr(DiskTier, "_scan", scan)
    with pytest.raises(OSError, match="Input/output error"):
        ObjectStore(cfg)
    assert closed == [1]  # the DRAM segments went back
    monkeypatch.undo()
    s = ObjectStore(cfg)  # not "in use by another kvstrata store"
    s.put("k", b"v", write_mode="write_through")
    s.close()


def test_concurrent_faulty_writes_keep_the_ssd_accounts_straight(tmp_path, make_config, monkeypatch):
    """A short mixed load (spills, flushes, overwrites, deletes) with every fifth SSD write failing: afterwards the
    index matches the files, used their sizes, reserved the holds; nothing pinned, no temp file."""
    import random

    s = ObjectStore(make_config(tmp_path, memory=2 << 20, flush_interval=0.005))
    real = s._disk.write_temp
    n = [0]
    lock = threading.Lock()

    def flaky(key, data, mode, expires_at=0.0):
        with lock:
            n[0] += 1
            fail = n[0] % 5 == 0
        if fail:  # as a full file system fails a write
            raise disk_mod._storage_error(OSError(errno.ENOSPC, "No space left on device"), key, "ssd")
        return real(key, data, mode, expires_at)

    monkeypatch.setattr(s._disk, "write_temp", flaky)
    keys = [f"k{i}" for i in range(12)]

    def work(seed):
        rnd = random.Random(seed)
        for _ in range(150):
            k = rnd.choice(keys)
            try:
                if rnd.random() < 0.7:
                    mode = rnd.choice(["memory", "write_through", "write_back", "evictable"])
                    s.put(k, bytes([seed]) * rnd.choice([1000, 70 * KB, 150 * KB]), write_mode=mode)
                elif rnd.random() < 0.5:
                    s.delete([k])
                else:
                    s.get_bytes(k)
            except (KeyNotFound, CapacityError, ServerError):
                pass

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    s.flush()
    _quiet(s)
    _assert_all_back(s)
    disk = s._disk
    with s._lock:
        assert {file_name(k) for k in disk.index} == set(n for n in _files(tmp_path) if n.endswith(".kvs"))
        assert disk.used == sum(os.path.getsize(tmp_path / "ssd" / file_name(k)) for k in disk.index)
        assert all(e.on_disk == (k in disk.index) for k, e in s._objects.items())
    s.delete(keys)
    st = disk.stats()
    assert (st["reserved"], st["used"], st["files"]) == (0, 0, 0)
    s.close()


def test_write_back_is_refused_when_the_file_system_has_no_room_for_what_is_held(tmp_path, make_config, monkeypatch):
    """Session 38's crash audit: --disk-size counts only kvstrata's files, so with another program filling the SSD's
    file system, write-back writes were acknowledged, their flushes failed with ENOSPC, and they were lost at shutdown.
    A write-back write now checks the file system has room for every file held for writing."""
    s = _quiet(ObjectStore(make_config(tmp_path)))
    try:
        real = os.statvfs

        def room(free: int):
            def statvfs(path):
                st = real(path)
                return os.statvfs_result((st.f_bsize, 1, st.f_blocks, free, free, *tuple(st)[5:]))

            return statvfs

        monkeypatch.setattr(disk_mod.os, "statvfs", room(disk_mod.FS_MARGIN_BYTES + 250 * KB))
        s.put("wb/0", b"a" * (100 * KB), write_mode=WriteMode.WRITE_BACK)
        s.put("wb/1", b"b" * (100 * KB), write_mode=WriteMode.WRITE_BACK)
        with pytest.raises(CapacityError, match="file system"):
            s.put("wb/2", b"c" * (100 * KB), write_mode=WriteMode.WRITE_BACK)
        assert not s.exists(["wb/2"])[0]
        s.put("mem/0", b"m" * (100 * KB))  # other modes do not hold SSD room
        s.flush()  # what was acknowledged is written
        monkeypatch.setattr(disk_mod.os, "statvfs", real)
        s.put("wb/2", b"c" * (100 * KB), write_mode=WriteMode.WRITE_BACK)  # room again
        assert s.get_bytes("wb/2") == b"c" * (100 * KB) and s._disk.stats()["reserved"] > 0
    finally:
        s.close()


def test_deletes_and_expiries_of_write_through_keys_reach_the_device(tmp_path, make_config, monkeypatch):
    """Session 38's crash audit (code reading): a write-through version's create was fsynced with its folder, its
    delete and its expiry change were not, so after a power loss an acknowledged delete could come back. A failing
    folder sync after the unlink still deletes the key (the file is gone; only its durability is in doubt)."""
    s = _quiet(ObjectStore(make_config(tmp_path)))
    try:
        synced_dirs: list[str] = []
        synced_files: list[int] = []
        real_dir, real_fsync = disk_mod._fsync_dir, disk_mod.os.fsync
        monkeypatch.setattr(disk_mod, "_fsync_dir", lambda path: synced_dirs.append(path) or real_dir(path))
        monkeypatch.setattr(disk_mod.os, "fsync", lambda fd: synced_files.append(fd) or real_fsync(fd))
        s.put("wt", b"w" * KB, write_mode=WriteMode.WRITE_THROUGH)
        s.put("wb", b"b" * KB, write_mode=WriteMode.WRITE_BACK)
        s.flush()
        synced_dirs.clear(), synced_files.clear()
        assert s.expire("wt", 60)
        assert len(synced_files) == 1  # the header's new expiry, on the device
        assert s.delete(["wt"]) == [True]
        assert synced_dirs == [str(s._disk.directory)]  # the unlink, on the device
        assert s.delete(["wb"]) == [True] and len(synced_dirs) == 1  # write-back promises no more than a clean stop

        def failing(path):
            raise OSError(errno.EIO, "folder sync failed")

        s.put("wt2", b"w" * KB, write_mode=WriteMode.WRITE_THROUGH)
        monkeypatch.setattr(disk_mod, "_fsync_dir", failing)
        assert s.delete(["wt2"]) == [True]
        assert not s.exists(["wt2"])[0] and "wt2" not in s._disk.index and _files(tmp_path) == []
    finally:
        s.close()
