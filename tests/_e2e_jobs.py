"""Client jobs run in separate processes by test_worker_e2e (kept free of torch/pytest so they start fast)."""

from __future__ import annotations

import hashlib
import os
import time


def payload(owner: int, i: int) -> bytes:
    """Deterministic content whose size spans inline and shared-memory paths."""
    size = [100, 5000, 70_000, 300_000, 1 << 20][i % 5] + owner
    seed = hashlib.sha256(f"{owner}/{i}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def writer_reader(address: str, me: int, peers: int, n: int) -> int:
    """Write my n keys (single and batched), then read every peer's keys (waiting for them) and check them."""
    import kvstrata

    checked = 0
    with kvstrata.connect(address, timeout=20, name=f"job-{me}") as kv:
        half = n // 2
        for i in range(half):
            kv.set(f"p{me}/{i}", payload(me, i))
        assert kv.mset({f"p{me}/{i}": payload(me, i) for i in range(half, n)}) == [None] * (n - half)
        for peer in range(peers):
            keys = [f"p{peer}/{i}" for i in range(n)]
            values = kv.mget(keys, timeout=30)
            for i, v in enumerate(values):
                if isinstance(v, Exception):
                    raise v
                if v != payload(peer, i):
                    raise AssertionError(f"job {me}: wrong bytes for {keys[i]}")
                checked += 1
            for buf in kv.get_buffers(keys[:3], timeout=30):
                with buf:
                    assert bytes(buf) == payload(peer, keys.index(buf.key))
    return checked


def die_mid_write(address: str, ready_file: str) -> None:
    """Start a large write, take a read lease, announce it, then wait to be SIGKILLed."""
    import kvstrata

    kv = kvstrata.connect(address, timeout=20, name="victim")
    kv.set("held", b"h" * 200_000)
    buf = kv.create("victim", 1 << 20)
    buf.memoryview()[: 1 << 19] = b"x" * (1 << 19)  # half written
    lease = kv.get_buffers(["held"])[0]
    with open(ready_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    print(lease, buf)  # keep both alive until killed


def count_up(address: str, key: str, n: int) -> None:
    """Set ``key`` to 1, 2, ..., n (each set visible before the next starts)."""
    import kvstrata

    with kvstrata.connect(address, timeout=20) as kv:
        for i in range(1, n + 1):
            kv.set(key, str(i).encode())


def spin_advice(address: str) -> tuple[float, float]:
    """From another process: the worker's polling advice while this is its only client, and our own poll."""
    import kvstrata

    with kvstrata.connect(address) as kv:
        kv.exists("x")
        return kv._backend._local.spin(), kv._backend._local.spin()


def hold_views_and_die(address: str, key: str) -> None:
    """Take cached and plain views of ``key``, then die by SIGKILL without releasing anything."""
    import signal

    import kvstrata

    kv = kvstrata.connect(address)
    views = [kv.get_buffers(key)[0] for _ in range(3)]
    assert all(len(v) for v in views)
    os.kill(os.getpid(), signal.SIGKILL)
