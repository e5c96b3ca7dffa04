"""Device objects on real GPUs: processes (torch.multiprocessing spawn) talking through a real worker
(hosted by the test process, unix socket), CUDA IPC on two GPUs and on one GPU, broadcast chains,
the NCCL path, publisher death, and bad input. Every copy is checked for exact equality against data
regenerated from the same seed; receivers' buffers are poisoned beforehand."""

from __future__ import annotations

import os
import time

import pytest
import torch

from kvstrata import errors
from kvstrata.bench._procs import ProcessFailure, device_client, run_spawned, wait_future

pytestmark = pytest.mark.gpu
WAIT = float(os.environ.get("KVSTRATA_TEST_WAIT", "30"))  # per step; a hang fails with the step's name
PROC_TIMEOUT = 3 * WAIT
SPECS = [
    ((1000, 37), torch.bfloat16),
    ((4097,), torch.float32),
    ((3, 5, 7), torch.int64),
    ((1,), torch.uint8),
    ((257, 129), torch.float16),
]


def make(seed: int, device: int | str, specs=SPECS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in specs:
        if dtype.is_floating_point:
            t = torch.randn(*shape, generator=g).to(dtype)
        else:
            t = torch.randint(0, 127, shape, generator=g, dtype=torch.int64).to(dtype)
        out.append(t.to(device))
    return out


def poisoned(device: int, specs=SPECS) -> list[torch.Tensor]:
    return [torch.full(shape, 7, dtype=dtype, device=device) for shape, dtype in specs]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def _client(address: str, device: int, **cfg):
    return device_client(address, device, **cfg)


def wait(f, step: str):
    """``f.result(WAIT)``, failing with the step, this process and its clients' pending state."""
    return wait_future(f, step, WAIT, AssertionError)


def run_procs(targets: list[tuple], timeout: float = PROC_TIMEOUT, broker=None) -> list:
    """Run ``(fn, *args)`` in spawned processes; fail on an error, a crash or a hang, saying which and where
    (with the broker's state; the children's stacks are in the captured stderr)."""
    try:
        return [value for _, value in run_spawned(targets, timeout)]
    except ProcessFailure as exc:
        state = broker.snapshot() if broker is not None else None
        pytest.fail(f"{exc}\nbroker: {state}")


def broker_of(worker):
    from kvstrata.devobj.service import broker_of as of

    return of(worker)


@pytest.fixture
def worker(tmp_path):
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=64 << 20, disk_dir="")).start()
    yield w
    w.stop()


# -- children ---------------------------------------------------------------------------------------
def publisher(address: str, device: int) -> str:
    c = _client(address, device)
    # Slow work queued before the data is final: the reader must see the final bytes (ready event).
    late = torch.zeros(1 << 20, dtype=torch.float32, device=device)
    torch.cuda._sleep(200_000_000)
    late.fill_(3.5)
    fa, fb, fl = c.dev_publish(["a", "b", "late"], [make(1, device), make(2, device), [late]])
    wait(fa, "publisher: publish 'a' received by the subscriber")
    wait(fb, "publisher: publish 'b' received")
    wait(fl, "publisher: publish 'late' received")
    assert c.dev_mset(["w"], [make(3, device)]) == [None]
    ready = poisoned(device)
    wait(c.dev_subscribe(["reader-done"], [ready[:1]], timeout=WAIT)[0], "publisher: subscribe 'reader-done'")
    assert c.dev_delete(["w"]) == [None]
    wait(c.dev_publish(["w-deleted"], [ready[:1]])[0], "publisher: publish 'w-deleted'")
    c.close()
    return "published"


def subscriber(address: str, device: int, peer_device: int) -> str:
    c = _client(address, device)
    dst_a = poisoned(device)
    (fa,) = c.dev_subscribe(["a"], [dst_a], timeout=WAIT)  # usually before the publish
    wait(fa, "subscriber: subscribe 'a' (first cross-process import)")
    assert same(dst_a, make(1, "cpu")), "a differs"
    dst_b = poisoned(device)
    wait(c.dev_subscribe(["b"], [dst_b], timeout=WAIT)[0], "subscriber: subscribe 'b'")
    assert same(dst_b, make(2, "cpu")), "b differs"
    late = torch.zeros(1 << 20, dtype=torch.float32, device=device)
    wait(c.dev_subscribe(["late"], [[late]], timeout=WAIT)[0], "subscriber: subscribe 'late'")
    assert bool((late == 3.5).all()), "read before the publisher's queued work finished"
    for _ in range(3):  # any number of times
        dst_w = poisoned(device)
        wait(c.dev_mget(["w"], [dst_w], timeout=WAIT)[0], "subscriber: mget 'w'")
        assert same(dst_w, make(3, "cpu")), "w differs"
    assert c.device_objects().cached_reads == 2, "reads after the first should skip the broker (generation page)"
    bad = poisoned(device)
    bad[0] = torch.full((1000, 38), 7, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="tensor 0"):
        c.dev_mget(["w"], [bad], timeout=WAIT)[0].result(WAIT)
    assert bool((bad[1] == 7).all()), "a mismatched read wrote data"
    (done,) = c.dev_publish(["reader-done"], [poisoned(device)[:1]])
    wait(done, "subscriber: publish 'reader-done' received by the publisher")
    wait(c.dev_subscribe(["w-deleted"], [poisoned(device)[:1]], timeout=WAIT)[0], "subscriber: subscribe 'w-deleted'")
    with pytest.raises(errors.Timeout):  # deleted by its owner
        c.dev_mget(["w"], [poisoned(device)], timeout=2)[0].result(WAIT)
    c.close()
    return "subscribed"


def broadcaster(address: str, device: int, receivers: int, nbytes: int) -> str:
    c = _client(address, device, chunk_bytes=64 << 10)
    src = make(11, device, [((nbytes,), torch.uint8), ((333, 17), torch.float32)])
    wait(c.dev_broadcast("weights", src, receivers=receivers), f"broadcaster: broadcast to {receivers} receivers")
    assert same(src, make(11, "cpu", [((nbytes,), torch.uint8), ((333, 17), torch.float32)]))
    c.close()
    return "sent"


def receiver(address: str, device: int, nbytes: int, mode: str = "memcpy", bwait: str = "host") -> str:
    c = _client(address, device, same_gpu_copy=mode, broadcast_wait=bwait)
    specs = [((nbytes,), torch.uint8), ((333, 17), torch.float32)]
    dst = poisoned(device, specs)
    wait(c.dev_subscribe(["weights"], [dst], timeout=WAIT)[0], f"receiver on GPU{device}: subscribe 'weights'")
    assert same(dst, make(11, "cpu", specs)), "broadcast copy differs"
    c.close()
    return "received"


def bcast_failing_sender(address: str, device: int, nbytes: int) -> str:
    c = _client(address, device, chunk_bytes=64 << 10)
    f = c.dev_broadcast("doomed-bcast", [make(12, device, [((nbytes,), torch.uint8)])[0]], receivers=3)
    with pytest.raises(errors.ServerError, match="failed"):
        f.result(WAIT)
    c.close()
    return "broadcast failed as expected"


def bcast_abandoned_receiver(address: str, device: int, nbytes: int, bwait: str) -> str:
    c = _client(address, device, broadcast_wait=bwait)
    (f,) = c.dev_subscribe(["doomed-bcast"], [poisoned(device, [((nbytes,), torch.uint8)])], timeout=WAIT)
    with pytest.raises(errors.ServerError):  # the predecessor died mid-copy: an abort, never a hang or "done"
        f.result(WAIT)
    c.close()
    return "receive failed as expected"


def bcast_dying_receiver(address: str, device: int, nbytes: int) -> None:
    """Dies inside its broadcast step: a leader after queuing its 4th chunk pull, a member once its 4th
    chunk landed (its leader is still copying into it)."""
    from kvstrata.devobj import broadcast

    real = broadcast.pump

    def die_midway(n, enqueue, **kw):
        def enq(c: int):
            if c == 3:
                os._exit(0)  # no goodbye: the worker sees the connection drop, its successors' counters stop
            return enqueue(c)

        return real(n, enq, **kw)

    broadcast.pump = die_midway
    c = _client(address, device)
    c.dev_subscribe(["doomed-bcast"], [poisoned(device, [((nbytes,), torch.uint8)])], timeout=WAIT)
    time.sleep(3 * WAIT)
    os._exit(3)  # never reached when the broadcast started


def nccl_owner(address: str, device: int) -> str:
    c = _client(address, device, transport="nccl")
    (f,) = c.dev_publish(["n1"], [make(21, device)])
    assert c.dev_mset(["n2"], [make(22, device)]) == [None]
    wait(f, "nccl owner: publish 'n1' received")
    wait(c.dev_subscribe(["nccl-done"], [poisoned(device)[:1]], timeout=WAIT)[0], "nccl owner: subscribe 'nccl-done'")
    c.close()
    return "nccl sent"


def nccl_reader(address: str, device: int) -> str:
    c = _client(address, device)
    d1, d2, d3 = poisoned(device), poisoned(device), poisoned(device)
    wait(c.dev_subscribe(["n1"], [d1], timeout=WAIT)[0], "nccl reader: subscribe 'n1'")
    wait(c.dev_mget(["n2"], [d2], timeout=WAIT)[0], "nccl reader: mget 'n2' (1st)")
    wait(c.dev_mget(["n2"], [d3], timeout=WAIT)[0], "nccl reader: mget 'n2' (2nd)")
    assert same(d1, make(21, "cpu")) and same(d2, make(22, "cpu")) and same(d3, make(22, "cpu"))
    wait(c.dev_publish(["nccl-done"], [poisoned(device)[:1]])[0], "nccl reader: publish 'nccl-done'")
    c.close()
    return "nccl received"


def dying_owner(address: str, device: int) -> None:
    c = _client(address, device)
    assert c.dev_mset(["doomed"], [make(5, device)]) == [None]
    c.dev_publish(["doomed-1shot"], [make(6, device)])
    os._exit(0)  # no goodbye: the worker sees the connections drop


def pair_both_ways(address: str, device: int, me: str, other: str, n: int) -> str:
    c = _client(address, device)
    futs, dsts = [], {}
    for i in range(n):
        dsts[i] = poisoned(device)
        if i % 2:
            futs += c.dev_subscribe([f"{other}{i}"], [dsts[i]], timeout=WAIT)
            futs += c.dev_publish([f"{me}{i}"], [make(100 + i, device)])
        else:
            futs += c.dev_publish([f"{me}{i}"], [make(100 + i, device)])
            futs += c.dev_subscribe([f"{other}{i}"], [dsts[i]], timeout=WAIT)
    for f in futs:
        wait(f, f"pair {me}: future {futs.index(f)} of {len(futs)}")
    for i in range(n):
        assert same(dsts[i], make(100 + i, "cpu")), f"{other}{i} differs"
    c.close()
    return "pairs done"


# -- tests ------------------------------------------------------------------------------------------
@pytest.mark.multigpu
def test_two_gpus_publish_subscribe_mset_mget(worker):
    run_procs([(publisher, worker.address, 0), (subscriber, worker.address, 1, 0)], broker=broker_of(worker))
    assert worker.devobj_broker.snapshot()["objects"] == {}


def test_one_gpu_two_processes(worker):
    run_procs([(publisher, worker.address, 0), (subscriber, worker.address, 0, 0)], broker=broker_of(worker))
    assert worker.devobj_broker.snapshot()["objects"] == {}


@pytest.mark.multigpu
def test_many_pairs_both_directions_no_deadlock(worker):
    run_procs(
        [(pair_both_ways, worker.address, 0, "x", "y", 24), (pair_both_ways, worker.address, 1, "y", "x", 24)],
        broker=broker_of(worker),
    )


@pytest.mark.multigpu
@pytest.mark.parametrize(
    ("nbytes", "mode", "bwait"),
    [
        ((1 << 20) + 4099, "memcpy", "host"),
        ((1 << 20) + 4096, "kernel", "host"),
        (1000, "memcpy", "host"),
        ((64 << 20) + 12345, "kernel", "host"),
        ((1 << 20) + 4099, "memcpy", "stream"),
        ((64 << 20) + 12345, "kernel", "stream"),
    ],
)
def test_broadcast_to_three_receivers_over_two_gpus(worker, nbytes, mode, bwait):
    """Every receiver gets exact bytes; chunks of 64 KiB, so the chain pipelines across processes."""
    a = worker.address
    receivers = [(receiver, a, d, nbytes, mode, bwait) for d in (1, 0, 1)]
    run_procs([*receivers, (broadcaster, a, 0, 3, nbytes)], broker=broker_of(worker))
    assert worker.devobj_broker.snapshot()["objects"] == {}


@pytest.mark.multigpu
@pytest.mark.parametrize(("bwait", "dying_gpu"), [("host", 0), ("stream", 0), ("host", 1), ("stream", 1)])
def test_broadcast_receiver_dying_mid_copy_fails_everyone(worker, bwait, dying_gpu):
    """GPU0: the dying receiver is GPU0's only one, so its leader; GPU1's leader pulls from the sender.
    GPU1: all three receivers on GPU1; the dying one is their leader or a member (arrival order), so
    either a leader dies while copying into its members or a member dies while its leader copies into it."""
    import torch.multiprocessing as mp

    from kvstrata.devobj.progress import PREFIX, SHM_DIR, sweep_stale

    nbytes = 4 << 20  # 32 chunks of 128 KiB
    dying = mp.get_context("spawn").Process(target=bcast_dying_receiver, args=(worker.address, dying_gpu, nbytes))
    dying.start()
    try:
        a = worker.address
        run_procs(
            [*[(bcast_abandoned_receiver, a, 1, nbytes, bwait)] * 2, (bcast_failing_sender, a, 0, nbytes)],
            broker=broker_of(worker),
        )
        dying.join(WAIT)
        assert dying.exitcode == 0, "the dying receiver did not die inside its broadcast step"
    finally:
        if dying.is_alive():
            dying.kill()
    assert worker.devobj_broker.snapshot()["objects"] == {}
    sweep_stale()
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}p{dying.pid}-")]


@pytest.mark.parametrize("bwait", ["host", "stream"])
def test_broadcast_between_clients_of_one_process(bwait):
    """The in-process path with CUDA tensors: _LOCAL exports, progress counters, chunk events."""
    from kvstrata.devobj import DeviceBroker, DeviceObjectConfig, DeviceObjects, InprocBrokerLink

    broker = DeviceBroker()
    cfg = DeviceObjectConfig(chunk_bytes=64 << 10, broadcast_wait=bwait)
    devices = [0, 1, 0] if torch.cuda.device_count() > 1 else [0, 0, 0]
    sender = DeviceObjects(InprocBrokerLink(broker), device=0, config=cfg)
    receivers = [DeviceObjects(InprocBrokerLink(broker), device=d, config=cfg) for d in devices]
    specs = [(((3 << 20) + 77,), torch.uint8), ((333, 17), torch.float32)]
    try:
        dsts = [poisoned(d, specs) for d in devices]
        futs = [r.dev_subscribe(["w"], [x], timeout=WAIT)[0] for r, x in zip(receivers, dsts)]
        sf = sender.dev_broadcast("w", make(13, 0, specs), receivers=len(receivers))
        for i, f in enumerate([*futs, sf]):
            wait(f, f"one process: broadcast future {i}")
        for d in dsts:
            assert same(d, make(13, "cpu", specs)), "broadcast copy differs"
        assert sorted(e["position"] for r in receivers for e in r.broadcast_log()) == [0, 1, 2]
        leaders = [e for r in receivers for e in r.broadcast_log() if e["role"] == "leader"]
        assert len(leaders) == len(set(devices))  # one copying client per GPU
        assert broker.snapshot()["objects"] == {}
    finally:
        for c in [sender, *receivers]:
            c.close()


@pytest.mark.multigpu
def test_nccl_path_between_two_processes(worker):
    pytest.importorskip("cupy")
    run_procs([(nccl_owner, worker.address, 0), (nccl_reader, worker.address, 1)], broker=broker_of(worker))


def test_owner_death_makes_keys_vanish(worker):
    import time

    import torch.multiprocessing as mp

    p = mp.get_context("spawn").Process(target=dying_owner, args=(worker.address, 0))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    deadline = time.monotonic() + 10
    while worker.devobj_broker.snapshot()["objects"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.devobj_broker.snapshot()["objects"] == {}


def test_same_process_clients_and_bad_input():
    from kvstrata.devobj import DeviceBroker, DeviceObjects, InprocBrokerLink

    broker = DeviceBroker()
    a = DeviceObjects(InprocBrokerLink(broker), device=0)
    b = DeviceObjects(InprocBrokerLink(broker), device=0)
    try:
        with pytest.raises(ValueError, match=r"tensor_lists\[0\]\[0\].*cpu tensor"):
            a.dev_publish(["k"], [[torch.zeros(4)]])
        with pytest.raises(ValueError, match="not contiguous"):
            a.dev_publish(["k"], [[torch.zeros(4, 4, device=0).t()]])
        if torch.cuda.device_count() > 1:
            with pytest.raises(ValueError, match="this client's device is cuda:0"):
                a.dev_publish(["k"], [[torch.zeros(4, device=1)]])
        assert broker.snapshot()["objects"] == {}
        dst = poisoned(0)
        (sf,) = b.dev_subscribe(["k"], [dst], timeout=WAIT)
        (pf,) = a.dev_publish(["k"], [make(9, 0)])
        wait(sf, "same process: subscribe 'k'")
        wait(pf, "same process: publish 'k'")
        assert same(dst, make(9, "cpu"))
    finally:
        a.close()
        b.close()
