"""Small gets answered from shared memory without a round trip, and never stale."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest

import kvstrata
from kvstrata.client import local_reads
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
    """The worker's request count once it stopped moving: a one-way message a client sent earlier (a lease given
    back, say) is counted when the worker reads it, which a loaded machine can put after the client's next call."""
    last = w.counters["requests"]
    since = time.monotonic()
    deadline = since + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.005)
        now = w.counters["requests"]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.03:
            break
    return last


def test_repeated_gets_skip_the_worker(worker):
    with kvstrata.connect(worker.address) as kv:
        kv.set("hot", b"v" * 4096)
        assert kv.get("hot") == b"v" * 4096  # leases it
        before = requests(worker)
        for _ in range(200):
            assert kv.get("hot") == b"v" * 4096
        assert requests(worker) == before
        assert kv._backend._local.hits >= 200


def test_a_worker_whose_table_has_another_slot_count_is_asked_every_time(worker, monkeypatch):
    """A client never indexes a table laid out otherwise (another kvstrata version's worker): no local reads."""
    import kvstrata.server.worker as worker_module

    monkeypatch.setattr(worker_module, "SLOTS", local_reads.SLOTS // 16)  # what this worker's hello now says
    with kvstrata.connect(worker.address) as kv:
        assert kv._backend._local is None
        kv.set("hot", b"v" * 4096)
        before = requests(worker)
        for _ in range(5):
            assert kv.get("hot") == b"v" * 4096
        assert requests(worker) >= before + 5


def test_a_pipelined_reply_waiting_on_the_socket_does_not_turn_the_cache_off(worker):
    # A cached read checks that the worker is there by the socket not being readable (EOF); a reply to an
    # earlier pipelined request, already in, makes it readable too, and must not send the read to the worker
    # (a batched device read asks for its cold keys, then looks up the next stage's while that answer comes).
    import select

    with kvstrata.connect(worker.address) as kv:
        kv.set("hot", b"v" * 4096)
        assert kv.get("hot") == b"v" * 4096  # leases it
        backend = kv._backend
        tag = backend.send_tagged({"op": "ping"})
        assert select.select([backend._conn.fileno()], [], [], 5)[0]  # the reply is in, not read yet
        before = requests(worker)
        assert kv.get("hot") == b"v" * 4096
        assert requests(worker) == before  # the ping's alone
        backend.tagged_reply(tag)
        assert kv.get("hot") == b"v" * 4096
        assert requests(worker) == before


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
        kv.set("other", b"x")  # another key changed: the kept leases stay good
        before = requests(worker)
        assert kv.get("n255") == bytes([255 % 256]) * 100  # the last one kept (the cache was full after it)
        assert requests(worker) == before and len(local) == local.max_entries
        kv.delete([f"n{i}" for i in range(300)])  # theirs changed: every kept lease goes back with the next message
        kv.exists("other")
        assert len(local) == 0 and worker.store.stats()["leases"] == 0
        kv.mset({f"b{i}": b"b" * 60_000 for i in range(100)})
        for i in range(100):
            kv.get(f"b{i}")
        assert len(local) * 60_000 <= local.max_bytes < (len(local) + 1) * 60_000


def test_writes_to_other_keys_keep_the_entries(worker):
    """A node that stores new objects all the time keeps its readers' entries: only a key's own changes
    (or one of a key sharing its counter) send its reader back to the worker."""
    with kvstrata.connect(worker.address) as reader, kvstrata.connect(worker.address) as writer:
        writer.set("hot", b"h" * 1000)
        assert reader.get("hot") == b"h" * 1000  # leases it
        writer.mset({f"new/{i}": b"n" * 100 for i in range(50)})
        writer.delete(["new/0", "new/1"])
        writer.expire(["new/2"], 30)
        with writer.create("new/obj", 10) as buf:
            buf.write(b"0123456789")
        before = requests(worker)
        for _ in range(20):
            assert reader.get("hot") == b"h" * 1000
        assert requests(worker) == before
        slot = worker.validity.slot_of("hot")
        twin = next(f"twin/{i}" for i in range(1_000_000) if worker.validity.slot_of(f"twin/{i}") == slot)
        writer.set(twin, b"t")  # same counter as "hot": one more round trip, never a wrong answer
        before = requests(worker)
        assert reader.get("hot") == b"h" * 1000
        assert requests(worker) == before + 1
        assert reader.get("hot") == b"h" * 1000
        assert requests(worker) == before + 1  # kept again
        writer.set("hot", b"H" * 1000)
        assert reader.get("hot") == b"H" * 1000


def test_entries_checked_against_their_counters():
    """LocalReads on a table of its own: the generation, then the slots (as kvstrata.server.validity lays them)."""
    from kvstrata.memory.shm import SharedSegment
    from kvstrata.server.validity import SLOTS_OFFSET, TABLE_BYTES, Validity

    table = Validity()
    try:
        local = local_reads.LocalReads(SharedSegment.attach(os.dup(table.fd), TABLE_BYTES), slots_offset=SLOTS_OFFSET)
        loc = type("Loc", (), {"size": 10})()
        g = local.generation()
        assert local.add_many([("a", 1, loc, 5), ("b", 2, loc, 6)], g) == []
        assert [e[0] for e in local.entries(["a", "b"])] == [1, 2]
        with table.change(["unrelated"]):  # the generation moves twice, slot of "unrelated" once
            pass
        assert [e[0] for e in local.entries(["a", "b"])] == [1, 2]
        table._slots[6] += 1  # what a change to a key of slot 6 leaves behind
        table._slots[6] += 0
        with table.change([]):
            pass
        assert [e and e[0] for e in local.entries(["a", "b"])] == [1, None]
        assert local.stale() == [2] and len(local) == 1
        g = local.generation()
        with table.change([]):  # a change during the request: that lease is not kept
            pass
        assert local.add("c", 3, loc, g, 7) == [3] and len(local) == 1
        table.bump_all()  # the worker stops: nothing is current any more
        assert local.entries(["a"]) == [None] and local.stale() == [1] and len(local) == 0
        local.close()
    finally:
        table.close()


def test_stale_entries_are_swept_at_most_so_often(worker, monkeypatch):
    monkeypatch.setattr(local_reads, "SWEEP_S", 3600.0)
    with kvstrata.connect(worker.address) as kv, kvstrata.connect(worker.address) as other:
        kv.mset({"a": b"a", "b": b"b"})
        assert kv.get("a") == b"a" and kv.get("b") == b"b"
        kv.exists("a")  # the one sweep of the hour
        other.delete(["a", "b"])
        kv.exists("a")
        assert leases(worker) == 2  # not swept yet: the old versions stay pinned a while
        with pytest.raises(KeyNotFound):
            kv.get("a")  # never served stale: a lookup checks its entry
        kv.exists("a")
        assert leases(worker) == 1  # the entry found stale went back; "b" waits for the sweep
        kv._backend._local._next_sweep = 0.0  # the hour is up
        kv.exists("a")
        assert leases(worker) == 0


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


def test_cached_reads_look_at_the_worker_once_per_moment(worker, monkeypatch):
    # A cached read checks the worker is still there (its socket not at EOF); one seen there less than
    # WORKER_SEEN_S ago is taken as there with no system call, so a device call's stages look once, not per stage.
    from kvstrata.client import connection

    looks = []

    class CountedPoll:  # the check's poll object, each of its polls counted
        def __init__(self, poller):
            self._poller = poller

        def poll(self, *args):
            looks.append(1)
            return self._poller.poll(*args)

    with kvstrata.connect(worker.address) as kv:
        kv.set("seen", b"cached")
        assert kv.get("seen") == b"cached"
        kv._backend._there_until = 0.0
        assert kv.get("seen") == b"cached"  # (made the check's poll object)
        kv._backend._readable = CountedPoll(kv._backend._readable)
        monkeypatch.setattr(connection, "WORKER_SEEN_S", 60.0)
        looks.clear()
        kv._backend._there_until = 0.0
        assert [kv.get("seen") for _ in range(20)] == [b"cached"] * 20
        assert len(looks) == 1
        monkeypatch.setattr(connection, "WORKER_SEEN_S", 0.0)
        looks.clear()
        kv._backend._there_until = 0.0
        assert [kv.get("seen") for _ in range(20)] == [b"cached"] * 20
        assert len(looks) == 20
        # An answer from the worker is a sighting too: a cached read right after a request does not look.
        monkeypatch.setattr(connection, "WORKER_SEEN_S", 60.0)
        kv._backend._there_until = 0.0
        assert kv.exists(["seen"]) == [True]
        looks.clear()
        assert kv.get("seen") == b"cached" and looks == []


def test_a_client_used_in_a_forked_child_refuses_and_the_parent_goes_on(tmp_path):
    # The child has the parent's mappings and cached leases but not its connection: a read there, even of a key
    # the cache holds, raises ClosedError saying why (this process's id is kept current across fork()).
    from test_worker_e2e import start_worker, stop

    proc, address = start_worker(tmp_path)
    try:
        with kvstrata.connect(address) as kv:
            kv.set("forked", b"parent's")
            assert kv.get("forked") == b"parent's" and kv.get("forked") == b"parent's"  # cached
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report what the read did, then leave at once (no finalizers)
                try:
                    kv.get("forked")
                    out = b"served"
                except kvstrata.ClosedError as exc:
                    out = b"refused" if "fork" in str(exc) else b"other"
                except BaseException:
                    out = b"other"
                os.write(w, out)
                os._exit(0)
            os.close(w)
            got = os.read(r, 16)
            os.close(r)
            os.waitpid(pid, 0)
            assert got == b"refused"
            assert kv.get("forked") == b"parent's"
            kv.delete(["forked"])
    finally:
        stop(proc)


def leases(w):
    return w.stats()["leases"]


def test_repeated_zero_copy_views_skip_the_worker(worker):
    big = bytes(range(256)) * 1024  # 256 KiB: a shared-memory object
    with kvstrata.connect(worker.address) as kv:
        kv.set("big", big)
        with kv.get_buffers("big")[0] as first:  # leases it, for the cache and for this view
            assert bytes(first) == big
        before = requests(worker)
        for _ in range(100):
            with kv.get_buffers(["big"])[0] as view:
                assert bytes(view) == big
        assert requests(worker) == before
        assert leases(worker) == 1  # the cache's one lease, shared by every view


def test_a_view_keeps_its_bytes_after_the_cache_lets_go(worker):
    """A view made from a cached lease pins the bytes until it is released, whatever happens to the key."""
    old = b"A" * (256 << 10)
    with kvstrata.connect(worker.address) as kv, kvstrata.connect(worker.address) as other:
        kv.set("k", old)
        kv.get_buffers("k")[0].release()  # now cached
        view = kv.get_buffers("k")[0]  # from the cache, no round trip
        view2 = kv.get_buffers("k")[0]
        other.delete("k")
        kv.exists("k")  # the cache sees the change and gives up its hold with this request
        for i in range(8):  # rewrite the memory tier's free space: the old bytes must not be reused
            other.set(f"fill{i}", bytes([i]) * (256 << 10))
        assert bytes(view) == old and bytes(view2) == old
        assert leases(worker) == 1  # the one lease the views share, no longer the cache's
        view.release()
        kv.exists("k")
        assert leases(worker) == 1  # view2 still holds it
        assert bytes(view2) == old
        del view2  # dropped without release: freed by the garbage collector, handed over next request
        gc.collect()
        kv.exists("k")
        assert leases(worker) == 0


def test_cached_views_never_show_a_newer_version(worker):
    with kvstrata.connect(worker.address) as kv, kvstrata.connect(worker.address) as other:
        for n in range(20):
            other.set("v", bytes([n]) * (128 << 10))
            for _ in range(3):
                with kv.get_buffers("v")[0] as view:
                    assert bytes(view) == bytes([n]) * (128 << 10)


def test_mutable_and_ttl_objects_are_not_cached_for_views(worker):
    with kvstrata.connect(worker.address) as kv:
        with kv.create("m", 100_000) as buf:
            buf.write(b"m" * 100_000)
            buf.publish()
        kv.set("t", b"t" * 100_000, ttl=60)
        for key in ("m", "t"):
            kv.get_buffers(key)[0].release()
            before = requests(worker)
            kv.get_buffers(key)[0].release()
            assert requests(worker) > before
        assert len(kv._backend._local) == 0


def test_a_killed_reader_loses_its_cached_leases(worker):
    ctx = multiprocessing.get_context("spawn")
    with kvstrata.connect(worker.address) as kv:
        kv.set("shared", b"s" * 200_000)
        p = ctx.Process(target=jobs.hold_views_and_die, args=(worker.address, "shared"))
        p.start()
        p.join(60)
        deadline = time.monotonic() + 10
        while leases(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert leases(worker) == 0


def test_poll_advice(worker):
    """The worker polls for a lone client in another process only; in-process clients never poll."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        advised, _ = pool.apply(jobs.spin_advice, (worker.address,))
    cpus = len(os.sched_getaffinity(0))
    assert advised == (worker.config.spin_us * 1e-6 if cpus >= 2 else 0.0)
    with kvstrata.connect(worker.address) as kv:  # this process: the worker's GIL
        kv.exists("x")
        assert worker.spin == 0.0
        assert kv._backend._local._spin is None


def test_a_change_of_many_keys_moves_each_of_their_slots():
    """Batches bump their slots with one vector add: every key's slot still moves, others stay."""
    from kvstrata.server.validity import SLOTS, Validity

    table = Validity()
    try:
        keys = [f"many/{i}" for i in range(40)]
        slots = {table.slot_of(k) for k in keys}
        before = [table._slots[i] for i in range(SLOTS)]
        with table.change(keys):
            pass
        after = [table._slots[i] for i in range(SLOTS)]
        assert all(after[i] != before[i] for i in slots)
        assert all(after[i] == before[i] for i in range(SLOTS) if i not in slots)
    finally:
        table.close()


def test_keys_read_in_turn_past_the_cache_keep_what_it_holds(worker):
    """More keys read in turn than the cache holds: a full cache keeps its entries rather than have each get push
    out the entry the next pass needs first (plain LRU: no hit ever). The keys it holds are served from shared
    memory pass after pass; each other key is one plain get."""
    with kvstrata.connect(worker.address) as kv:
        local = kv._backend._local
        n = local.max_entries + 44
        kv.mset({f"r{i}": bytes([i % 256]) * 512 for i in range(n)})
        for i in range(n):
            assert kv.get(f"r{i}") == bytes([i % 256]) * 512
        for _ in range(3):
            before = requests(worker)
            for i in range(n):
                assert kv.get(f"r{i}") == bytes([i % 256]) * 512
            assert requests(worker) - before == n - local.max_entries
        assert worker.store.stats()["leases"] == len(local) == local.max_entries


def test_keys_read_more_often_take_the_place_of_others_and_each_get_is_one_message(worker):
    """Keys read more often lately than the cache's oldest entry take its place: the lease let go of rides along
    with the next request, so such a get is one message to the worker, not a get and a release; what is kept
    stays within the cache's bound."""
    with kvstrata.connect(worker.address) as kv:
        local = kv._backend._local
        m = local.max_entries
        kv.mset({f"a{i}": b"a" * 512 for i in range(m)} | {f"b{i}": b"b" * 512 for i in range(44)})
        for i in range(m):  # the cache fills with keys read once
            kv.get(f"a{i}")
        before = requests(worker)
        for _ in range(2):  # the first get of each is not kept, the second is (read twice against once)
            for i in range(44):
                assert kv.get(f"b{i}") == b"b" * 512
        assert requests(worker) - before == 88
        before = requests(worker)
        for i in range(44):  # kept now
            assert kv.get(f"b{i}") == b"b" * 512
        assert requests(worker) == before
        kv.exists("b0")  # carries the leases let go of
        assert worker.store.stats()["leases"] == len(local) == m


def test_counts_age():
    """The counts behind the admission halve every AGE_EVERY x max_entries gets: a key read often long ago loses
    its claim."""
    from kvstrata.client.local_reads import AGE_EVERY, LocalReads

    reads = LocalReads.__new__(LocalReads)
    reads._freq, reads._counted, reads.max_entries = {}, 0, 4
    for _ in range(10):
        reads.count("old")
    assert reads.count("old") == 11
    for i in range(AGE_EVERY * 4 - 11):
        reads.count(f"k{i % 3}")
    assert reads._freq["old"] == 5 and reads._counted == 0
