"""Malformed requests from a peer that speaks the worker's protocol badly: every one is answered with an error that
names what was wrong, none hangs the connection or reaches the worker's internals, and the data other clients
wrote stays as they wrote it.

Seeded random requests: every op the worker knows (and the device-object operations behind ``dev``), with the
protocol's field names carrying values of every shape (wrong types, negatives, huge numbers, NaN, nested junk).
Each request carries a tag, so its reply is told apart from anything else on the connection.
"""

from __future__ import annotations

import math
import random
import re

import pytest

import kvstrata
from kvstrata.errors import Timeout
from kvstrata.server import protocol as P
from kvstrata.server.handlers import HANDLERS
from kvstrata.transport import connect as raw_connect


def _names(text: str) -> list[str]:
    return text.split()


#: the protocol's field names (kvstrata.server.protocol, kvstrata.devobj.service), each request draws from
FIELDS = _names(
    "keys key items v size offset ttl nx mode timeout cache placements landing linger rel abort_keys ids indices "
    "tag dop cid a t ow done specs tid ok error src uid export item known lean obj took taken wids info"
)
DEV_OPS = _names(
    "hello publish mset broadcast subscribe mget cancel delete local_delete complete complete_many pair_uid "
    "chain_ready member_ready offer_fate wait_events goodbye nonsense"
)
#: what an error message must not be: Python's words for a bug, not ours for the field at fault
GENERIC = re.compile(
    r"object is not|unhashable|not subscriptable|positional argument|invalid literal|'NoneType' object|"
    r"unsupported operand|must be real number|cannot be interpreted|object has no attribute|not supported between|"
    r"values to unpack|internal error|argument \d+ is (shorter|longer)"
)
REPLY_S = 5.0


def _value(r: random.Random, depth: int = 0):
    k = r.randrange(15 if depth < 2 else 11)
    if k == 0:
        return None
    if k == 1:
        return r.choice([True, False])
    if k == 2:
        return r.choice([0, 1, -1, 7, 4096, 2**31, 2**63 - 1, -(2**63), 1 << 40])
    if k == 3:
        return r.choice([0.0, -1.5, 0.001, 1e300, math.inf, -math.inf, math.nan])
    if k == 4:
        return r.choice(["", "fz/a", "fz/" + "x" * 2000, "fz/\u00e9", "memory", "evictable", "nope"])
    if k == 5:
        return r.choice([b"", b"abc", bytes(5000)])
    if k == 6:
        return f"fz/{r.randrange(20)}"
    if k == 7:
        return r.randrange(-3, 100)
    if k == 8:
        return [f"fz/{r.randrange(20)}" for _ in range(r.randrange(4))]
    if k == 9:
        return [r.randrange(-2, 50) for _ in range(r.randrange(4))]
    if k == 10:
        return [[f"fz/{r.randrange(20)}", r.randrange(-1, 9000), r.randrange(-1, 1 << 20)] for _ in range(3)]
    if k == 11:
        return [_value(r, depth + 1) for _ in range(r.randrange(4))]
    if k == 12:
        return {r.choice(FIELDS): _value(r, depth + 1) for _ in range(r.randrange(5))}
    if k == 13:
        return [{"shape": [r.randrange(-1, 4)], "dtype": r.choice(["uint8", "", 3])} for _ in range(2)]
    return [{r.choice(FIELDS): _value(r, depth + 1) for _ in range(r.randrange(5))} for _ in range(r.randrange(3))]


def _request(r: random.Random, tag: int) -> dict:
    op = r.choice([*HANDLERS, "nonsense"])
    msg = {r.choice(FIELDS): _value(r) for _ in range(r.randrange(6))}
    if op == "dev":
        msg["dop"] = r.choice(DEV_OPS)
        msg["cid"] = r.choice(["fzc", "fzc2", "", 3])
        if r.random() < 0.8:
            msg["a"] = {r.choice(FIELDS): _value(r) for _ in range(r.randrange(6))}
        if msg["dop"] == "wait_events":  # a long poll answers when an event comes or "t" is up: never here
            msg["t"] = 0.01
    for name in ("timeout", "t"):  # a read of a missing key may wait as long as it is told to (by design)
        v = msg.get(name)
        if isinstance(v, int | float) and not isinstance(v, bool) and v > 0.05:
            msg[name] = 0.01
    a = msg.get("a")
    if isinstance(a, dict) and isinstance(a.get("timeout"), int | float) and not a["timeout"] <= 0.05:
        a["timeout"] = 0.01
    msg["op"], msg["tag"] = op, tag
    return msg


def _reply(conn, tag: int, msg: dict) -> dict:
    """The reply carrying ``tag`` (a parked device-object poll may answer in between: skipped)."""
    while True:
        try:
            reply = conn.recv(timeout=REPLY_S)[0]
        except Timeout:
            pytest.fail(f"no reply within {REPLY_S} s to {msg!r:.300}")
        if reply.get("tag") == tag:
            return reply


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_malformed_requests_get_clear_errors_and_harm_nobody(worker, seed):
    r = random.Random(seed)
    good = kvstrata.connect(worker.address)
    written = {f"good/{i}": bytes([i]) * (i * 997) for i in range(12)}
    for key, value in written.items():
        good.set(key, value)
    conn = raw_connect(worker.address, timeout=5)
    unclear: dict[str, dict] = {}
    answered = 0
    try:
        for tag in range(1, 1501):
            msg = _request(r, tag)
            conn.send(msg)
            one_way = msg["op"] in P.ONE_WAY_OPS or (msg["op"] == "dev" and msg.get("ow"))
            if one_way:  # no reply: a ping behind it shows the connection still serves
                msg = {"op": "ping", "tag": tag}
                conn.send(msg)
            reply = _reply(conn, tag, msg)
            answered += 1
            err = reply.get("err")
            if err is None:
                continue
            name, text = err
            if GENERIC.search(text) or (name == "ServerError" and "unknown" not in text and "need" not in text):
                unclear.setdefault(f"{msg.get('op')}/{msg.get('dop', '')}: {name}: {text:.100}", msg)
    finally:
        conn.close()
    assert not unclear, "errors that do not name what was wrong:\n" + "\n".join(
        f"{what}\n    from {msg!r:.300}" for what, msg in unclear.items()
    )
    assert answered == 1500
    for key, value in written.items():  # acknowledged data, untouched
        assert good.get(key) == value, key
    with kvstrata.connect(worker.address) as fresh:  # and the worker serves newcomers as before
        fresh.set("after", b"x")
        assert fresh.get("after") == b"x"
        assert fresh.stats()["clients"] >= 2
    good.close()


@pytest.mark.parametrize(
    ("msg", "name", "words"),
    [
        ({"op": "ping", "rel": 5}, "InvalidType", "rel: expected a list of ints"),
        ({"op": "ping", "rel": [1, "2"]}, "InvalidType", "rel[1]: expected an int"),
        ({"op": "ping", "abort_keys": 5}, "InvalidType", "abort_keys: expected a str or an iterable of str"),
        ({"op": "mput", "items": 7}, "InvalidType", "items: expected a list of [key, value] pairs"),
        ({"op": "segments", "indices": ["a"]}, "InvalidType", "indices[0]: expected an int"),
        ({"op": "get", "key": "k", "timeout": math.nan}, "InvalidValue", "timeout: must be >= 0 seconds"),
        ({"op": "put", "key": "k", "v": b"x", "ttl": math.nan}, "InvalidValue", "ttl: must be >= 0 seconds"),
        ({"op": "dev", "dop": "mset", "cid": "c", "a": {"items": [{"key": "k"}]}}, "InvalidType", "a.items[0].tensors"),
    ],
)
def test_the_worker_names_the_field_at_fault(worker, msg, name, words):
    with raw_connect(worker.address, timeout=5) as conn:
        conn.send(msg)
        err = conn.recv(timeout=REPLY_S)[0]["err"]
        assert err[0] == name and words in err[1], err
        # per-key results stand: a malformed pair, an empty key, a value that is not bytes
        conn.send({"op": "mput", "items": [["k1", b"a"], ["k2"], ["k3", b"c"], ["", b"d"], ["k5", 5], ["k6", b""]]})
        items = conn.recv(timeout=REPLY_S)[0]["items"]
        assert items[0] == {} and items[2] == {} and items[5] == {}
        assert "items[1]: expected a [key, value] pair, got a list of 1" in str(items[1])
        assert "must not be empty" in str(items[3]) and "expected bytes" in str(items[4])
        conn.send({"op": "mget", "keys": ["k1", "k3", "k5", "k6"]})
        got = conn.recv(timeout=REPLY_S)[0]
        assert "KeyNotFound" in str(got) and "k5" in str(got), got  # the refused pair wrote nothing


def test_a_read_that_names_no_timeout_does_not_wait(worker):
    with raw_connect(worker.address, timeout=5) as conn:
        for msg in ({"op": "get", "key": "missing"}, {"op": "mget", "keys": ["missing"]}):
            conn.send(msg)
            reply = conn.recv(timeout=REPLY_S)[0]  # at once: a left-out timeout is 0, not "until it exists"
            assert "KeyNotFound" in str(reply), reply


@pytest.mark.parametrize("op", [[1], {"a": 1}, None, 7, b"get"])
def test_a_lane_request_of_any_op_type_gets_an_error_reply(op):
    """An unhashable op (a list) raised TypeError out of the session: the client was dropped with a traceback in the
    worker's log, where the same request on the socket gets an error record."""
    from kvstrata.server.session import Session

    reply = Session._handle_lane(object(), {"op": op})  # refused before anything of the session is used
    assert "cannot travel through the lane" in P.error_from_record(reply["err"]).args[0]
