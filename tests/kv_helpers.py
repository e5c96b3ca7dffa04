"""Shared builders and plain-torch references for the KV transfer tests (no kvstrata code in the references)."""

from __future__ import annotations

import time

import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn]


def rand(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """Random bytes of every bit pattern, viewed as ``dtype`` (copies are compared bytewise)."""
    elt = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * elt), dtype=torch.uint8)
    return raw.view(dtype).to(device)


def make_cache(kind: str, *, layers: int, blocks: int, dtype: torch.dtype, device="cpu", head_dim: int = 8,
               page: int = 3) -> dict:  # fmt: skip
    """A device cache of ``kind`` ("vllm", "sglang", "mla") filled with random bytes."""
    if kind == "vllm":
        return {"kind": kind, "caches": [rand((2, blocks, 2, 2, head_dim), dtype, device) for _ in range(layers)]}
    if kind == "sglang":  # one extra slot: a trailing partial page that must stay unaddressed
        k = [rand((blocks * page + 1, 2, head_dim), dtype, device) for _ in range(layers)]
        v = [rand((blocks * page + 1, 2, head_dim), dtype, device) for _ in range(layers)]
        return {"kind": kind, "k": k, "v": v, "page": page}
    if kind == "mla":
        return {"kind": kind, "caches": [rand((blocks, 2, head_dim * 3), dtype, device) for _ in range(layers)]}
    raise ValueError(kind)


def layout_of(cache: dict):
    from kvstrata.ops import KVLayout

    if cache["kind"] == "vllm":
        return KVLayout.from_vllm(cache["caches"])
    if cache["kind"] == "sglang":
        return KVLayout.from_sglang(cache["k"], cache["v"], cache["page"])
    return KVLayout.from_mla(cache["caches"])


def tensors_of(cache: dict) -> list[torch.Tensor]:
    return cache["k"] + cache["v"] if cache["kind"] == "sglang" else list(cache["caches"])


def device_chunk(cache: dict, seg: int, block: int) -> torch.Tensor:
    """Bytes of block ``block`` of segment ``seg`` (= layer * S + s), straight from the user's tensors."""
    kind = cache["kind"]
    if kind == "vllm":
        t = cache["caches"][seg // 2][seg % 2, block]
    elif kind == "sglang":
        bufs = cache["k"] if seg % 2 == 0 else cache["v"]
        p = cache["page"]
        t = bufs[seg // 2][block * p : (block + 1) * p]
    else:
        t = cache["caches"][seg][block]
    return t.contiguous().view(torch.uint8).reshape(-1)


def num_segments(cache: dict) -> int:
    return len(cache["caches"]) * (2 if cache["kind"] == "vllm" else 1) if "caches" in cache else 2 * len(cache["k"])


def host_chunk(flat: torch.Tensor, layout: str, nseg: int, nblocks: int, chunk: int, seg: int, block: int):
    """Bytes of host block ``block``, segment ``seg`` of a pool ``flat`` (uint8) in ``layout``."""
    i = block * nseg + seg if layout == "block_first" else seg * nblocks + block
    return flat[i * chunk : (i + 1) * chunk]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytewise equality (random bytes include NaN patterns, which ``torch.equal`` calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def clone_all(cache: dict) -> list[torch.Tensor]:
    return [t.clone() for t in tensors_of(cache)]


def worker_config(directory, *, memory: int, segment: int):
    """A test worker's config: a socket in ``directory``, DRAM only, no NUMA binding, no environment."""
    from kvstrata.server import WorkerConfig

    settings = {"socket": str(directory / "w.sock"), "memory": memory, "segment_size": segment}
    return WorkerConfig.load(dict(settings, disk_dir="", numa_node="none"), environ={})


def worker_fixtures(name: str, *, memory: int, segment: int, modes: tuple[str, ...] = ("embedded", "unix")):
    """A test module's ``worker`` fixture (one worker per module, built by :func:`worker_config` in a folder named
    ``name``) and ``kv`` fixture (a client per test, once per mode of ``modes``: see :func:`client_for`). Bind both
    under those names: ``worker, kv = worker_fixtures("dev-worker", memory=64 << 20, segment=16 << 20)``."""
    import pytest

    from kvstrata.server import Worker

    @pytest.fixture(scope="module")
    def worker(tmp_path_factory):
        with Worker(worker_config(tmp_path_factory.mktemp(name), memory=memory, segment=segment)).start() as w:
            yield w

    @pytest.fixture(params=list(modes))
    def kv(request, worker):
        others = worker.stats()["clients"]
        client = client_for(request.param, worker, memory=memory, segment=segment)
        yield client
        client.close()
        # The worker lets go of a closed client's leases on its own thread: wait for that, so that the next
        # test's counts (leases, clients) start from this one's end rather than change under it
        deadline = time.monotonic() + 10
        while worker.stats()["clients"] > others and time.monotonic() < deadline:
            time.sleep(0.005)

    return worker, kv


def client_for(mode: str, worker, *, memory: int, segment: int):
    """A client of ``worker`` (``mode="unix"``) or an embedded store of the same size (``"embedded"``)."""
    import kvstrata

    if mode == "embedded":
        return kvstrata.connect(embedded=True, memory_bytes=memory, segment_bytes=segment, numa_node=None)
    return kvstrata.connect(worker.address, timeout=5)


class FakeReduce:
    """Stands in for the CUDA IPC export of ``devobj.ipc.ExportCache`` on CPU tensors: counts its calls and
    gives each export a handle of its own."""

    def __init__(self):
        self.calls = 0

    def __call__(self, t):
        self.calls += 1
        return {"handle": bytes([self.calls]) * 8, "storage_bytes": t.untyped_storage().nbytes(), "storage_offset": 0}


def wait_until(predicate, seconds: float = 5.0) -> bool:
    """Whether ``predicate()`` came true within ``seconds`` (looked at every 5 ms): for what a worker's thread or a
    client's keeper does on its own time (a session let go, a lease given back)."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def quiet(store):
    """Stop ``store``'s background pass (write-back flushes, TTL sweeps, watermark eviction) and return the store:
    for a test that drives flushes and spills itself. A flush interval does not do it: every write-back put and
    every write past the high watermark wakes the pass at once. ``close()`` still flushes what is dirty."""
    store._stop.set()
    store._wake.set()
    store._thread.join()
    return store


def held_back(monkeypatch, obj, name: str):
    """Make ``obj.name`` (an I/O call) wait until the returned ``go`` event is set; ``started`` is set when a call
    began. A test can then look at what others do *while* that call is in flight, with no timing guess."""
    import threading

    started, go = threading.Event(), threading.Event()
    real = getattr(obj, name)

    def held(*args, **kw):
        started.set()
        go.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(obj, name, held)
    return started, go


def returns_within(fn, seconds: float = 5.0, what: str = "the call"):
    """``fn()``'s value, called on a thread of its own; AssertionError naming ``what`` when it has not returned
    within ``seconds``: for a call that must not wait on something the test holds back (one that does wait fails
    the test instead of hanging it; no timing guess beyond a generous bound)."""
    import threading

    out: list = []

    def run():
        try:
            out.append((True, fn()))
        except BaseException as exc:  # raised in the caller's thread below
            out.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{what} waited on what the test held back"
    ok, value = out[0]
    if not ok:
        raise value
    return value
