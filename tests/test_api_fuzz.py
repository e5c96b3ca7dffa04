"""Every public call of a client with arguments of every wrong shape: each refusal is a TypeError, ValueError or
kvstrata error whose message names what was wrong, the client stays usable, and another client's data stays as
written. Embedded and through a worker; seeded, so a failure names the call that caused it and repeats."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch

from kv_helpers import client_for
from kvstrata import errors

#: what an error message must not be: Python's words for a bug, not ours for the argument at fault
GENERIC = re.compile(
    r"object is not|unhashable|not subscriptable|invalid literal|'NoneType' object|unsupported operand|"
    r"must be real number|cannot be interpreted|object has no attribute|not supported between|values to unpack|"
    r"internal error|argument \d+ is (shorter|longer)|index out of range"
)
METHODS = (
    "set", "get", "mget", "mset", "read", "delete", "exists", "expire", "size", "generate_key", "create",
    "get_buffers", "incref", "decref", "refcount", "mget_h2d", "mset_d2h", "dev_publish", "dev_subscribe",
    "dev_mset", "dev_mget", "dev_delete", "dev_local_delete", "dev_broadcast",
)  # fmt: skip
KEYWORDS = ("timeout", "ttl", "nx", "write_mode", "stream", "offset", "size", "receivers")
WAITS = {"get", "mget", "get_buffers", "mget_h2d", "dev_subscribe", "dev_mget"}
MEMORY = 32 << 20


@pytest.fixture(params=["embedded", "unix"])
def kv(request, worker):
    client = client_for(request.param, worker, memory=MEMORY, segment=8 << 20)
    yield client
    client.close()


def _value(r: random.Random, depth: int = 0):
    pool = (
        None, True, 0, -1, 7, 2**63, 1.5, math.nan, math.inf, "", "fz/a", "fz/" + "x" * 1100, b"", b"abc",
        bytearray(b"xy"), np.arange(3), torch.ones(3), torch.ones(2, 2).t(), ["fz/1", "fz/2"], ["fz/1", 3], [],
        {"a": 1}, object(), (1, 2),
    )  # fmt: skip
    k = r.randrange(16 if depth < 1 else 12)
    if k < 10:
        return r.choice(pool)
    if k == 10:
        return [[torch.ones(4)], [torch.ones(2)]]
    if k == 11:
        return [torch.ones(4)]
    if k == 12:
        return [_value(r, depth + 1) for _ in range(r.randrange(3))]
    if k == 13:
        return f"fz/{r.randrange(5)}"
    if k == 14:
        return [[_value(r, depth + 1)] for _ in range(2)]
    return {"fz/1": _value(r, depth + 1)}


def _unclear(exc: BaseException) -> bool:
    """Whether ``exc`` is not a clear refusal (a signature mismatch is Python's own, and clear)."""
    text = str(exc)
    if isinstance(exc, TypeError) and ("positional argument" in text or "unexpected keyword" in text):
        return False
    clear_type = isinstance(exc, TypeError | ValueError | errors.KvstrataError) and not isinstance(
        exc, errors.ServerError
    )
    return not clear_type or bool(GENERIC.search(text))


def _call(c, r: random.Random) -> tuple[str, tuple, dict, BaseException | None]:
    name = r.choice(METHODS)
    args = tuple(_value(r) for _ in range(r.randrange(4)))
    kw = {r.choice(KEYWORDS): _value(r) for _ in range(r.randrange(2))}
    t = kw.get("timeout")
    if name in WAITS and not (isinstance(t, int | float) and not isinstance(t, bool) and 0 <= t <= 0.05):
        kw["timeout"] = 0.01  # a missing key is waited for as long as the call says: not the point here
    try:
        out = getattr(c, name)(*args, **kw)
        for x in out if isinstance(out, list) else ():
            if hasattr(x, "result"):  # a device-object future: its refusal counts too
                try:
                    x.result(5)
                except Exception as exc:
                    return name, args, kw, exc
        if hasattr(out, "release"):
            out.release()
    except Exception as exc:
        return name, args, kw, exc
    return name, args, kw, None


@pytest.mark.parametrize("seed", [11, 12])
def test_wrong_arguments_are_refused_clearly_and_harm_nothing(kv, seed):
    r = random.Random(seed)
    written = {f"good/{i}": bytes([i + 1]) * (i * 4099) for i in range(8)}
    for key, value in written.items():
        kv.set(key, value)
    unclear = {}
    for _ in range(1200):
        name, args, kw, exc = _call(kv, r)
        if exc is not None and _unclear(exc):
            unclear.setdefault(f"{name}: {type(exc).__name__}: {exc!s:.100}", f"{args!r:.200} {kw!r:.80}")
    assert not unclear, "refusals that do not name what was wrong:\n" + "\n".join(
        f"{what}\n    from {call}" for what, call in unclear.items()
    )
    for key, value in written.items():  # no call above names these keys: they stand as written
        assert kv.get(key) == value, key
    kv.set("after", b"ok")
    assert kv.get("after") == b"ok"
    kv.delete([*written, "after"])
