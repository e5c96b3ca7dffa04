"""Checks of a device-object request's arguments, made before the broker changes anything.

The broker's operations read their arguments as the client library builds them. A request shaped otherwise
(another program speaking the protocol, a client bug) is refused here, whole, with a ``TypeError`` or
``ValueError`` naming the field (``a.items[2].tensors[0].shape``), and the broker stays as it was: no object
half-registered by a publish whose third item was bad, and no record stored that would fail later, inside
another client's subscribe or match (a record's tensor specs and device are read there).

Only what the broker reads is checked: a record's other fields (its exports, events) go to its readers as
they are, and a reader checks what it imports (:mod:`kvstrata.devobj.receive`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

_NONE = type(None)


def _fail(name: str, what: str, value: Any, error: type[Exception] = TypeError) -> None:
    """Raise ``error`` for field ``name``, which should be ``what`` and is ``value``."""
    shown = type(value).__name__ if isinstance(value, dict | list | tuple) else f"{type(value).__name__} {value!r:.60}"
    raise error(f"{name}: expected {what}, got {shown}")


def _key(value: Any, name: str) -> None:
    if type(value) is not str or not value:
        _fail(name, "a non-empty str", value, ValueError if type(value) is str else TypeError)


def _keys(value: Any, name: str) -> None:
    if type(value) is not list and type(value) is not tuple:
        _fail(name, "a list of keys", value)
    if not all(type(k) is str and k for k in value):
        for i, k in enumerate(value):
            _key(k, f"{name}[{i}]")


def _int(value: Any, name: str) -> None:
    if type(value) is not int:
        _fail(name, "an int", value)


def _ints(value: Any, name: str) -> None:
    if type(value) is not list and type(value) is not tuple:
        _fail(name, "a list of ints", value)
    for i, x in enumerate(value):
        _int(x, f"{name}[{i}]")


def check_seconds(value: Any, name: str) -> None:
    """A timeout: None (no limit) or a number of seconds >= 0 (TypeError / ValueError naming ``name``)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, "a number of seconds >= 0 or None", value)
    if not value >= 0:  # NaN fails too
        _fail(name, "a number of seconds >= 0 or None", value, ValueError)


def _optional(kind: type | tuple[type, ...], what: str) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if value is not None and not isinstance(value, kind):
            _fail(name, f"{what} or None", value)

    return check


def _specs(value: Any, name: str, seen: set[int]) -> None:
    """A key's tensor specs: a non-empty list of ``{"shape": [int >= 0, ...], "dtype": str}`` (``seen``: ids
    of spec lists checked already in this request: a many-key call repeats one list object)."""
    if id(value) in seen:
        return
    if type(value) is not list and type(value) is not tuple:
        _fail(name, "a non-empty list of tensor specs", value)
    if not value:
        _fail(name, "a non-empty list of tensor specs", value, ValueError)
    for j, spec in enumerate(value):
        where = f"{name}[{j}]"
        if type(spec) is not dict:
            _fail(where, "a tensor spec (a map)", spec)
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if type(shape) is not list and type(shape) is not tuple:
            _fail(f"{where}.shape", "a list of ints", shape)
        for k, d in enumerate(shape):
            if type(d) is not int or d < 0:
                _fail(f"{where}.shape[{k}]", "an int >= 0", d, ValueError if type(d) is int else TypeError)
        _key(dtype, f"{where}.dtype")
    seen.add(id(value))


def _record(item: Any, name: str, seen: set[int]) -> None:
    """A publish / mset / broadcast item: what the broker stores and reads of it later."""
    if type(item) is not dict:
        _fail(name, "a record (a map)", item)
    _key(item.get("key"), f"{name}.key")
    _specs(item.get("tensors"), f"{name}.tensors", seen)
    for field, check in _RECORD_FIELDS:
        if field in item:
            check(item[field], f"{name}.{field}")


_RECORD_FIELDS: tuple[tuple[str, Callable[[Any, str], None]], ...] = (
    ("device", _optional(dict, "a device record (a map)")),
    ("node_id", _optional(str, "a str")),
    ("pid", _optional(int, "an int")),
    ("transport", _optional(str, "a str")),
    ("handles", _optional(list | tuple, "a list")),
    ("events", _optional(list | tuple, "a list")),
)


def _items(value: Any, name: str) -> None:
    if type(value) is not list and type(value) is not tuple:
        _fail(name, "a list of records", value)
    seen: set[int] = set()
    for i, item in enumerate(value):
        _record(item, f"{name}[{i}]", seen)


def _waits(args: dict[str, Any]) -> None:
    """subscribe / mget: keys, per-key specs (or None), the timeout, the records the reader holds."""
    keys = args.get("keys")
    _keys(keys, "a.keys")
    specs = args.get("specs")
    if specs is not None:
        if type(specs) is not list and type(specs) is not tuple:
            _fail("a.specs", "a list of spec lists (one per key) or None", specs)
        if len(specs) != len(keys):
            raise ValueError(f"a.specs: {len(specs)} spec lists for {len(keys)} keys (expected one per key)")
        seen: set[int] = set()
        for i, s in enumerate(specs):
            if s is not None:
                _specs(s, f"a.specs[{i}]", seen)
    check_seconds(args.get("timeout"), "a.timeout")
    known = args.get("known")
    if known is not None:
        if type(known) is not list and type(known) is not tuple:
            _fail("a.known", "a list of object ids (or None per key)", known)
        for i, k in enumerate(known):
            if k is not None and type(k) is not int:
                _fail(f"a.known[{i}]", "an object id (int) or None", k)


def _completion(item: Any, name: str) -> None:
    if type(item) is not dict:
        _fail(name, "a completion (a map)", item)
    _int(item.get("tid"), f"{name}.tid")
    _optional(str, "a str")(item.get("error"), f"{name}.error")


def _field(name: str, check: Callable[[Any, str], None]) -> Callable[[dict[str, Any]], None]:
    return lambda args: check(args.get(name), f"a.{name}")


def _required(name: str, what: str) -> Callable[[dict[str, Any]], None]:
    def check(args: dict[str, Any]) -> None:
        if args.get(name) is None:
            _fail(f"a.{name}", what, None)

    return check


def _map(value: Any, name: str) -> None:
    if type(value) is not dict:
        _fail(name, "a map", value)


def _list_of(check: Callable[[Any, str], None], what: str) -> Callable[[Any, str], None]:
    def check_all(value: Any, name: str) -> None:
        if type(value) is not list and type(value) is not tuple:
            _fail(name, what, value)
        for i, x in enumerate(value):
            check(x, f"{name}[{i}]")

    return check_all


def _broadcast(args: dict[str, Any]) -> None:
    _record(args.get("item"), "a.item", set())


#: per operation, the checks of its arguments (``done``, which any request may carry, is checked for all)
CHECKS: dict[str, tuple[Callable[[dict[str, Any]], None], ...]] = {
    "hello": (_field("info", _optional(dict, "a map")),),
    "publish": (_field("items", _items),),
    "mset": (_field("items", _items),),
    "broadcast": (_broadcast,),
    "subscribe": (_waits,),
    "mget": (_waits,),
    "cancel": (_field("wids", _ints),),
    "delete": (_field("keys", _keys),),
    "local_delete": (_field("keys", _keys),),
    "complete": (lambda args: _completion(args, "a"),),
    "complete_many": (_field("items", _list_of(_completion, "a list of completions")),),
    "pair_uid": (_field("src", _key), _required("uid", "the NCCL pair's unique id")),
    "chain_ready": (_field("tid", _int), _field("export", _map)),
    "member_ready": (_field("tid", _int), _field("export", _map)),
    "wait_events": (_field("timeout", check_seconds),),
    "goodbye": (_field("taken", _optional(list | tuple, "a list")),),
    # offer_fate checks its own (a stale or bad answer is an answer, not an error: kvstrata.devobj.broker_offers)
}


def check_args(op: str, args: Any) -> None:
    """Refuse ``args`` of device-object operation ``op`` unless they are shaped as the broker reads them
    (TypeError / ValueError naming the field); unknown operations are the broker's to refuse."""
    if type(args) is not dict:
        _fail("a", "the operation's arguments (a map)", args)
    done = args.get("done")
    if done is not None and type(done) is not list and type(done) is not tuple:
        _fail("a.done", "a list of completions", done)
    for check in CHECKS.get(op, ()):
        check(args)


__all__ = ["CHECKS", "check_args", "check_seconds"]
