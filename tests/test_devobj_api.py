"""DeviceObjects client over an in-process broker, on CPU (same-process peers, allow_cpu): futures,
either side first, timeouts, one-shot forgetting, many readers, owner death, broadcast chains,
no deadlock between many pairs in both directions, and bad input rejected before anything moves."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink
from kvstrata.devobj.api import check_tensor_lists

CFG = DeviceObjectConfig(allow_cpu=True, poll_seconds=0.05, chunk_bytes=4096)
WAIT = 10  # seconds: a hang fails the test instead of blocking the run


@pytest.fixture
def broker():
    return DeviceBroker()


@pytest.fixture
def make(broker):
    made = []

    def _make(name: str | None = None) -> DeviceObjects:
        c = DeviceObjects(InprocBrokerLink(broker, name), device="cpu", config=CFG)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def poisoned_like(ts):
    return [torch.full_like(t, 7) for t in ts]


@pytest.mark.parametrize("publisher_first", [True, False])
def test_publish_subscribe_either_side_first(make, broker, publisher_first):
    a, b = make("a"), make("b")
    src = [rand(3, 5), rand(41, dtype=torch.bfloat16), torch.arange(9, dtype=torch.int64)]
    keep = [t.clone() for t in src]
    dst = poisoned_like(src)
    if publisher_first:
        (pf,) = a.dev_publish(["k"], [src])
        (sf,) = b.dev_subscribe(["k"], [dst], timeout=WAIT)
    else:
        (sf,) = b.dev_subscribe(["k"], [dst], timeout=WAIT)
        (pf,) = a.dev_publish(["k"], [src])
    sf.result(WAIT)
    pf.result(WAIT)  # released only after the subscriber completed
    for d, s, k in zip(dst, src, keep):
        assert torch.equal(d, k) and torch.equal(s, k)
    assert broker.snapshot()["objects"] == {}


def test_one_shot_is_forgotten_second_subscriber_times_out(make):
    a, b, c = make(), make(), make()
    src = [rand(16)]
    a.dev_publish(["k"], [src])
    b.dev_subscribe(["k"], [poisoned_like(src)], timeout=WAIT)[0].result(WAIT)
    f = c.dev_subscribe(["k"], [poisoned_like(src)], timeout=0.1)[0]
    with pytest.raises(errors.Timeout):
        f.result(WAIT)


def test_subscribe_timeout_and_batch_results_per_key(make):
    a, b = make(), make()
    a.dev_publish(["there"], [[rand(4)]])
    dst_there, dst_missing = [torch.zeros(4)], [torch.zeros(4)]
    f_there, f_missing = b.dev_subscribe(["there", "missing"], [dst_there, dst_missing], timeout=0.1)
    f_there.result(WAIT)
    with pytest.raises(errors.Timeout):
        f_missing.result(WAIT)
    assert torch.equal(dst_missing[0], torch.zeros(4))


def test_size_and_dtype_mismatch_transfers_nothing(make, broker):
    a, b = make(), make()
    a.dev_publish(["k"], [[rand(4, 4)]])
    wrong_shape = [torch.full((4, 5), 7.0)]
    wrong_dtype = [torch.full((4, 4), 7, dtype=torch.float16)]
    f1, f2 = b.dev_subscribe(["k", "k2"], [wrong_shape, [torch.zeros(1)]], timeout=0.05)
    with pytest.raises(ValueError, match="tensor 0"):
        f1.result(WAIT)
    with pytest.raises(errors.Timeout):
        f2.result(WAIT)
    with pytest.raises(ValueError, match="float16"):
        b.dev_subscribe(["k"], [wrong_dtype])[0].result(WAIT)
    assert torch.equal(wrong_shape[0], torch.full((4, 5), 7.0))
    assert broker.snapshot()["objects"]["k"]["state"] == "ready"  # still there for a correct receiver


def test_duplicate_publish_fails_that_key_only(make):
    a = make()
    a.dev_publish(["k"], [[rand(2)]])
    f_dup, f_new = a.dev_publish(["k", "j"], [[rand(2)], [rand(2)]])
    with pytest.raises(errors.KeyExists):
        f_dup.result(WAIT)
    assert not f_new.done()  # waits for its subscriber


def test_mset_mget_many_readers_many_times(make):
    owner = make("owner")
    w = [rand(33, 7), rand(5, dtype=torch.float16)]
    assert owner.dev_mset(["w"], [w]) == [None]
    assert isinstance(owner.dev_mset(["w"], [w])[0], errors.KeyExists)
    readers = [make() for _ in range(4)]
    outs: list[list[torch.Tensor]] = []
    lock = threading.Lock()

    def read(r: DeviceObjects) -> None:
        for _ in range(5):
            dst = poisoned_like(w)
            r.dev_mget(["w"], [dst], timeout=WAIT)[0].result(WAIT)
            with lock:
                outs.append(dst)

    threads = [threading.Thread(target=read, args=(r,)) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(outs) == 20
    for dst in outs:
        assert all(torch.equal(d, s) for d, s in zip(dst, w))


def test_mget_waits_for_mset(make):
    owner, reader = make(), make()
    dst = [torch.zeros(8)]
    f = reader.dev_mget(["later"], [dst], timeout=WAIT)[0]
    src = [torch.arange(8.0)]
    owner.dev_mset(["later"], [src])
    f.result(WAIT)
    assert torch.equal(dst[0], src[0])


def test_delete_and_missing(make):
    owner, other, reader = make(), make(), make()
    owner.dev_mset(["w"], [[rand(3)]])
    assert isinstance(other.dev_delete(["w"])[0], errors.ServerError)  # not its key
    assert owner.dev_delete(["w", "nope"])[0] is None
    assert isinstance(owner.dev_delete(["nope"])[0], errors.KeyNotFound)
    with pytest.raises(errors.Timeout):
        reader.dev_mget(["w"], [[torch.zeros(3)]], timeout=0.05)[0].result(WAIT)
    owner.dev_mset(["w"], [[rand(3)]])  # the key can be registered again
    reader.dev_mget(["w"], [[torch.zeros(3)]], timeout=WAIT)[0].result(WAIT)
    reader.dev_local_delete(["w"])


def test_publisher_close_fails_its_futures_and_keys_vanish(make, broker):
    a, b = make(), make()
    (pf,) = a.dev_publish(["k"], [[rand(3)]])
    a.close()
    with pytest.raises(errors.ClosedError):
        pf.result(WAIT)
    assert broker.snapshot()["objects"] == {}
    with pytest.raises(errors.Timeout):
        b.dev_subscribe(["k"], [[torch.zeros(3)]], timeout=0.05)[0].result(WAIT)
    with pytest.raises(errors.ClosedError):
        a.dev_publish(["x"], [[rand(1)]])


def test_subscriber_close_fails_its_waits(make):
    b = make()
    (f,) = b.dev_subscribe(["never"], [[torch.zeros(2)]])
    b.close()
    with pytest.raises(errors.ClosedError):
        f.result(WAIT)


@pytest.mark.parametrize("nbytes", [4096 * 3 + 12, 100])
def test_broadcast_to_three_receivers(make, nbytes):
    sender = make("s")
    receivers = [make(f"r{i}") for i in range(3)]
    src = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8), rand(17, 3)]
    keep = [t.clone() for t in src]
    dsts = [poisoned_like(src) for _ in receivers]
    futs = [r.dev_subscribe(["b"], [d], timeout=WAIT)[0] for r, d in zip(receivers[:2], dsts)]
    sf = sender.dev_broadcast("b", src, receivers=3)
    futs.append(receivers[2].dev_subscribe(["b"], [dsts[2]], timeout=WAIT)[0])
    for f in futs:
        f.result(WAIT)
    sf.result(WAIT)
    for dst in dsts:
        assert all(torch.equal(d, k) for d, k in zip(dst, keep))


def test_broadcast_bad_arguments(make):
    s = make()
    with pytest.raises(ValueError, match="receivers"):
        s.dev_broadcast("b", [rand(2)], receivers=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        s.dev_broadcast("b", [rand(2)], receivers=2, chunk_bytes=10)


def test_no_deadlock_many_pairs_both_directions(make):
    """Two clients exchange 40 keys each way, subscribes and publishes interleaved in both orders."""
    x, y = make("x"), make("y")
    n = 40
    srcs = {f"{d}{i}": [torch.full((64,), float(i)), torch.arange(i + 1)] for d in "xy" for i in range(n)}
    results: dict[str, list] = {}
    errs: list[BaseException] = []

    def side(me: DeviceObjects, mine: str, theirs: str) -> None:
        try:
            futs = []
            for i in range(n):
                dst = poisoned_like(srcs[f"{theirs}{i}"])
                results[f"{theirs}{i}"] = dst
                if i % 2:
                    futs += me.dev_subscribe([f"{theirs}{i}"], [dst], timeout=WAIT)
                    futs += me.dev_publish([f"{mine}{i}"], [srcs[f"{mine}{i}"]])
                else:
                    futs += me.dev_publish([f"{mine}{i}"], [srcs[f"{mine}{i}"]])
                    futs += me.dev_subscribe([f"{theirs}{i}"], [dst], timeout=WAIT)
            for f in futs:
                f.result(WAIT)
        except BaseException as exc:
            errs.append(exc)

    tx = threading.Thread(target=side, args=(x, "x", "y"))
    ty = threading.Thread(target=side, args=(y, "y", "x"))
    tx.start()
    ty.start()
    tx.join(3 * WAIT)
    ty.join(3 * WAIT)
    assert not tx.is_alive() and not ty.is_alive(), "deadlock"
    assert not errs, errs
    for k, dst in results.items():
        assert all(torch.equal(d, s) for d, s in zip(dst, srcs[k]))


CUDA0 = torch.device("cuda", 0)


def test_cpu_tensor_rejected_with_clear_message():
    msg = r"tensor_lists\[0\]\[0\] \(key 'k'\): a cpu tensor; device objects live in GPU memory \(expected cuda:0\)"
    with pytest.raises(ValueError, match=msg):
        check_tensor_lists(["k"], [[torch.zeros(2)]], CUDA0, allow_cpu=False)
    with pytest.raises(ValueError, match=msg):  # allow_cpu never lets CPU tensors onto a CUDA client
        check_tensor_lists(["k"], [[torch.zeros(2)]], CUDA0, allow_cpu=True)


@pytest.mark.parametrize(
    ("keys", "lists", "exc", "match"),
    [
        (["a", "a"], [[torch.zeros(1)], [torch.zeros(1)]], ValueError, "duplicate key 'a'"),
        ("a", [[torch.zeros(1)]], TypeError, "keys"),
        (["a"], [[torch.zeros(1)], [torch.zeros(1)]], ValueError, "2 lists for 1 keys"),
        (["a"], [[]], TypeError, r"tensor_lists\[0\]"),
        (["a"], [[[1, 2]]], TypeError, "torch.Tensor"),
        (["a"], [[torch.zeros(4, 4).t()]], ValueError, "not contiguous"),
        ([""], [[torch.zeros(1)]], ValueError, r"keys\[0\]: must not be empty"),
        (["bad\ud800"], [[torch.zeros(1)]], ValueError, r"keys\[0\]: .* not valid Unicode"),
        (["k" * 1025], [[torch.zeros(1)]], ValueError, r"keys\[0\]: 1025 bytes long"),
    ],
)
def test_bad_input(keys, lists, exc, match):
    with pytest.raises(exc, match=match):
        check_tensor_lists(keys, lists, torch.device("cpu"), allow_cpu=True)


def test_bad_input_through_client_registers_nothing(make, broker):
    a = make()
    with pytest.raises(ValueError, match="not contiguous"):
        a.dev_publish(["ok", "bad"], [[rand(3)], [torch.zeros(3, 3).t()]])
    assert broker.snapshot()["objects"] == {}
    with pytest.raises(ValueError, match="timeout"):
        a.dev_subscribe(["k"], [[rand(1)]], timeout=-1)


def test_config_validation():
    with pytest.raises(ValueError, match="transport"):
        DeviceObjectConfig(transport="tcp")
    with pytest.raises(ValueError, match="chunk_bytes"):
        DeviceObjectConfig(chunk_bytes=1)
    with pytest.raises(ValueError, match="device"):
        DeviceObjects(InprocBrokerLink(DeviceBroker()), device="cpu")


# -- through a real worker process's code path (the worker in this process, clients over unix sockets) --
@pytest.fixture
def worker(tmp_path):
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=64 << 20, disk_dir="")).start()
    yield w
    w.stop()


def test_publish_subscribe_through_worker_and_client_death(worker):
    import kvstrata

    a, b = kvstrata.connect(worker.address), kvstrata.connect(worker.address)
    try:
        a.device_objects(device="cpu", config=CFG)
        b.device_objects(device="cpu", config=CFG)
        src = [torch.arange(100, dtype=torch.int32), rand(7, 3)]
        dst = poisoned_like(src)
        (sf,) = b.dev_subscribe(["k"], [dst], timeout=WAIT)
        (pf,) = a.dev_publish(["k"], [src])
        sf.result(WAIT)
        pf.result(WAIT)
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
        assert a.dev_mset(["w"], [src]) == [None]
        b.dev_mget(["w"], [poisoned_like(src)], timeout=WAIT)[0].result(WAIT)
        assert worker.devobj_broker.snapshot()["objects"].keys() == {"w"}
        a.close()  # its connections drop: its keys vanish
        with pytest.raises(errors.Timeout):
            b.dev_mget(["w"], [poisoned_like(src)], timeout=0.1)[0].result(WAIT)
        assert worker.devobj_broker.snapshot()["objects"] == {}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("start", "n"), [(16, 4096), (3, 8), (8, 13), (0, 0)])
def test_copy_bytes_kernel_and_memcpy_exact(start, n):
    from kvstrata.devobj.broadcast import _copy_bytes

    src = torch.randint(0, 255, (4200,), dtype=torch.uint8)
    for kernel in (True, False):
        dst = torch.full_like(src, 7)
        _copy_bytes(dst[start : start + n], src[start : start + n], kernel=kernel)
        assert torch.equal(dst[start : start + n], src[start : start + n])
        assert bool((dst[:start] == 7).all()) and bool((dst[start + n :] == 7).all())


def test_close_from_a_future_callback(make):
    a, b = make(), make()
    closed = threading.Event()
    (sf,) = b.dev_subscribe(["k"], [[torch.zeros(3)]], timeout=WAIT)
    sf.add_done_callback(lambda f: (b.close(), closed.set()))  # runs on b's event thread
    a.dev_publish(["k"], [[rand(3)]])[0].result(WAIT)
    assert closed.wait(WAIT)
    with pytest.raises(errors.ClosedError):
        b.dev_subscribe(["j"], [[torch.zeros(3)]])


def test_worker_going_away_fails_waiters(worker):
    import kvstrata

    b = kvstrata.connect(worker.address)
    try:
        b.device_objects(device="cpu", config=CFG)
        (f,) = b.dev_subscribe(["never"], [[torch.zeros(2)]])  # no timeout: only the worker's end can end it
        worker.stop()
        with pytest.raises(errors.KvstrataError):
            f.result(WAIT)
    finally:
        b.close()


def test_cancelled_subscribe_is_withdrawn_and_writes_nothing(make, broker):
    a, b, c = make(), make(), make()
    dst = [torch.full((3,), 7.0)]
    (f,) = b.dev_subscribe(["k"], [dst])
    assert f.cancel()
    assert broker.snapshot()["waiters"] == 0
    assert not b._cancelled  # withdrawn before any match: nothing left to decline, nothing kept
    src = [rand(3)]
    (pf,) = a.dev_publish(["k"], [src])
    other = [torch.zeros(3)]
    c.dev_subscribe(["k"], [other], timeout=WAIT)[0].result(WAIT)  # the object went to the next one
    pf.result(WAIT)
    assert torch.equal(other[0], src[0]) and torch.equal(dst[0], torch.full((3,), 7.0))


# -- failures surface as the futures' exceptions, never as hangs --------------------------------------
class _NeverDone:
    """A CUDA event stand-in whose work never finishes (a source ready event that never fires)."""

    def query(self) -> bool:
        return False


def test_wait_event_is_bounded_and_names_the_step():
    from kvstrata.devobj.debug import wait_event

    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += max(s, 1e-3)

    with pytest.raises(errors.Timeout, match="copy of 'k'"):
        wait_event(_NeverDone(), 0.5, "copy of 'k'", clock=lambda: now[0], sleep=sleep)
    wait_event(type("Done", (), {"query": lambda self: True})(), 0.5, "done at once")


def test_stuck_copy_fails_the_receive_and_returns_the_object(make, broker, monkeypatch):
    from kvstrata.devobj import api

    a = make()
    stuck = DeviceObjects(
        InprocBrokerLink(broker), device="cpu", config=DeviceObjectConfig(**{**vars(CFG), "copy_timeout": 0.2})
    )
    try:
        real = api.DeviceObjects._enqueue_batch

        def never(self, items, fail):
            queued, done = real(self, items, fail)
            return queued, ((_NeverDone(), 0) if self is stuck else done)  # (end event, its device)

        monkeypatch.setattr(api.DeviceObjects, "_enqueue_batch", never)
        src = [rand(5)]
        (pf,) = a.dev_publish(["k"], [src])
        with pytest.raises(errors.Timeout, match="copy of 'k'"):
            stuck.dev_subscribe(["k"], [[torch.zeros(5)]], timeout=WAIT)[0].result(WAIT)
        assert not pf.done()  # a receive that failed is not a delivery
        dst = [torch.zeros(5)]
        make().dev_subscribe(["k"], [dst], timeout=WAIT)[0].result(WAIT)  # the object went back to the broker
        pf.result(WAIT)
        assert torch.equal(dst[0], src[0])
    finally:
        stuck.close()


class _Fatal(BaseException):
    pass


def test_event_thread_death_fails_pending_futures(make, broker, monkeypatch):
    from kvstrata.devobj import api

    b = make()
    (f,) = b.dev_subscribe(["k"], [[torch.zeros(2)]], timeout=WAIT)

    def boom(self, ev):
        raise _Fatal("injected")

    monkeypatch.setattr(api.DeviceObjects, "_dispatch", boom)
    make().dev_publish(["k"], [[rand(2)]])  # b's event thread gets the match, and dies on it
    with pytest.raises(errors.ServerError, match="event thread died: _Fatal: injected"):
        f.result(WAIT)
    b._poller.join(WAIT)
    assert not b.debug_state()["poller_alive"]


def test_debug_state_names_what_is_pending(make):
    b = make()
    b.dev_subscribe(["k"], [[torch.zeros(2)]], timeout=WAIT)
    b.dev_publish(["p"], [[rand(2)]])
    state = b.debug_state()
    assert list(state["waiting"].values()) == ["k"]
    assert [k for k, _ in state["owned"].values()] == ["p"]
    assert state["poller_alive"] and not state["closed"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("copy_timeout", 0),
        ("copy_timeout", float("nan")),
        ("poll_seconds", float("nan")),  # a NaN or infinite poll ended the event thread: receives hung
        ("poll_seconds", float("inf")),
        ("poll_seconds", "1"),
        ("chunk_bytes", 1e9),
        ("copy_threads", 2.5),
        ("copy_threads", True),
    ],
)
def test_config_numbers_validated(field, value):
    with pytest.raises(errors.InvalidValue, match=field):
        DeviceObjectConfig(**{field: value})


def test_delete_returns_once_reads_in_flight_finished(make):
    """The documented way to change a dev_mset object: dev_delete, write, register again. A read matched before
    the delete copied after it (the owner already writing) and reported success with torn data."""
    a, c = make("a"), make("c")
    buf = torch.zeros(8)
    assert a.dev_mset(["m"], [[buf]]) == [None]
    order = []
    copy = c._enqueue_batch

    def owner():
        order.append(("deleted", a.dev_delete(["m"])))
        buf[:4] = 1.0  # the new data, written as soon as the delete allows

    def slow_copy(items, fail, **kw):  # the read is matched: the owner deletes while it is about to copy
        threading.Thread(target=owner).start()
        time.sleep(0.3)
        order.append(("copied", None))
        return copy(items, fail, **kw)

    c._enqueue_batch = slow_copy
    dst = torch.full((8,), -1.0)
    assert c.dev_mget(["m"], [[dst]], timeout=WAIT)[0].result(WAIT) is None
    assert torch.equal(dst, torch.zeros(8))  # the old bytes whole, never half new
    deadline = time.monotonic() + WAIT
    while len(order) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == [("copied", None), ("deleted", [None])]
    c._enqueue_batch = copy
    with pytest.raises(errors.Timeout):  # later reads: nothing there
        c.dev_mget(["m"], [[dst]], timeout=0)[0].result(WAIT)


def test_a_withdrawn_broadcast_receiver_leaves_the_chain(make, broker):
    s, r1, r2, r3 = make("s"), make("r1"), make("r2"), make("r3")
    src = torch.arange(8.0)
    sent = s.dev_broadcast("bk", [src], 2)
    (gone,) = r1.dev_subscribe(["bk"], [[torch.zeros(8)]], timeout=None)
    deadline = time.monotonic() + WAIT
    while not broker._objects["bk"].pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone.cancel()
    assert broker._objects["bk"].pending == []  # the broadcast waits for another receiver instead
    dsts = [torch.zeros(8), torch.zeros(8)]
    futs = [r.dev_subscribe(["bk"], [[d]], timeout=WAIT)[0] for r, d in zip((r2, r3), dsts)]
    assert [f.result(WAIT) for f in futs] == [None, None] and sent.result(WAIT) is None
    assert all(torch.equal(d, src) for d in dsts)


def test_timeouts_beyond_the_clock_mean_forever(make):
    a, b = make(), make()
    dst = torch.zeros(4)
    (f,) = b.dev_subscribe(["later"], [[dst]], timeout=10**400)  # once an OverflowError inside the broker
    a.dev_publish(["later"], [[torch.ones(4)]])
    assert f.result(WAIT) is None and dst[0] == 1
    with pytest.raises(errors.InvalidType):
        b.dev_subscribe(["x"], [[dst]], timeout="1")
    with pytest.raises(errors.InvalidValue):
        b.dev_subscribe(["x"], [[dst]], timeout=float("nan"))


def test_a_registered_publish_cannot_be_cancelled_only_deleted(make):
    a, b = make(), make()
    src = torch.ones(4)
    (pub,) = a.dev_publish(["p"], [[src]])
    assert not pub.cancel() and pub.running()  # cancel() used to say True and withdraw nothing
    assert a.dev_delete(["p"]) == [None]
    with pytest.raises(errors.KeyNotFound):
        pub.result(WAIT)
    with pytest.raises(errors.Timeout):
        b.dev_subscribe(["p"], [[torch.zeros(4)]], timeout=0.1)[0].result(WAIT)


def test_parameters_are_sent_and_filled(make):
    """Tensors that require grad (model parameters) move like any other; a copy into one used to fail the whole
    batch with a bare RuntimeError."""
    a, b = make(), make()
    weight = torch.nn.Parameter(torch.arange(4.0))
    target = [torch.nn.Parameter(torch.zeros(4)), torch.zeros(4), torch.nn.Parameter(torch.zeros(4))]
    a.dev_publish(["w0", "w1", "w2"], [[weight], [torch.ones(4)], [weight]])
    futs = b.dev_subscribe(["w0", "w1", "w2"], [[t] for t in target], timeout=WAIT)
    assert [f.result(WAIT) for f in futs] == [None, None, None]
    assert torch.equal(target[0].detach(), weight.detach()) and target[1][0] == 1 and target[0].requires_grad


def test_errors_name_the_key_and_the_call_that_reads_it(make):
    a, b = make(), make()
    a.dev_mset(["reg"], [[torch.ones(4)]])
    a.dev_publish(["pub"], [[torch.ones(4)]])
    with pytest.raises(errors.Timeout, match="'reg' was registered with dev_mset: dev_mget reads it"):
        b.dev_subscribe(["reg"], [[torch.zeros(4)]], timeout=0.1)[0].result(WAIT)
    with pytest.raises(errors.Timeout, match="'pub' is published for one receiver: dev_subscribe takes it"):
        b.dev_mget(["pub"], [[torch.zeros(4)]], timeout=0.1)[0].result(WAIT)
    with pytest.raises(errors.InvalidValue, match="'pub': tensor_lists: tensor 0 is float32"):
        b.dev_subscribe(["pub"], [[torch.zeros(5)]], timeout=WAIT)[0].result(WAIT)


def test_closed_clients_refuse_device_objects(make):
    import kvstrata

    kv = kvstrata.connect(embedded=True, memory_bytes="16MiB")
    kv.close()
    with pytest.raises(errors.ClosedError):  # it used to start a new DeviceObjects and register the key
        kv.dev_mset(["after"], [[torch.ones(4)]])
    c = make()
    c.close()
    with pytest.raises(errors.ClosedError):
        c.dev_delete(["k"])
    with pytest.raises(errors.ClosedError):
        c.dev_local_delete(["k"])


class _BytesOnlyNccl:
    """CuPy 14's NcclCommunicator: the unique id must be bytes."""

    class NcclCommunicator:
        def __init__(self, ndev: int, comm_id: object, rank: int) -> None:
            if not isinstance(comm_id, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
            self.args = (ndev, comm_id, rank)


class _TupleOnlyNccl:
    """Older CuPy: the unique id is a tuple of (signed) chars."""

    class NcclCommunicator:
        def __init__(self, ndev: int, comm_id: object, rank: int) -> None:
            if not isinstance(comm_id, tuple):
                raise TypeError("expected tuple")
            self.args = (ndev, comm_id, rank)


def test_nccl_unique_id_survives_msgpack_for_either_cupy_form() -> None:
    import msgpack

    from kvstrata.devobj.nccl import _communicator

    raw = bytes(range(120, 248))  # values above 127: the signed/unsigned distinction matters
    as_sent = msgpack.unpackb(msgpack.packb(list(raw)))
    comm = _communicator(_BytesOnlyNccl, as_sent, 1)
    assert comm.args == (2, raw, 1)
    signed = [x - 256 if x > 127 else x for x in raw]
    comm = _communicator(_TupleOnlyNccl, msgpack.unpackb(msgpack.packb(signed)), 0)
    assert comm.args == (2, tuple(signed), 0)
    assert _communicator(_BytesOnlyNccl, signed, 0).args[1] == raw  # signed chars map to the same bytes


def test_events_for_transfers_never_known_here_are_dropped_after_a_while(make, monkeypatch):
    from kvstrata.devobj import events

    c = make()
    now = [1000.0]
    monkeypatch.setattr(events, "_clock", lambda: now[0])
    c._dispatch({"type": "transfer_done", "tid": 91})  # e.g. its transfer failed here first: nothing claims it
    c._dispatch({"type": "member_ready", "tid": 91})
    assert list(c._early) == [("tid", 91)] and len(c._early[("tid", 91)]) == 2
    now[0] += events.EARLY_KEEP_S / 2
    c._dispatch({"type": "released", "obj": 5, "key": "k"})  # still young: both kept
    assert set(c._early) == {("tid", 91), ("obj", 5)}
    now[0] += events.EARLY_KEEP_S / 2 + 1
    c._dispatch({"type": "chain_pred", "tid": 92})
    assert set(c._early) == {("obj", 5), ("tid", 92)}  # the oldest went


@pytest.mark.parametrize("seed", [1, 2])
def test_registrations_reads_and_deletes_by_two_owners_match_a_model(make, seed):
    """Seeded random ``dev_mset`` / ``dev_mget`` / ``dev_delete`` by two owners and two readers over a few keys, each
    re-registered with another size and content after its delete: every read gets the current registration's bytes
    (never a record a reader kept from before), a deleted key is never read, and a second registration is KeyExists."""
    import random

    owners, readers = [make("o1"), make("o2")], [make("r1"), make("r2")]
    rng = random.Random(seed)
    model: dict[str, tuple[int, list[torch.Tensor]]] = {}  # key -> (its owner, its tensors)
    for step in range(300):
        key, op = f"k{rng.randrange(6)}", rng.randrange(5)
        if op == 0:
            who = rng.randrange(2)
            src = [torch.arange(rng.choice((3, 17, 100)), dtype=torch.float32) + step]
            got = owners[who].dev_mset([key], [src])[0]
            if key in model:
                assert isinstance(got, errors.KeyExists), (step, got)
            else:
                assert got is None, (step, got)
                model[key] = (who, src)
        elif op == 4:
            if key in model:
                assert owners[model.pop(key)[0]].dev_delete([key])[0] is None, step
        elif key in model:
            src = model[key][1]
            dst = poisoned_like(src)
            rng.choice(readers).dev_mget([key], [dst], timeout=WAIT)[0].result(WAIT)
            assert all(torch.equal(d, s) for d, s in zip(dst, src)), f"step {step}: stale bytes for {key}"
        else:
            with pytest.raises((errors.Timeout, errors.KeyNotFound)):
                rng.choice(readers).dev_mget([key], [[torch.zeros(3)]], timeout=0.0)[0].result(WAIT)


def test_a_forked_child_cannot_use_the_parents_device_objects(make):
    import os

    c = make()
    c.dev_mset(["warm"], [[torch.ones(4)]])
    pid = os.fork()
    if pid == 0:  # the child: its calls would go through the parent's connections and event thread
        code = 1
        try:
            c.dev_subscribe(["late"], [[torch.zeros(4)]], timeout=1)
        except errors.ClosedError as exc:
            code = 0 if "fork()" in str(exc) else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert c.dev_mget(["warm"], [[torch.zeros(4)]], timeout=WAIT)[0].result(WAIT) is None  # the parent goes on


def test_a_dead_event_thread_refuses_calls_and_lets_the_broker_go_on(make, broker):
    a, b, c = make("a"), make("b"), make("c")
    (lost,) = b.dev_subscribe(["x"], [[torch.zeros(4)]], timeout=WAIT)

    def die(ev):  # what gets past the event thread's guards (SystemExit from a callback, say)
        raise SystemExit(3)

    b._dispatch = die
    (sent,) = a.dev_publish(["x"], [[torch.ones(4)]])  # matched to b, whose thread dies on the match
    deadline = time.monotonic() + WAIT
    while b._poller.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(errors.ServerError, match="event thread died"):
        lost.result(WAIT)
    with pytest.raises(errors.ConnectionLost, match="event thread died"):
        b.dev_publish(["y"], [[torch.ones(4)]])  # accepted before, and its future never settled
    assert "b" not in broker._clients  # the broker was told: the object b had matched is there for others
    dst = torch.zeros(4)
    assert c.dev_subscribe(["x"], [[dst]], timeout=WAIT)[0].result(WAIT) is None and dst[0] == 1
    assert sent.result(WAIT) is None


def test_waiting_on_a_receive_inside_a_callback_is_refused_not_a_deadlock(make):
    a, b = make(), make()
    seen = []

    def wait_for_inner(_):
        (inner,) = b.dev_subscribe(["inner"], [[torch.zeros(4)]], timeout=WAIT)
        try:
            inner.result(WAIT)  # on b's event thread, which is the one that would deliver it
        except errors.DeadlockError as exc:
            seen.append(exc)
        inner.cancel()

    (outer,) = b.dev_subscribe(["outer"], [[torch.zeros(4)]], timeout=WAIT)
    outer.add_done_callback(wait_for_inner)
    a.dev_publish(["outer"], [[torch.ones(4)]])
    outer.result(WAIT)
    deadline = time.monotonic() + WAIT
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and "event thread" in str(seen[0])


def test_matched_waiters_leave_no_deadlines_behind(make, broker):
    a, b = make(), make()
    for i in range(300):  # subscriber first, an hour's timeout: matched at once, the deadline entry stays
        (f,) = b.dev_subscribe([f"k{i}"], [[torch.zeros(2)]], timeout=3600)
        a.dev_publish([f"k{i}"], [[torch.ones(2)]])
        f.result(WAIT)
    assert len(broker._deadlines) <= 2 * len(broker._waiter_by_id) + 65


def test_a_reader_forgets_what_it_read_from_an_owner_that_left(make, broker):
    r = make("reader")
    for gen in range(3):
        owner = make(f"owner{gen}")
        keys = [f"g{gen}-{i}" for i in range(20)]
        owner.dev_mset(keys, [[torch.ones(2)] for _ in keys])
        assert [f.result(WAIT) for f in r.dev_mget(keys, [[torch.zeros(2)] for _ in keys], timeout=WAIT)] == [None] * 20
        owner.close()
    deadline = time.monotonic() + WAIT
    while (r._read or r._records) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not r._read and not r._records  # 60 entries stayed, one per object ever read


def test_pid_watch_keeps_no_descriptor_for_exited_peers():
    import subprocess
    import sys

    from kvstrata.devobj._core import PidWatch

    watch = PidWatch()
    for _ in range(6):
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        assert watch.alive(p.pid)
        p.wait()
    assert watch.alive(os.getpid()) and len(watch._polls) <= 2  # the one exited last may still be there
    watch.close()


def test_an_aborted_broadcast_leader_settles_once_it_stopped_writing(make, monkeypatch):
    """A leader's future failed at the abort while its step still copied chunks into the caller's tensors (a
    member waited for its leader to stop; a leader did not wait for itself)."""
    from kvstrata.devobj import broadcast

    gpus = {"s": "GPU-A", "r0": "GPU-A", "r1": "GPU-B"}  # two groups: r0 and r1 both lead, both pull
    monkeypatch.setattr(DeviceObjects, "_device_info", lambda self: {"uuid": gpus[self.link.client_id], "index": -1})
    real_pump = broadcast.pump
    copying = threading.Event()

    def slow_pump(n, enqueue, **kw):  # each chunk's copy takes a while (on a GPU: queued, not yet drained)
        def slowly(c):
            copying.set()
            time.sleep(0.05)
            return enqueue(c)

        return real_pump(n, slowly, **kw)

    monkeypatch.setattr(broadcast, "pump", slow_pump)
    s, r0, r1 = make("s"), make("r0"), make("r1")
    n = 40000  # 160 KB in 4 KiB chunks: ~2 s of copying
    dst = torch.zeros(n)
    sent = s.dev_broadcast("k", [torch.ones(n)], receivers=2)
    (mine,) = r0.dev_subscribe(["k"], [[dst]], timeout=WAIT)
    r1.dev_subscribe(["k"], [[torch.zeros(n)]], timeout=WAIT)
    assert copying.wait(WAIT)  # (not a fixed pause: a receiver gone before the copies began is no abort)
    r1.close()  # another receiver goes away: the broadcast is aborted for all
    with pytest.raises(errors.ServerError, match="went away"):
        mine.result(WAIT)
    dst.fill_(-1)  # the caller has its buffer back
    time.sleep(0.3)
    assert int((dst != -1).sum()) == 0  # and nothing writes into it any more
    with pytest.raises(errors.ServerError):
        sent.result(WAIT)
