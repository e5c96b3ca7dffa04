"""The worker's lane poller (kvstrata.server.lane_poller): while several clients are connected, one thread
polls all their lanes. Small requests go through the lanes and are served right; the flags come down when
they stop; a client killed or sending garbage on its lane is dropped alone; a commit waiting for its landing
word is still watched while the poller serves its client's lane."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvstrata
from kvstrata.errors import KvstrataError
from kvstrata.server import lane as L
from kvstrata.transport.stream import pack

sys.path.insert(0, str(Path(__file__).parent))
import _e2e_jobs as jobs
from kv_helpers import wait_until
from test_worker_e2e import SRC, start_worker, stop

pytestmark = [
    pytest.mark.skipif(not L.supported(), reason="the lane is offered on x86-64 only"),
    # (the CPUs this process may run on, as the worker counts them: on one, it polls no lane)
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the worker polls only with 2+ CPUs"),
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    proc, address = start_worker(tmp_path_factory.mktemp("poller"), "--spin-us", "2000")
    yield address
    log = stop(proc)
    assert proc.returncode == 0, log
    assert "Traceback" not in log, log


def _polled(kv) -> int:
    return kv.stats()["lane_requests_polled"]


def _burst(clients, n=60):
    """Sets from each client in turn; returns how many went through each client's lane."""
    lanes = [c._backend._lane for c in clients]
    before = [lane.seq for lane in lanes]
    for i in range(n):
        for j, c in enumerate(clients):
            c.set(f"burst/{j}/{i % 8}", bytes([i % 256]) * (i * 13 % 3000))
    for j, c in enumerate(clients):
        for i in range(n - 8, n):
            assert c.get(f"burst/{j}/{i % 8}") == bytes([i % 256]) * (i * 13 % 3000)
    return [lane.seq - b for lane, b in zip(lanes, before)]


def test_several_clients_small_sets_go_through_their_lanes(worker):
    with kvstrata.connect(worker) as a, kvstrata.connect(worker) as b:
        polled = _polled(a)
        # The first set after an idle spell goes over the socket and wakes the poller; then the lanes carry
        # them (how many exactly is timing: a loaded machine can outlast the poller's spell between two, burst
        # after burst while it stays loaded: up to three bursts).
        for _ in range(3):
            through_lane = _burst([a, b])
            if all(n > 0 for n in through_lane) and _polled(a) > polled:
                break
        assert all(n > 0 for n in through_lane), through_lane
        assert _polled(a) > polled  # served by the poller (a request whose client gave up waiting: by its thread)
        # Once they stop, the poller lowers the flags: the clients use their sockets, nothing is stranded.
        assert wait_until(lambda: not a._backend._lane.polling() and not b._backend._lane.polling(), 5)
        a.set("after/idle", b"socket")
        assert b.get("after/idle") == b"socket"


def test_status_and_metrics_show_the_pollers_work(worker):
    with kvstrata.connect(worker) as a, kvstrata.connect(worker) as b:
        _burst([a, b], 20)
        env = {**os.environ, "PYTHONPATH": SRC}
        base = [sys.executable, "-m", "kvstrata.cli.main", "status", "--address", worker]
        out = subprocess.run(base, env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "small requests answered by the worker's polling thread" in out.stdout
        out = subprocess.run([*base, "--prometheus"], env=env, capture_output=True, text=True, timeout=30)
        polled = [line for line in out.stdout.splitlines() if line.startswith("kvstrata_lane_requests_polled_total ")]
        assert len(polled) == 1 and float(polled[0].split()[1]) > 0, out.stdout


def test_a_lone_client_is_served_by_its_own_thread_again(worker):
    with kvstrata.connect(worker) as a:
        with kvstrata.connect(worker) as b:
            _burst([a, b], 20)
        assert wait_until(lambda: a.stats()["clients"] == 1, 10.0)
        polled = _polled(a)
        for _ in range(3):  # the first wakes the connection thread, which then polls the lane itself
            through_lane = _burst([a], 40)
            if through_lane[0]:
                break
        assert through_lane[0] > 0
        assert _polled(a) == polled + 0  # none by the poller: it is off for a lone client


def test_many_processes_mixed_requests_are_served_right(worker):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(jobs.small_writer, [(worker, me, 300) for me in range(4)])
    assert [checked for checked, _ in results] == [300] * 4
    assert sum(lane for _, lane in results) > 0  # the lanes carried some of them
    with kvstrata.connect(worker) as kv:
        for me in range(4):  # every job's last values, seen from another client
            for i in range(300 - 16, 300):
                value = jobs.payload(me, i)[:200] if i % 7 else jobs.payload(me, i)
                assert kv.get(f"s{me}/{i % 16}") == (b"" if i % 5 == 0 else value)


def test_a_client_killed_while_its_lane_is_polled_leaves_the_others_served(worker):
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(target=jobs.small_writer, args=(worker, 9, 50, 60.0))
    victim.start()
    try:
        with kvstrata.connect(worker) as a, kvstrata.connect(worker) as b:
            assert wait_until(lambda: a.stats()["clients"] >= 3, 30)
            _burst([a, b], 20)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            assert wait_until(lambda: a.stats()["clients"] == 2, 10)
            assert all(n >= 0 for n in _burst([a, b], 40))
            assert a.get("burst/1/0") == b.get("burst/1/0")
    finally:
        if victim.is_alive():
            victim.kill()


@pytest.mark.parametrize("garbage", ["not msgpack", "not a map", "too long"])
def test_garbage_on_a_polled_lane_drops_that_client_alone(worker, garbage):
    with kvstrata.connect(worker) as bad, kvstrata.connect(worker) as good:
        _burst([bad, good], 10)  # the poller is on for the two of them
        lane = bad._backend._lane
        with bad._backend._lock:  # as a broken client would: straight into the page
            if garbage == "too long":
                lane._req_len.value = L.REQUEST_BYTES + 1
                lane.seq += 1
                lane._req_seq.value = lane.seq
            else:
                lane.submit(b"\xc1\xc1\xc1" if garbage == "not msgpack" else pack([1, 2, 3]))
        good.set("kick", b"x")  # a set over the socket (its lane unpolled) starts a spell, which finds it
        assert wait_until(lambda: good.stats()["clients"] == 1, 10)  # the broken client was dropped
        with pytest.raises(KvstrataError):
            for _ in range(3):
                bad.set("bad/after", b"never")
        _burst([good], 20)
        assert good.get("kick") == b"x"


def test_a_landing_commit_is_watched_while_the_poller_serves_its_lane(worker):
    with kvstrata.connect(worker) as kv, kvstrata.connect(worker) as reader:
        kv.delete(["poll/landing"])
        b = kv._backend
        loc = b.reserve_finish(b.reserve_start(1 << 20))
        assert b.can_land
        token = b.commit_start(
            [("poll/landing", 2, loc.offset)], {"ttl": None, "nx": True, "mode": "memory"}, landing=True
        )
        b.commit_finish(token)
        b.view(type(loc)(loc.segment, loc.offset, 2))[:] = b"ok"
        got = []
        t = threading.Thread(target=lambda: got.append(reader.get("poll/landing", timeout=30)))
        t.start()
        lane, before = b._lane, b._lane.seq
        for i in range(40):  # the writer's lane requests, served by the poller meanwhile (and nothing else)
            kv.set(f"poll/landing/{i % 4}", b"v" * i)
        assert lane.seq > before
        time.sleep(0.05)
        assert not got
        t0 = time.monotonic()
        b.land(token)  # the reader wakes with no other request from the writer
        t.join(10)
        assert got == [b"ok"] and time.monotonic() - t0 < 5
