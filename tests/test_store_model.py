"""The store against a model of its semantics: seeded random sequences of every key/object operation, each result
compared with what a plain dict says it must be, in a memory tier small enough that values are spilled to SSD and
promoted back all the time (which must change no answer). Embedded and through a worker.

The model: a key holds its last value written (``set``, ``mset``, a sealed ``create``) and a reference count that
survives overwrites; ``nx`` refuses an existing key; an aborted ``create`` changes nothing; ``decref`` to 0 deletes
(at 0 it does nothing); a missing key has count 0, no size, and is ``KeyNotFound`` to reads.
"""

from __future__ import annotations

import random

import pytest

import kvstrata
from kvstrata.errors import KeyExists, KeyNotFound
from kvstrata.server import Worker, WorkerConfig

MEMORY = 4 << 20
SIZES = (0, 1, 100, 4096, 70_000, 300_000, 900_000)  # empty, inline, across the inline limit, shared memory
KEYS = [f"m/{i}" for i in range(24)]  # ~24 x 300 KB on average: several times the memory tier


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    config = WorkerConfig.load(
        {"socket": str(tmp / "w.sock"), "memory": MEMORY, "segment_size": 2 << 20, "numa_node": "none",
         "disk_dir": str(tmp / "disk"), "disk_size": 256 << 20},
        environ={},
    )  # fmt: skip
    with Worker(config).start() as w:
        yield w


@pytest.fixture(params=["embedded", "unix"])
def kv(request, worker, tmp_path):
    if request.param == "embedded":
        client = kvstrata.connect(
            embedded=True, memory_bytes=MEMORY, segment_bytes=2 << 20, numa_node=None,
            disk_dir=str(tmp_path / "disk"), disk_bytes=256 << 20,
        )  # fmt: skip
    else:
        client = kvstrata.connect(worker.address, timeout=10)
    client.delete(KEYS)
    yield client
    client.delete(KEYS)
    client.close()


class Model:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.refs: dict[str, int] = {}

    def write(self, key: str, value: bytes) -> None:
        self.values[key] = value
        self.refs.setdefault(key, 0)

    def drop(self, key: str) -> bool:
        self.refs.pop(key, None)
        return self.values.pop(key, None) is not None


def _value(rng: random.Random, step: int) -> bytes:
    size = rng.choice(SIZES)
    stamp = step.to_bytes(4, "little")
    return (stamp * (size // 4 + 1))[:size]


def _one_step(kv, model: Model, rng: random.Random, step: int) -> None:
    key = rng.choice(KEYS)
    op = rng.randrange(14)
    mode = rng.choice(("memory", "write_through", "write_back"))
    where = f"step {step}: op {op} on {key!r}"
    if op == 0:
        value = _value(rng, step)
        nx = rng.random() < 0.2
        if nx and key in model.values:
            with pytest.raises(KeyExists):
                kv.set(key, value, nx=True, write_mode=mode)
        else:
            kv.set(key, value, nx=nx, write_mode=mode)
            model.write(key, value)
    elif op == 1:
        batch = rng.sample(KEYS, 3)
        items = {k: _value(rng, step) for k in batch}
        got = kv.mset(items, write_mode=mode)
        assert got == [None] * 3, f"{where}: {got!r:.300}"
        for k, v in items.items():
            model.write(k, v)
    elif op == 2:
        batch = [*rng.sample(KEYS, 2), key]  # a key named twice is deleted once
        got = kv.delete(batch)
        assert got == [model.drop(k) for k in batch], where
    elif op in (3, 4):
        if key in model.values:
            assert kv.get(key) == model.values[key], where
        else:
            with pytest.raises(KeyNotFound):
                kv.get(key)
    elif op == 5:
        batch = rng.sample(KEYS, 4)
        for k, got in zip(batch, kv.mget(batch)):
            if k in model.values:
                assert got == model.values[k], f"{where}: mget {k!r}"
            else:
                assert isinstance(got, KeyNotFound), f"{where}: mget {k!r}: {got!r:.80}"
    elif op == 6:
        batch = rng.sample(KEYS, 4)
        assert kv.exists(batch) == [k in model.values for k in batch], where
        assert kv.size(batch) == [len(model.values[k]) if k in model.values else None for k in batch], where
    elif op == 7:
        if model.values.get(key):
            n = len(model.values[key])
            offset = rng.randrange(n)
            size = rng.randrange(n - offset + 1)
            assert kv.read(key, offset, size) == model.values[key][offset : offset + size], where
    elif op == 8:
        got = kv.incref(key)
        if key in model.values:
            model.refs[key] += 1
        assert got == model.refs.get(key, 0), where
    elif op == 9:
        got = kv.decref(key)
        if key in model.values and model.refs[key] > 0:
            model.refs[key] -= 1
            if model.refs[key] == 0:
                model.drop(key)
        assert got == model.refs.get(key, 0), where
        assert kv.exists(key) == (key in model.values), where
    elif op == 10:
        assert kv.refcount(key) == model.refs.get(key, 0), where
    elif op == 11:  # written in place, then sealed or aborted
        value = _value(rng, step)
        buf = kv.create(key, len(value), write_mode=mode)
        buf.memoryview()[:] = value
        if rng.random() < 0.7:
            buf.seal()
            model.write(key, value)
        else:
            buf.abort()
    elif op == 12:
        for buf in kv.get_buffers([key]):
            if key in model.values:
                with buf:
                    assert bytes(buf) == model.values[key], where
            else:
                assert isinstance(buf, KeyNotFound), where
    else:
        assert kv.expire(key, None) == (key in model.values), where  # no TTL: nothing else changes


@pytest.mark.parametrize("seed", [1, 2])
def test_every_answer_matches_the_model_while_values_spill_and_come_back(kv, seed):
    rng = random.Random(seed)
    model = Model()
    for step in range(1500):
        _one_step(kv, model, rng, step)
    for key in KEYS:  # and in the end, everything the model holds is there, whole
        if key in model.values:
            assert kv.get(key) == model.values[key], key
        else:
            assert not kv.exists(key), key
    stats = kv.stats()
    assert stats["spills"] + stats["evictions"] > 0, stats  # values really left memory and came back


def test_copying_reads_of_a_spilled_value_come_from_ssd_when_dram_is_all_leased(kv):
    cold = b"C" * 300_000
    kv.set("m/cold", cold)
    views = []
    for i in range(40):  # DRAM filled with values whose views stay open: only "m/cold" could leave it
        try:
            kv.set(f"m/hot/{i}", bytes([i]) * 300_000)
        except kvstrata.errors.CapacityError:
            break
        views += kv.get_buffers([f"m/hot/{i}"])
    try:
        assert kv.stats()["spills"] >= 1
        assert kv.get("m/cold") == cold  # no room to bring it back: read straight from SSD
        assert kv.mget(["m/cold", "m/nothing"])[0] == cold
        assert isinstance(kv.get_buffers(["m/cold"])[0], kvstrata.errors.CapacityError)  # a view needs DRAM
    finally:
        for view in views:
            view.release()
        kv.delete(["m/cold", *(f"m/hot/{i}" for i in range(40))])


def _tensors(rng: random.Random, seed: int) -> list:
    import torch

    out = []
    for j in range(rng.randrange(1, 4)):
        n = rng.choice((10, 1000, 20_000, 70_000))
        out.append(torch.arange(n, dtype=torch.uint8) + (seed * 7 + j) % 251)
    return out


@pytest.mark.parametrize("seed", [3, 4])
def test_device_calls_match_the_model_across_clients_rewrites_and_spills(kv, worker, seed, monkeypatch):
    """``mset_d2h`` / ``mget_h2d`` (CPU tensors, cut in stages of 2 keys as a GPU call's are) by two clients in turn,
    with rewrites by ``set`` between them: every read gets the current bytes (never a kept lease's or an early copy's
    stale ones), write-once is kept, and a missing key is ``KeyNotFound``, while values spill and come back."""
    import torch

    from _stages import stages_of
    from kvstrata.client import device

    monkeypatch.setattr(device, "stages", stages_of(2))
    other = kv if kv.embedded else kvstrata.connect(worker.address, timeout=10)
    rng = random.Random(seed)
    model: dict[str, list] = {}
    try:
        for step in range(800):
            client, op = rng.choice((kv, other)), rng.randrange(6)
            where = f"step {step}: op {op}"
            if op == 0:
                batch = rng.sample(KEYS, rng.randrange(1, 6))
                lists = [_tensors(rng, step + i) for i in range(len(batch))]
                for k, ts, r in zip(batch, lists, client.mset_d2h(batch, lists)):
                    if k in model:
                        assert isinstance(r, KeyExists), f"{where}: {k}: {r!r}"
                    else:
                        assert r is None, f"{where}: {k}: {r!r}"
                        model[k] = [t.clone() for t in ts]
            elif op in (1, 2):
                batch = rng.sample(KEYS, rng.randrange(1, 8))
                dst = [[torch.empty_like(t) for t in model[k]] if k in model else [torch.empty(5)] for k in batch]
                for k, d, r in zip(batch, dst, client.mget_h2d(batch, dst)):
                    if k in model:
                        assert r is None, f"{where}: {k}: {r!r}"
                        assert all(torch.equal(a, b) for a, b in zip(d, model[k])), f"{where}: wrong bytes for {k}"
                    else:
                        assert isinstance(r, KeyNotFound), f"{where}: {k}: {r!r}"
            elif op == 3:
                batch = rng.sample(KEYS, 3)
                assert client.delete(batch) == [model.pop(k, None) is not None for k in batch], where
            elif op == 4:
                key = rng.choice(KEYS)
                if key in model:  # rewritten: the other client's kept lease and the placement table move on
                    value = bytes(rng.randrange(256) for _ in range(rng.choice((3, 5000))))
                    client.set(key, value)
                    model[key] = [torch.frombuffer(bytearray(value), dtype=torch.uint8)]
            else:
                key = rng.choice(KEYS)
                if key in model:
                    assert client.get(key) == b"".join(t.numpy().tobytes() for t in model[key]), where
    finally:
        if other is not kv:
            other.close()
