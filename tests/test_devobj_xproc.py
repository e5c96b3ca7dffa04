"""Two spawned processes through a real worker, on CPU: the cross-process event, ack and release flow
(match events through the long poll, completion acks, ``released`` to the publisher, mget re-reads)
that the GPU run exercises, with the CUDA IPC data path replaced by a stand-in that rebuilds the
source bytes from the key (CPU tensors cannot be mapped across processes)."""

from __future__ import annotations

import os
import queue
import traceback

import pytest
import torch

WAIT = 30.0
SPECS = [{"shape": [5, 3], "dtype": "float32"}, {"shape": [7], "dtype": "int64"}]


def fake(key: str, specs=SPECS) -> list[torch.Tensor]:
    v = float(sum(map(ord, key)) % 97)
    return [torch.full(sp["shape"], v, dtype=getattr(torch, sp["dtype"])) for sp in specs]


def _client(address: str):
    import kvstrata
    from kvstrata.devobj import DeviceObjectConfig, _core, api

    def sources(self, src, peer, reuse=False):  # the stand-in for the CUDA IPC import
        if src.get("pid") == os.getpid():
            return _core.LOCAL_EXPORTS[src["local"]][0], []
        return fake(src["key"], src["tensors"]), []

    api.DeviceObjects._sources = sources
    c = kvstrata.connect(address)
    c.device_objects(device="cpu", config=DeviceObjectConfig(allow_cpu=True, poll_seconds=0.2))
    return c


def publisher(address: str) -> str:
    c = _client(address)
    for f in c.dev_publish(["a", "b"], [fake("a"), fake("b")]):
        f.result(WAIT)
    assert c.dev_mset(["w"], [fake("w")]) == [None]
    c.dev_subscribe(["done"], [[torch.zeros(1)]], timeout=WAIT)[0].result(WAIT)
    c.close()
    return "published"


def subscriber(address: str) -> str:
    c = _client(address)
    for key in ("a", "b"):
        dst = [torch.zeros(5, 3), torch.zeros(7, dtype=torch.int64)]
        c.dev_subscribe([key], [dst], timeout=WAIT)[0].result(WAIT)
        assert all(torch.equal(x, y) for x, y in zip(dst, fake(key))), key
    for _ in range(3):
        dst = [torch.zeros(5, 3), torch.zeros(7, dtype=torch.int64)]
        c.dev_mget(["w"], [dst], timeout=WAIT)[0].result(WAIT)
        assert all(torch.equal(x, y) for x, y in zip(dst, fake("w")))
    c.dev_publish(["done"], [[torch.ones(1)]])[0].result(WAIT)
    c.close()
    return "subscribed"


def _entry(fn, q, *args):
    try:
        q.put(("ok", fn.__name__, fn(*args)))
    except BaseException:
        q.put(("err", fn.__name__, traceback.format_exc()))


@pytest.fixture
def worker(tmp_path):
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=64 << 20, disk_dir="")).start()
    yield w
    w.stop()


def test_two_processes_through_a_worker(worker):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, q, worker.address)) for fn in (publisher, subscriber)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            try:
                status, name, value = q.get(timeout=3 * WAIT)
            except queue.Empty:
                pytest.fail(f"hang; exit codes {[p.exitcode for p in procs]}")
            assert status == "ok", f"{name} failed:\n{value}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert worker.devobj_broker.snapshot()["objects"] == {}
