"""kvstrata.server.gil_spin: a socket readiness check for busy-polling threads that keeps the GIL."""

from __future__ import annotations

import gc
import mmap
import os
import socket
import sys
import threading
import time

import pytest

from kvstrata.server.gil_spin import ReadyCheck


def test_ready_when_data_or_hang_up_and_not_before():
    a, b = socket.socketpair()
    ready = ReadyCheck(a.fileno())
    assert not ready()
    b.send(b"x")
    assert ready()
    assert a.recv(1) == b"x"
    assert not ready()
    b.close()  # a read would not block (it returns EOF): ready
    assert ready()
    a.close()


def test_a_closed_descriptor_is_an_error_not_a_silent_false():
    a, b = socket.socketpair()
    ready = ReadyCheck(a.fileno())
    a.close()
    with pytest.raises(OSError, match="not open"):
        ready()
    b.close()


@pytest.mark.parametrize("fd", [-1, "3", None])
def test_bad_descriptors_are_refused(fd):
    with pytest.raises(ValueError, match="fd"):
        ReadyCheck(fd)


def test_the_check_keeps_the_gil():
    """While one thread polls with the check, a thread woken meanwhile runs only once the poller lets go:
    the check itself never hands the GIL over (with a 10 s switch interval, CPython takes it away later).

    The sleeper is woken by another process, in the middle of the poll: a write from this thread would let go of
    the GIL for its system call, and on a loaded machine the sleeper could take it then (seen in CI). Garbage
    collection is off meanwhile, so no finalizer's I/O lets go of it either."""
    a, b = socket.socketpair()
    r, w = os.pipe()
    wrote = mmap.mmap(-1, 2)  # shared with the child: [0] 1 once its write went, [1] 1 once the poll began
    child = os.fork()
    if child == 0:  # the child: wake the sleeper well after the poll began, then leave (no finalizers)
        try:
            # the poll's start, not a fixed delay from the fork: a parent slowed down (its gc.collect() on a loaded
            # machine) polled only after the write, which let the sleeper run
            give_up = time.monotonic() + 60
            while not wrote[1] and time.monotonic() < give_up:
                time.sleep(0.001)
            time.sleep(0.1)
            os.write(w, b"x")
            wrote[0] = 1
        finally:
            os._exit(0)
    woke: list[float] = []

    def sleeper() -> None:
        os.read(r, 1)  # blocks without the GIL
        woke.append(time.perf_counter())

    ready = ReadyCheck(a.fileno())
    old = sys.getswitchinterval()
    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.05)  # the sleeper is in its read
    gc.collect()
    gc.disable()
    sys.setswitchinterval(10.0)
    try:
        polls = 0
        wrote[1] = 1  # (a store to shared memory: the GIL stays here)
        deadline = time.perf_counter() + 10.0
        while not wrote[0] and time.perf_counter() < deadline:  # the sleeper's read returns meanwhile
            assert not ready()
            polls += 1
        end = time.perf_counter() + 0.05  # then it waits for the GIL, which this loop keeps
        while time.perf_counter() < end:
            assert not ready()
            polls += 1
        spun_until = time.perf_counter()
        assert wrote[0], "the child never woke the sleeper"
        assert not woke, "the sleeper ran while the poller held the GIL"
    finally:
        sys.setswitchinterval(old)
        gc.enable()
    thread.join(5)  # releases the GIL
    os.waitpid(child, 0)
    assert woke and woke[0] >= spun_until
    assert polls > 100
    for fd in (r, w):
        os.close(fd)
    a.close()
    b.close()
