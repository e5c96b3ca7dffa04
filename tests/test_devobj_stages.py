"""Big many-key receives go to the broker in growing stages (DeviceObjectConfig.stage_bytes), on CPU over an
in-process broker: which requests go out, exact bytes either side first, mget too, and a stage whose request
fails fails only its own keys."""

from __future__ import annotations

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink

WAIT = 10
N = 1024  # int32 elements: 4 KiB per key


class CountingLink(InprocBrokerLink):
    """Records the keys of each subscribe/mget request; ``fail_at``: the request number (0-based) that raises."""

    def __init__(self, broker, name, fail_at=None):
        super().__init__(broker, name)
        self.requests: list[tuple[str, list[str]]] = []
        self.fail_at = fail_at

    def call(self, op, args, timeout=None):
        if op in ("subscribe", "mget"):
            if self.fail_at is not None and len(self.requests) == self.fail_at:
                self.requests.append((op, list(args["keys"])))
                raise errors.ConnectionLost("link dropped (test)")
            self.requests.append((op, list(args["keys"])))
        return super().call(op, args, timeout)


@pytest.fixture
def broker():
    return DeviceBroker()


@pytest.fixture
def make(broker):
    made = []

    def _make(name, stage_bytes=4 * N, link_cls=InprocBrokerLink, **kw):
        cfg = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05, stage_bytes=stage_bytes)
        link = link_cls(broker, name, **kw)
        c = DeviceObjects(link, device="cpu", config=cfg)
        made.append(c)
        return c, link

    yield _make
    for c in made:
        c.close()


def _src(k):
    return [[torch.arange(N, dtype=torch.int32) + 1000 * i] for i in range(k)]


@pytest.mark.parametrize("published_before", [10, 4, 0])
def test_subscribe_in_growing_stages_exact_bytes(make, broker, published_before):
    a, _ = make("a")
    b, link = make("b", link_cls=CountingLink)
    keys = [f"k{i}" for i in range(10)]
    src = _src(10)
    pubs = a.dev_publish(keys[:published_before], src[:published_before]) if published_before else []
    dst = [[torch.full((N,), -7, dtype=torch.int32)] for _ in keys]
    futs = b.dev_subscribe(keys, dst, timeout=WAIT)
    if published_before < 10:
        pubs += a.dev_publish(keys[published_before:], src[published_before:])
    for f in futs + pubs:
        assert f.result(WAIT) is None
    for d, s in zip(dst, src):
        assert torch.equal(d[0], s[0])
    # 4 KiB, then 8, 16, and what is left: 1, 2, 4, 3 keys, in order
    assert [len(k) for _, k in link.requests] == [1, 2, 4, 3]
    assert [k for _, ks in link.requests for k in ks] == keys
    assert broker.snapshot()["objects"] == {}


def test_mget_in_stages_and_small_calls_in_one_request(make):
    a, _ = make("a")
    b, link = make("b", link_cls=CountingLink)
    keys = [f"m{i}" for i in range(6)]
    src = _src(6)
    assert all(r is None for r in a.dev_mset(keys, src))
    dst = [[torch.zeros(N, dtype=torch.int32)] for _ in keys]
    for f in b.dev_mget(keys, dst, timeout=WAIT):
        f.result(WAIT)
    assert all(torch.equal(d[0], s[0]) for d, s in zip(dst, src))
    assert [len(k) for _, k in link.requests] == [1, 2, 3]
    link.requests.clear()
    small = [[torch.zeros(N // 4, dtype=torch.int32)] for _ in range(3)]  # 3 KiB < 2 stages' worth: one request
    for f in b.dev_subscribe(["x0", "x1", "x2"], small, timeout=0.05):
        with pytest.raises(errors.Timeout):
            f.result(WAIT)
    assert [len(k) for _, k in link.requests] == [3]


def test_stage_bytes_zero_sends_one_request(make):
    a, _ = make("a")
    b, link = make("b", stage_bytes=0, link_cls=CountingLink)
    keys = [f"z{i}" for i in range(10)]
    pubs = a.dev_publish(keys, _src(10))
    dst = [[torch.zeros(N, dtype=torch.int32)] for _ in keys]
    for f in b.dev_subscribe(keys, dst, timeout=WAIT) + pubs:
        f.result(WAIT)
    assert [len(k) for _, k in link.requests] == [10]


def test_a_failed_stage_fails_only_its_keys_and_later_ones(make, broker):
    a, _ = make("a")
    b, link = make("b", link_cls=CountingLink, fail_at=1)
    keys = [f"f{i}" for i in range(10)]
    src = _src(10)
    a.dev_publish(keys, src)
    dst = [[torch.full((N,), -7, dtype=torch.int32)] for _ in keys]
    futs = b.dev_subscribe(keys, dst, timeout=WAIT)  # never raises once a stage went out
    assert futs[0].result(WAIT) is None and torch.equal(dst[0][0], src[0][0])
    for f, d in zip(futs[1:], dst[1:]):
        with pytest.raises(errors.ConnectionLost):
            f.result(WAIT)
        assert torch.equal(d[0], torch.full((N,), -7, dtype=torch.int32))  # nothing written
    assert [len(k) for _, k in link.requests] == [1, 2]  # no request after the failed one


def test_first_stage_failure_raises(make):
    b, _ = make("b", link_cls=CountingLink, fail_at=0)
    dst = [[torch.zeros(N, dtype=torch.int32)] for _ in range(10)]
    with pytest.raises(errors.ConnectionLost):
        b.dev_subscribe([f"g{i}" for i in range(10)], dst, timeout=WAIT)


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_stage_bytes_validated(bad):
    with pytest.raises(ValueError, match="stage_bytes"):
        DeviceObjectConfig(stage_bytes=bad)


def test_a_stage_waits_for_the_one_before_and_always_says_it_is_done(make, monkeypatch):
    """The GPU path's stage jobs (run here with a stand-in for the copy wait): stage 2's wait starts once
    stage 1's ended, and a stage whose wait fails still lets the next one go."""
    import threading
    import time

    b, _ = make("b")
    log: list[tuple[str, str]] = []

    def finish(queued, done, by_rec):
        log.append((queued, "start"))
        time.sleep(0.1 if queued == "s1" else 0.0)
        log.append((queued, "end"))
        if queued == "s2":
            raise RuntimeError("copy wait failed (test)")

    monkeypatch.setattr(b, "_finish_batch", finish)
    raised: list[str] = []

    def job(queued, prev, mine):
        try:
            b._finish_stage(queued, prev, mine)
        except RuntimeError:  # the pool logs it (see _run_in_pool)
            raised.append(queued[0])

    e1, e2, e3 = threading.Event(), threading.Event(), threading.Event()
    jobs = [
        threading.Thread(target=job, args=(("s3", None, {}), e2, e3)),
        threading.Thread(target=job, args=(("s2", None, {}), e1, e2)),
        threading.Thread(target=job, args=(("s1", None, {}), None, e1)),
    ]
    for j in jobs:  # the later stages' jobs start first: they must still wait their turn
        j.start()
    for j in jobs:
        j.join(WAIT)
    assert log == [(s, w) for s in ("s1", "s2", "s3") for w in ("start", "end")]
    assert e1.is_set() and e2.is_set() and e3.is_set()
    assert raised == ["s2"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "devices", [pytest.param((0, 0), id="gpu0"), pytest.param((0, 1), id="gpu0-gpu1", marks=pytest.mark.multigpu)]
)
def test_staged_subscribe_and_mget_on_gpus_exact(devices):
    """Two clients of one process (the copy engine path, same GPU or across NVLink): 12 keys of 1 MiB in
    stages of 1, 2, 4 MiB..., publisher first and subscriber first, mset/mget; every byte checked."""
    src_dev, dst_dev = devices
    if torch.cuda.device_count() <= max(devices):
        pytest.skip(f"needs {max(devices) + 1} GPUs")
    broker = DeviceBroker()
    cfg = DeviceObjectConfig(poll_seconds=0.05, stage_bytes=1 << 20)
    a = DeviceObjects(InprocBrokerLink(broker, "a"), device=src_dev, config=cfg)
    b = DeviceObjects(InprocBrokerLink(broker, "b"), device=dst_dev, config=cfg)
    try:
        k, n = 12, (1 << 20) // 4
        g = torch.Generator().manual_seed(5)
        src = [torch.randint(-(2**30), 2**30, (n,), generator=g, dtype=torch.int32).to(src_dev) for _ in range(k)]
        keep = [t.cpu() for t in src]
        for first in ("publisher", "subscriber"):
            keys = [f"{first}/{i}" for i in range(k)]
            with torch.cuda.device(dst_dev):
                dst = [torch.full((n,), 7, dtype=torch.int32, device=dst_dev) for _ in range(k)]
            pubs = a.dev_publish(keys, [[t] for t in src]) if first == "publisher" else []
            with torch.cuda.device(dst_dev):
                subs = b.dev_subscribe(keys, [[d] for d in dst], timeout=WAIT)
            if first == "subscriber":
                pubs = a.dev_publish(keys, [[t] for t in src])
            for f in subs + pubs:
                assert f.result(WAIT) is None
            assert all(torch.equal(d.cpu(), s) for d, s in zip(dst, keep)), f"{first} first: bytes differ"
        keys = [f"m/{i}" for i in range(k)]
        assert a.dev_mset(keys, [[t] for t in src]) == [None] * k
        with torch.cuda.device(dst_dev):
            dst = [torch.full((n,), 7, dtype=torch.int32, device=dst_dev) for _ in range(k)]
            for f in b.dev_mget(keys, [[d] for d in dst], timeout=WAIT):
                assert f.result(WAIT) is None
        assert all(torch.equal(d.cpu(), s) for d, s in zip(dst, keep)), "mget: bytes differ"
        assert all(torch.equal(s.cpu(), c) for s, c in zip(src, keep)), "sources changed"
    finally:
        b.close()
        a.close()
