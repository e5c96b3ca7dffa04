"""CopiesFuture: the Future of an async host <-> device call (kvstrata.client.copies_future)."""

from __future__ import annotations

import threading
import time

import pytest

from kvstrata.client.copies_future import CopiesFuture
from kvstrata.devobj import futures


@pytest.fixture(params=[0.0, 0.002], ids=["plain", "polling"])
def spin(request):
    old = futures.set_result_spin(request.param)
    yield request.param
    futures.set_result_spin(old)


class FakeEvent:
    """Stands in for the copies' CUDA end event: ``synchronize`` blocks until ``fire``."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1
        assert self._done.wait(10), "the copies never ended"

    def fire(self) -> None:
        self._done.set()


def _later(seconds: float, fn, *args) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn(*args)))
    t.start()
    return t


def test_a_timed_wait_is_not_cut_short_by_the_copies_being_queued(spin):
    # A plain Future's waiter wakes once per notify and takes it for the end: queuing must not notify it.
    fut = CopiesFuture()
    fut.set_running_or_notify_cancel()
    t = _later(0.05, fut.copies_queued, FakeEvent())
    t2 = _later(0.3, fut.set_result, ["done"])
    start = time.monotonic()
    assert fut.exception(timeout=5) is None
    assert fut.result(timeout=5) == ["done"]
    assert time.monotonic() - start >= 0.25
    t.join()
    t2.join()


def test_an_untimed_waiter_waits_for_the_copies_then_the_settle(spin):
    fut = CopiesFuture()
    fut.set_running_or_notify_cancel()
    event = FakeEvent()
    got = []
    waiter = threading.Thread(target=lambda: got.append(fut.result()))
    waiter.start()
    time.sleep(0.05)
    fut.copies_queued(event)
    time.sleep(0.05)
    assert not got
    event.fire()
    fut.set_result([None, None])
    waiter.join(10)
    assert got == [[None, None]]
    # Polling waiters wait on the event itself (the driver's wait); plain ones only sleep on the Future.
    assert event.waited == (1 if spin else 0)


@pytest.mark.parametrize("end", ["exception", "cancel", "no copies"])
def test_a_waiter_comes_out_when_the_call_ends_before_its_copies_are_queued(spin, end):
    fut = CopiesFuture()
    if end != "cancel":
        fut.set_running_or_notify_cancel()
    out = []

    def wait() -> None:
        try:
            out.append(fut.result())
        except BaseException as exc:  # the test looks at which
            out.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    if end == "exception":
        fut.set_exception(ValueError("tensor_lists: bad"))
    elif end == "cancel":
        assert fut.cancel()
    else:  # a call on CPU tensors: nothing on a device to wait for
        fut.copies_queued(None)
        fut.set_result([None])
    waiter.join(10)
    assert not waiter.is_alive()
    if end == "exception":
        assert isinstance(out[0], ValueError)
    elif end == "cancel":
        assert type(out[0]).__name__ == "CancelledError"
    else:
        assert out == [[None]]
