"""A commit sent before its copies landed (``"landing"``): the worker holds it until the client says, in the
lane page, that the bytes are there (kvstrata.server.lane), and never makes the objects visible before. The
paths: landed, failed (cancelled), the client killed while the worker waits, bad input, and ``mset_d2h``
sending its last commit that way while the last copies are in flight (a CPU stand-in for the CUDA event)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kvstrata
from _stages import stages_of
from kvstrata.client import device
from kvstrata.errors import KvstrataError, ServerError
from kvstrata.server import lane as L

sys.path.insert(0, str(Path(__file__).parent))
from test_worker_e2e import start_worker, stop

pytestmark = pytest.mark.skipif(not L.supported(), reason="the lane (which carries the landing word) is x86-64 only")

OPTS = {"ttl": None, "nx": True, "mode": "memory"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    proc, address = start_worker(tmp_path_factory.mktemp("landing"))
    yield address
    log = stop(proc)
    assert proc.returncode == 0, log


def _reserve(kv, nbytes=1 << 20):
    b = kv._backend
    loc = b.reserve_finish(b.reserve_start(nbytes))
    assert b.can_land and loc.size >= nbytes
    return b, loc


def test_a_held_commit_is_invisible_until_its_copies_landed(worker):
    with kvstrata.connect(worker) as a, kvstrata.connect(worker) as other:
        a.delete(["land/a"])
        b, loc = _reserve(a)
        token = b.commit_start([("land/a", 5, loc.offset)], OPTS, landing=True)
        b.view(type(loc)(loc.segment, loc.offset, 5))[:] = b"bytes"  # "the copy", after the commit went
        time.sleep(0.05)  # the worker has the commit by now and holds it
        assert other.exists(["land/a"]) == [False]  # the worker serves others meanwhile; nothing visible
        b.land(token)
        res, head = b.commit_finish(token)
        assert res == [None] and head == loc.offset + 64
        assert other.get("land/a") == b"bytes" and a.get("land/a") == b"bytes"
        a.delete(["land/a"])


def test_failed_copies_cancel_the_commit_and_leave_the_head(worker):
    with kvstrata.connect(worker) as kv:
        kv.delete(["land/c1", "land/c2"])
        b, loc = _reserve(kv)
        token = b.commit_start([("land/c1", 8, loc.offset), ("land/c2", 8, loc.offset + 64)], OPTS, landing=True)
        b.land(token, ok=False)
        res, head = b.commit_finish(token)
        assert all(isinstance(r, ServerError) and "did not land" in str(r) for r in res) and len(res) == 2
        assert head == loc.offset  # nothing carved: the next commit starts from the same place
        assert kv.exists(["land/c1", "land/c2"]) == [False, False]
        b.view(type(loc)(loc.segment, loc.offset, 3))[:] = b"new"
        assert b.commit_finish(b.commit_start([("land/c1", 3, loc.offset)], OPTS)) == ([None], loc.offset + 64)
        assert kv.get("land/c1") == b"new"
        kv.delete(["land/c1"])


def test_a_landing_commit_needs_a_tag(worker):
    with kvstrata.connect(worker) as kv:
        with pytest.raises(ValueError, match="landing"):
            kv._backend.request({"op": "commit", "items": [], "landing": True})  # untagged: cannot be told
        assert kv.set("land/ok", b"x") is None and kv.get("land/ok") == b"x"


def test_other_requests_of_the_client_wait_behind_a_held_commit(worker):
    with kvstrata.connect(worker) as kv:
        kv.delete(["land/w"])
        kv.set("land/other", b"o")
        b, loc = _reserve(kv)
        token = b.commit_start([("land/w", 1, loc.offset)], OPTS, landing=True)
        got = []
        t = threading.Thread(target=lambda: got.append(kv.exists(["land/w", "land/other"])))
        t.start()
        time.sleep(0.05)
        assert not got  # queued behind the held commit on this connection
        b.land(token)
        t.join(10)
        assert got == [[True, True]]  # and served after it, seeing its object
        assert b.commit_finish(token)[0] == [None]
        kv.delete(["land/w", "land/other"])


_HOLDER = """
import sys, time, kvstrata
kv = kvstrata.connect(sys.argv[1])
b = kv._backend
loc = b.reserve_finish(b.reserve_start(1 << 20))
b.commit_start([("land/killed", 4, loc.offset)], {"ttl": None, "nx": True, "mode": "memory"}, landing=True)
open(sys.argv[2], "w").write("sent")
time.sleep(60)
"""


def test_a_client_killed_while_its_commit_is_held_leaves_nothing(worker, tmp_path):
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath("src"), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, worker, str(ready)], env=env)
    try:
        with kvstrata.connect(worker) as kv:
            deadline = time.monotonic() + 30
            while not ready.exists() or not ready.read_text():
                assert time.monotonic() < deadline and child.poll() is None, "the holder never sent its commit"
                time.sleep(0.02)
            time.sleep(0.05)
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            deadline = time.monotonic() + 10
            while kv.stats()["clients"] > 1:
                assert time.monotonic() < deadline, "the worker never let go of the killed client"
                time.sleep(0.02)
            assert kv.exists(["land/killed"]) == [False] and kv.stats()["reserved_bytes"] == 0
            kv.set("land/after", b"still serving")
            assert kv.get("land/after") == b"still serving"
            kv.delete(["land/after"])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


class _Event:
    """A stand-in for a stage's CUDA event: still landing when first asked, then landed (or failed)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("simulated copy failure")


def _lists(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 255, (100 + i,), generator=g, dtype=torch.uint8)] for i in range(n)]


def test_mset_d2h_sends_its_last_commit_ahead_of_the_last_copies(worker, monkeypatch):
    with kvstrata.connect(worker) as kv:
        assert kv.mset_d2h(["land/warm"], _lists(1, 0)) == [None]  # now a reservation is held
        sent = []
        real = kv._backend.commit_start
        monkeypatch.setattr(
            kv._backend, "commit_start", lambda *a, **kw: sent.append(kw.get("landing", False)) or real(*a, **kw)
        )
        monkeypatch.setattr(device, "mark", lambda stream: _Event())
        monkeypatch.setattr(device, "stages", stages_of(2))
        keys = [f"land/m/{i}" for i in range(5)]
        src = _lists(5, 1)
        assert kv.mset_d2h(keys, src) == [None] * 5
        # three stages, each one's copies "in flight" when looked at: the first is committed once it landed,
        # the other two at once ahead of their copies, each held by the worker until it landed
        assert sent == [False, True, True]
        out = [[torch.zeros_like(t[0])] for t in src]
        assert kv.mget_h2d(keys, out) == [None] * 5
        assert all(torch.equal(a[0], b[0]) for a, b in zip(src, out))
        kv.delete([*keys, "land/warm"])


def test_mset_d2h_whose_last_copies_fail_shows_none_of_them_and_the_next_call_works(worker, monkeypatch):
    with kvstrata.connect(worker) as kv:
        assert kv.mset_d2h(["land/warm2"], _lists(1, 0)) == [None]
        events = iter([_Event(), _Event(), _Event(fail=True)])
        monkeypatch.setattr(device, "mark", lambda stream: next(events))
        monkeypatch.setattr(device, "stages", stages_of(1))
        keys = [f"land/f/{i}" for i in range(3)]
        first = _lists(3, 2)
        with pytest.raises(RuntimeError, match="simulated copy failure"):
            kv.mset_d2h(keys, first)  # the third stage's copies fail: its held commit is refused
        monkeypatch.undo()
        # the first two stages' bytes landed and their objects stand (as with any failure after a commit); the
        # third's object never became visible, and nothing is left half-made
        assert kv.exists(keys) == [True, True, False] and kv.stats()["creates_in_progress"] == 0
        assert [kv.get(k) for k in keys[:2]] == [t[0].numpy().tobytes() for t in first[:2]]
        src = _lists(1, 3)
        assert kv.mset_d2h(keys[2:], src) == [None]  # the reservation's head is where the worker says
        out = [[torch.zeros_like(src[0][0])]]
        assert kv.mget_h2d(keys[2:], out) == [None] and torch.equal(out[0][0], src[0][0])
        with pytest.raises(KvstrataError):
            kv.get("land/f/none")
        kv.delete([*keys, "land/warm2"])
