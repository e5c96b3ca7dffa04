"""The parts of pipelined broadcasts, without a GPU: the shared-memory progress counter (and a member
taking its name back), the chunk pump and a leader's fan-out to its members (fake events, a fake
clock), chunk sizes and spans, and the counters' GPU-side operations against a fake driver. Whole
broadcasts between CPU clients: tests/test_devobj_bcast_e2e.py."""

from __future__ import annotations

import os
import subprocess
from collections import deque

import pytest

from kvstrata import errors
from kvstrata.devobj.chain import MAX_AUTO_CHUNK, FanOut, Member, chunk_size, plan_chunks, pump, spans
from kvstrata.devobj.progress import FAILED, PREFIX, Progress, sweep_stale


# -- progress counter ---------------------------------------------------------------------------------
def test_progress_shared_by_name_and_nothing_left(tmp_path):
    w = Progress.create(tmp_path)
    assert w.value() == 0 and w.name.startswith(f"{PREFIX}p{os.getpid()}-")
    r = Progress.open(w.name, tmp_path)
    assert list(tmp_path.iterdir()) == []  # the reader unlinked the name; both mappings stay
    w.advance(5)
    assert r.value() == 5
    w.fail()
    assert r.value() == FAILED
    r.close()
    w.close()
    w.close()  # idempotent


def test_progress_creator_unlinks_when_never_opened(tmp_path):
    w = Progress.create(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [w.name]
    w.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        Progress.open(w.name, tmp_path)
    with pytest.raises(ValueError, match="progress"):
        Progress.open("../etc/passwd", tmp_path)


def test_stale_progress_of_dead_process_swept(tmp_path):
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid names no process
    stale = tmp_path / f"{PREFIX}p{p.pid}-{'0' * 32}"
    stale.write_bytes(b"\0" * 8)
    live = Progress.create(tmp_path)  # sweeps on create
    assert sorted(x.name for x in tmp_path.iterdir()) == [live.name]
    assert sweep_stale(tmp_path) == 0  # our own is alive
    live.close()


# -- the pump, with fake events -----------------------------------------------------------------------
class FakeEvent:
    def __init__(self, log: list, c: int) -> None:
        self.log, self.c, self.done = log, c, False

    def query(self) -> bool:
        return self.done


def test_pump_enqueues_only_available_and_publishes_only_completed():
    n = 5
    avail = [0]
    events: list[FakeEvent] = []
    published: list[int] = []
    log: list = []
    steps = iter(range(1000))

    def enqueue(c: int) -> FakeEvent:
        assert c < avail[0], "a chunk was copied before the predecessor had it"
        log.append(("enq", c))
        ev = FakeEvent(log, c)
        events.append(ev)
        return ev

    def publish(k: int) -> None:
        assert all(e.done for e in events[:k]), "published a chunk whose copy had not finished"
        published.append(k)

    def tick(_: float) -> None:  # the world moves between polls: predecessor first, then our copies
        i = next(steps)
        if i % 3 == 0 and avail[0] < n:
            avail[0] += 1
        elif i % 3 == 1:
            for e in events:
                if not e.done:
                    e.done = True
                    break

    recycled = []
    pump(
        n,
        enqueue,
        available=lambda: avail[0],
        publish=publish,
        aborted=lambda: None,
        recycle=recycled.append,
        timeout=1.0,
        what="w",
        sleep=tick,
    )
    assert [c for _, c in log] == list(range(n))
    assert published == sorted(set(published)) and published[-1] == n
    assert recycled == events


def test_pump_cpu_copies_complete_at_once_and_available_beyond_plan_is_capped():
    got = []
    pump(3, lambda c: got.append(c), available=lambda: 10, publish=None, aborted=lambda: None, timeout=1, what="w")
    assert got == [0, 1, 2]


def fake_clock():
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += max(s, 1e-3)

    return (lambda: now[0]), sleep


def test_pump_stalled_predecessor_times_out_naming_where():
    clock, sleep = fake_clock()
    with pytest.raises(errors.Timeout, match=r"bcast 'k' at position 2: the predecessor has 1 of 4 chunks"):
        pump(
            4,
            lambda c: None,
            available=lambda: 1,
            publish=None,
            aborted=lambda: None,
            timeout=0.5,
            what="bcast 'k' at position 2",
            clock=clock,
            sleep=sleep,
        )


def test_pump_stuck_copy_times_out():
    clock, sleep = fake_clock()
    with pytest.raises(errors.Timeout, match="copy of chunk 0 of 2 did not finish"):
        pump(
            2,
            lambda c: FakeEvent([], c),
            available=lambda: 2,
            publish=None,
            aborted=lambda: None,
            timeout=0.5,
            what="w",
            clock=clock,
            sleep=sleep,
        )


def test_pump_stops_on_abort_and_on_failed_predecessor():
    with pytest.raises(errors.ClosedError, match="gone"):
        pump(2, lambda c: None, available=lambda: 0, publish=None, aborted=lambda: errors.ClosedError("gone"),
             timeout=5, what="w")  # fmt: skip
    with pytest.raises(errors.ServerError, match="predecessor's copy failed"):
        pump(2, lambda c: None, available=lambda: FAILED, publish=None, aborted=lambda: None, timeout=5, what="w")


def test_plan_chunks_boundaries():
    specs = [{"nbytes": 10}, {"nbytes": 0}, {"nbytes": 8}, {"nbytes": 3}]
    assert plan_chunks(specs, 4) == [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 0), (2, 0, 4), (2, 4, 4), (3, 0, 3)]


def test_chunk_size_grows_for_big_objects_and_all_receivers_agree():
    def specs(*sizes):
        return [{"nbytes": n} for n in sizes]

    assert chunk_size(specs(3 << 20), 32 << 20) == 32 << 20  # small: the requested size
    assert chunk_size(specs(2 << 30), 32 << 20) == 64 << 20  # 2 GiB: 32 chunks
    assert chunk_size(specs(8 << 30), 32 << 20) == MAX_AUTO_CHUNK  # capped: the chain still pipelines
    assert chunk_size(specs(1 << 30, 1 << 30), 32 << 20) == 64 << 20  # the whole object counts
    assert chunk_size(specs(8 << 30), 256 << 20) == 256 << 20  # a larger request is kept
    assert chunk_size(specs(0), 4096) == 4096 and chunk_size(specs(12345), 4096) == 4096


def test_spans_merge_contiguous_chunks_per_tensor():
    plan = plan_chunks([{"nbytes": 10}, {"nbytes": 0}, {"nbytes": 8}], 4)
    assert spans(plan, 0, len(plan)) == [(0, 0, 10), (2, 0, 8)]  # the empty tensor needs no copy
    assert spans(plan, 1, 5) == [(0, 4, 6), (2, 0, 4)]
    assert spans(plan, 2, 2) == []


def test_progress_claim_only_before_a_reader_opened_it(tmp_path):
    a = Progress.create(tmp_path)
    assert a.claim() is True  # nobody opened it: now nobody can
    with pytest.raises(FileNotFoundError):
        Progress.open(a.name, tmp_path)
    b = Progress.create(tmp_path)
    r = Progress.open(b.name, tmp_path)
    assert b.claim() is False  # a reader has it
    for p in (a, b, r):
        p.close()
    assert list(tmp_path.iterdir()) == []


# -- a leader's fan-out to its members, with fake events ---------------------------------------------------
class Ev:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def fan_world(n_members: int, arrive_after: dict[int, int]):
    """A leader pulling 6 chunks (fake events) whose members arrive after some chunks were queued."""
    log: list = []
    pulls: list[Ev] = []
    fans: list[Ev] = []
    got: dict[int, list[int]] = {m: [] for m in range(n_members)}
    inbox: list[Member] = []

    def member(i: int) -> Member:
        def publish(k: int) -> None:
            assert all(e.done for e in fans), "a member heard of chunks whose copies had not completed"
            got[i].append(k)

        return Member(i, None, publish, lambda: log.append(("fail", i)))

    def attach() -> list[Member]:
        out = list(inbox)
        inbox.clear()
        return out

    def copy(members, start, stop, after):
        assert after is None or after is pulls[-1], "the fan-out must wait for the newest pull"
        log.append(("fan", tuple(m.position for m in members), start, stop))
        ev = Ev()
        fans.append(ev)
        return ev

    def enqueue(c: int) -> Ev:
        for i, when in arrive_after.items():
            if when == c:
                inbox.append(member(i))
        ev = Ev()
        pulls.append(ev)
        return ev

    def tick(_: float) -> None:  # the GPU completes everything queued between polls
        for e in pulls + fans:
            e.done = True

    return log, got, attach, copy, enqueue, tick


def test_fanout_catches_late_members_up_in_one_copy_and_publishes_after_completion():
    log, got, attach, copy, enqueue, tick = fan_world(2, {0: 0, 1: 3})
    fan = FanOut(2, attach=attach, copy=copy)
    pump(6, enqueue, available=lambda: 6, publish=None, aborted=lambda: None, fanout=fan, timeout=1, what="w",
         sleep=tick)  # fmt: skip
    fans = [x for x in log if x[0] == "fan"]
    late = [x for x in fans if 1 in x[1]]
    assert late[0][2] == 0 and late[0][3] >= 4, "the late member's backlog is one copy from chunk 0"
    covered = {m: sorted(c for _, ms, a, b in fans if m in ms for c in range(a, b)) for m in (0, 1)}
    assert covered == {0: list(range(6)), 1: list(range(6))}  # every chunk exactly once per member
    assert all(g == sorted(g) and g[-1] == 6 for g in got.values())
    assert fan.finished(6) and fan.pending == deque()


def test_fanout_leader_waits_for_missing_members_then_times_out():
    log, got, attach, copy, enqueue, tick = fan_world(2, {0: 0})  # member 1 never arrives
    now = [0.0]

    def sleep(s: float) -> None:
        tick(s)
        now[0] += max(s, 1e-3)

    fan = FanOut(2, attach=attach, copy=copy)
    with pytest.raises(errors.Timeout, match=r"w: 1 group member\(s\) did not send their buffers"):
        pump(3, enqueue, available=lambda: 3, publish=None, aborted=lambda: None, fanout=fan, timeout=0.5,
             what="w", clock=lambda: now[0], sleep=sleep)  # fmt: skip
    assert got[0][-1] == 3  # the member that came has everything meanwhile
    fan.stop()
    assert log[-1] == ("fail", 0)


def test_fanout_attach_error_fails_the_leader():
    def attach():
        raise errors.ServerError("member went away")

    fan = FanOut(1, attach=attach, copy=lambda *a: None)
    with pytest.raises(errors.ServerError, match="member went away"):
        pump(2, lambda c: None, available=lambda: 2, publish=None, aborted=lambda: None, fanout=fan, timeout=1,
             what="w")  # fmt: skip
