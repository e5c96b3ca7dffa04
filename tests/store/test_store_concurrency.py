"""Threads hammering put/get/acquire/create/delete on shared keys, under eviction and spilling.

Every value carries the xxh64 of its own body, so a reader that saw a torn or recycled buffer
would notice."""

from __future__ import annotations

import random
import threading
import time

import xxhash

from kvstrata.errors import CapacityError, KeyExists, KeyNotFound
from kvstrata.store import ObjectStore, WriteMode

MODES = [WriteMode.MEMORY, WriteMode.EVICTABLE, WriteMode.WRITE_THROUGH, WriteMode.WRITE_BACK]


def _value(rng: random.Random) -> bytes:
    body = rng.randbytes(rng.choice([0, 10, 1000, 30_000, 100_000]))
    return xxhash.xxh64_digest(body) + body


def _check(data) -> None:
    data = bytes(data)
    assert xxhash.xxh64_digest(data[8:]) == data[:8], "torn or recycled value"


def test_threads_hammer_shared_keys(tmp_path, make_config):
    s = ObjectStore(make_config(tmp_path, memory=1 << 20, segment=1 << 20, disk=64 << 20, flush_interval=0.005))
    keys = [f"k{i}" for i in range(40)]
    errors: list[BaseException] = []
    ops = [0]
    stop = time.monotonic() + 1.5

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        try:
            while time.monotonic() < stop:
                k = rng.choice(keys)
                r = rng.random()
                try:
                    if r < 0.35:
                        s.put(k, _value(rng), write_mode=rng.choice(MODES))
                    elif r < 0.6:
                        _check(s.get_bytes(k))
                    elif r < 0.8:
                        lease = s.acquire(k, owner=seed)
                        try:
                            _check(s.buffer(lease.location))
                            time.sleep(0)  # let others replace/delete it under our lease
                            _check(s.buffer(lease.location))
                        finally:
                            s.release(lease.lease_id)
                    elif r < 0.9:
                        v = _value(rng)
                        loc = s.create(k, len(v), owner=seed)
                        s.buffer(loc)[:] = v
                        if rng.random() < 0.1:
                            s.abort(k, owner=seed)
                        else:
                            s.seal(k, owner=seed)
                    else:
                        s.delete([k])
                except (KeyNotFound, CapacityError):
                    pass
                n += 1
        except BaseException as exc:
            errors.append(exc)
        ops[0] += n

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[0]
    assert ops[0] > 500
    st = s.stats()
    assert st["leases"] == 0 and st["creates_in_progress"] == 0
    assert st["evictions"] + st["spills"] > 0 and st["promotions"] > 0, st  # the tiers were exercised
    for k in keys:  # whatever survived is intact, wherever it lives
        try:
            _check(s.get_bytes(k))
        except KeyNotFound:
            pass
    s.flush()
    s.delete(keys)
    # a background spill or flush may still hold a pin on a deleted object for a moment
    deadline = time.monotonic() + 2
    while s.stats()["tiers"]["memory"]["used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.stats()["tiers"]["memory"]["used"] == 0
    assert s.stats()["tiers"]["disk"]["used"] == 0
    s.close()


def test_nx_races_have_exactly_one_winner(make_config):
    s = ObjectStore(make_config())
    for round_ in range(20):
        key = f"once{round_}"
        wins: list[int] = []
        barrier = threading.Barrier(4)

        def writer(i: int, key: str = key, wins: list = wins, barrier=barrier) -> None:
            barrier.wait()
            try:
                s.put(key, b"%d" % i * (1 + i * 30_000), nx=True)  # mixes the small and large paths
                wins.append(i)
            except KeyExists:
                pass

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert s.get_bytes(key) == b"%d" % wins[0] * (1 + wins[0] * 30_000)
    s.close()
