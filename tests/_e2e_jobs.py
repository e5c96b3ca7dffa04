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


# -- churn: overwrites, deletes and reads of shared keys under memory pressure --------------------------------------
#: a churned value: the key's digest, its writer and write number, the body's length, the body, then a digest of all
#: that, so a reader can tell a whole value of the right key from a torn, stale-and-reused or foreign one
CHURN_HEAD = "<16sIQI"
CHURN_SIZES = (50, 3000, 70_000, 300_000, 1 << 20)  # inline, shared memory, across the inline limit, large


def churn_value(key: str, writer: int, seq: int, size: int, rng) -> bytes:
    import struct

    head = struct.pack(CHURN_HEAD, hashlib.blake2b(key.encode(), digest_size=16).digest(), writer, seq, size)
    body = head + rng.randbytes(size)
    return body + hashlib.blake2b(body, digest_size=16).digest()


def churn_check(key: str, value) -> str | None:
    """None when ``value`` is a whole churned value of ``key``; else what is wrong with it."""
    import struct

    v = bytes(value)
    n_head = struct.calcsize(CHURN_HEAD)
    if len(v) < n_head + 16:
        return f"{key}: {len(v)} bytes, shorter than any value"
    digest, writer, seq, size = struct.unpack_from(CHURN_HEAD, v)
    if digest != hashlib.blake2b(key.encode(), digest_size=16).digest():
        return f"{key}: another key's value (writer {writer}, write {seq})"
    if len(v) != n_head + size + 16:
        return f"{key}: {len(v)} bytes, the value says {n_head + size + 16}"
    if hashlib.blake2b(v[:-16], digest_size=16).digest() != v[-16:]:
        return f"{key}: torn or overwritten bytes (writer {writer}, write {seq})"
    return None


#: writes each churn writer makes at the least (however slow the machine)
CHURN_MIN_WRITES = 21


class ChurnEnd:
    """When a churn job stops: each job goes on for ``seconds`` and until it has done its share (``going(True)``),
    then creates its file ``mine`` and goes on until every job's file of ``flags`` exists, so every read and write
    overlaps the others' however late each job starts or slowly it runs; at most ``cap`` seconds past ``seconds``."""

    def __init__(self, flags: list[str], mine: str, seconds: float, cap: float = 60.0):
        self.flags, self.mine = flags, mine
        self.end = time.monotonic() + seconds
        self.cap = cap

    def going(self, done_my_share: bool) -> bool:
        now = time.monotonic()
        if now < self.end:
            return True
        if now > self.end + self.cap:
            return False
        if not done_my_share:
            return True
        self.mark()
        return not all(map(os.path.exists, self.flags))

    def mark(self) -> None:
        if not os.path.exists(self.mine):
            open(self.mine, "w").close()

    def __enter__(self) -> ChurnEnd:
        return self

    def __exit__(self, *exc) -> None:
        self.mark()  # done, or failed: the others need not wait for me


def churn_writer(address: str, me: int, keys: list[str], seconds: float, mode: str, flags: list[str], mine: str) -> int:
    """Overwrite, batch-write, device-write (CPU tensors) and delete random keys for ``seconds`` and at least
    :data:`CHURN_MIN_WRITES` times, then until every churn job is done (:class:`ChurnEnd`, my file ``mine``);
    writes made."""
    import random

    import torch

    import kvstrata
    from kvstrata.errors import CapacityError, KeyExists

    rng = random.Random(me)
    made = 0
    with kvstrata.connect(address, timeout=20, name=f"churn-writer-{me}") as kv, ChurnEnd(flags, mine, seconds) as end:
        while end.going(made >= CHURN_MIN_WRITES):
            key, op = rng.choice(keys), rng.random()
            try:
                if op < 0.5:
                    kv.set(key, churn_value(key, me, made, rng.choice(CHURN_SIZES), rng), write_mode=mode)
                elif op < 0.6:  # write-once: the key is deleted first (another writer may win the race)
                    kv.delete(key)
                    value = bytearray(churn_value(key, me, made, rng.choice(CHURN_SIZES), rng))
                    kv.mset_d2h([key], [[torch.frombuffer(value, dtype=torch.uint8)]])
                elif op < 0.8:
                    batch = rng.sample(keys, 3)
                    kv.mset({k: churn_value(k, me, made, rng.choice(CHURN_SIZES), rng) for k in batch}, write_mode=mode)
                else:
                    kv.delete(key)
            except (CapacityError, KeyExists):  # memory full of pinned values, or a write-once race lost
                pass
            made += 1
    return made


def churn_reader(
    address: str, me: int, keys: list[str], seconds: float, flags: list[str], mine: str
) -> tuple[dict[str, int], list[str]]:
    """Read random keys every way for ``seconds`` and until every way has checked a value, then until every churn
    job is done (:class:`ChurnEnd`, my file ``mine``), and check each value found; values checked per way, and what
    was wrong (at most 5)."""
    import random

    import torch

    import kvstrata
    from kvstrata.errors import KeyNotFound

    rng = random.Random(1000 + me)
    checked = {"get": 0, "mget": 0, "get_buffers": 0, "mget_h2d": 0}
    bad: list[str] = []

    def check(how: str, key: str, value) -> None:
        checked[how] += 1
        wrong = churn_check(key, value)
        if wrong is not None:
            bad.append(f"{how}: {wrong}")

    with kvstrata.connect(address, timeout=20, name=f"churn-reader-{me}") as kv, ChurnEnd(flags, mine, seconds) as end:
        while len(bad) < 5 and end.going(all(checked.values())):
            key, op = rng.choice(keys), rng.random()
            try:
                if op < 0.35:
                    check("get", key, kv.get(key))  # small values: from the local-read cache once leased
                elif op < 0.5:
                    size = kv.size(key)
                    if size is not None:  # rewritten meanwhile to another size: ValueError in its slot, skipped
                        t = torch.empty(size, dtype=torch.uint8)
                        if kv.mget_h2d([key], [[t]])[0] is None:
                            check("mget_h2d", key, t.numpy().tobytes())
                elif op < 0.75:
                    batch = rng.sample(keys, 4)
                    for k, v in zip(batch, kv.mget(batch)):
                        if not isinstance(v, Exception):
                            check("mget", k, v)
                else:
                    for buf in kv.get_buffers([key]):  # a missing key's slot holds its KeyNotFound
                        if not isinstance(buf, Exception):
                            with buf:
                                check("get_buffers", key, buf)
            except KeyNotFound:
                pass
    return checked, bad


def small_writer(address: str, me: int, n: int, seconds: float = 0.0) -> tuple[int, int]:
    """Small sets (the lane's requests) mixed with large ones, overwrites, deletes and reads of my own keys,
    each checked; returns (values checked, requests that went through the lane). With ``seconds`` the job
    loops over its keys until then (a job to be killed midway)."""
    import kvstrata

    with kvstrata.connect(address, timeout=20, name=f"small-{me}") as kv:
        lane = kv._backend._lane
        before = lane.seq if lane is not None else 0
        checked = 0
        end = time.monotonic() + seconds
        rounds = 0
        while rounds == 0 or time.monotonic() < end:
            for i in range(n):
                key = f"s{me}/{i % 16}"
                value = payload(me, i + rounds)[:200] if i % 7 else payload(me, i)  # every 7th over the lane's size
                kv.set(key, value)
                if i % 5 == 0:
                    kv.delete([key])
                    value = b""
                    kv.set(key, value)  # empty values are values too
                got = kv.get(key)
                if got != value:
                    raise AssertionError(f"job {me}: {key} read back {len(got)} bytes, wrote {len(value)}")
                checked += 1
            rounds += 1
        return checked, (lane.seq if lane is not None else 0) - before
