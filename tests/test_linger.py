"""A request's ``"linger"`` (and the one-way ``linger`` op): the worker keeps the client's connection thread
polling until the client's next request is due, instead of sleeping and paying a wake-up for it. Seen from
the client through the lane page's ``polling`` flag, which the worker raises exactly while it polls."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import kvstrata
from kvstrata.server import lane as L
from kvstrata.server.session import LINGER_MAX_US

sys.path.insert(0, str(Path(__file__).parent))
from test_worker_e2e import start_worker, stop

pytestmark = [
    pytest.mark.skipif(not L.supported(), reason="the lane (whose flag shows the polling) is x86-64 only"),
    # (the CPUs this process may run on, as the worker counts them: a runner limited to one of two is one CPU)
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the worker polls only with 2+ CPUs"),
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    old = os.environ.get("KVSTRATA_SPIN_US")
    os.environ["KVSTRATA_SPIN_US"] = "50"  # a short default window, so a linger's longer one shows
    try:
        proc, address = start_worker(tmp_path_factory.mktemp("linger"))
    finally:
        if old is None:
            os.environ.pop("KVSTRATA_SPIN_US")
        else:
            os.environ["KVSTRATA_SPIN_US"] = old
    yield address
    log = stop(proc)
    assert proc.returncode == 0, log


def _wait(cond, seconds: float = 5.0) -> float:
    """Poll ``cond`` until true; the time it became true (fails after ``seconds``)."""
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0)  # the CPU to the worker's polling thread too, on a machine of 2 CPUs and busy tests
    return time.monotonic()


def _polled_window(backend, lane, linger_us: int, *, want: float, attempts: int = 5) -> float:
    """Send a linger of ``linger_us`` and time how long the lane's flag stays up, again (up to ``attempts``
    times) while it shows less than ``want`` seconds: a loaded machine can keep this thread off the CPU
    through the whole window, or see the flag go up late; the longest window seen."""
    best = 0.0
    for _ in range(attempts):
        _wait(lambda: not lane.polling())
        backend.linger(linger_us)
        end = time.monotonic() + linger_us / 1e6 + 0.5
        up = None
        while up is None and time.monotonic() < end:
            if lane.polling():
                up = time.monotonic()
        if up is None:  # the whole window passed while this thread was off the CPU: ask again
            continue
        down = _wait(lambda: not lane.polling())
        best = max(best, down - up)
        if best >= want:
            break
    return best


def test_linger_keeps_the_worker_polling_then_it_sleeps(worker):
    with kvstrata.connect(worker) as kv:
        backend = kv._backend
        lane = backend._lane
        assert lane is not None
        kv.ping()
        # the worker wakes for the hint and polls for most of the 5 ms asked, where without the hint the flag
        # drops 50 us after going up (1 ms leaves room for this thread seeing it go up late)
        assert _polled_window(backend, lane, LINGER_MAX_US, want=0.001) >= 0.001
        # the next request is served as usual, and a request without linger gets the default window back
        kv.set("linger/a", b"x")
        assert kv.get("linger/a") == b"x"
        _wait(lambda: not lane.polling(), 1.0)


def test_linger_is_capped(worker):
    with kvstrata.connect(worker) as kv:
        backend = kv._backend
        lane = backend._lane
        kv.ping()
        _wait(lambda: not lane.polling())
        for _ in range(10):  # a loaded machine can keep this thread off the CPU through the whole capped window
            backend.linger(10**12)  # ~11 days asked: the worker polls LINGER_MAX_US at most
            try:
                up = _wait(lane.polling, 0.5)
                break
            except AssertionError:
                continue
        else:
            pytest.fail("the worker never polled for a lingering client")
        # An uncapped linger would still poll seconds later (the cap is 0.1 s; a loaded CI machine once took over
        # 1 s to see it end)
        down = _wait(lambda: not lane.polling(), 3.0)
        assert down - up <= 3.0 and LINGER_MAX_US <= 100_000


@pytest.mark.parametrize(("bad", "error"), [(-5, ValueError), ("soon", TypeError), (True, TypeError)])
def test_a_bad_linger_is_refused_by_name_and_the_worker_keeps_serving(worker, bad, error):
    with kvstrata.connect(worker) as kv:
        with pytest.raises(error, match="linger"):
            kv._backend.request({"op": "ping", "linger": bad})
        kv.set("linger/b", b"still here")
        assert kv.get("linger/b") == b"still here"


def test_commits_carry_a_linger_only_while_more_follow(worker):
    # On the CPU path every mark has landed when the first commit goes: one commit, no linger. The linger
    # arithmetic itself: bytes at the assumed rate plus slack.
    from kvstrata.client import device_calls

    assert device_calls._linger_us(0) == device_calls.LINGER_SLACK_US
    assert device_calls._linger_us(64 << 20) == (64 << 20) // device_calls.LINGER_BYTES_PER_US + 100
    torch = pytest.importorskip("torch")
    with kvstrata.connect(worker) as kv:
        sent = []
        real = kv._backend.commit_start

        def spy(items, opts, linger_us=0, *, landing=False):
            sent.append((len(items), linger_us))
            return real(items, opts, linger_us, landing=landing)

        kv._backend.commit_start = spy
        ts = [[torch.arange(i, i + 64, dtype=torch.int32)] for i in range(12)]
        assert kv.mset_d2h([f"linger/w/{i}" for i in range(12)], ts) == [None] * 12  # gets a reservation
        sent.clear()
        keys = [f"linger/c/{i}" for i in range(12)]
        assert kv.mset_d2h(keys, ts) == [None] * 12
        assert sent == [(12, 0)]
        out = [[torch.empty(64, dtype=torch.int32)] for _ in range(12)]
        assert kv.mget_h2d(keys, out) == [None] * 12
        assert all(torch.equal(a[0], b[0]) for a, b in zip(ts, out))
