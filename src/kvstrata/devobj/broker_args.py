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

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.server.protocol import FOREVER_S

_NONE = type(None)
_SEQ = (list, tuple)
_STRS = frozenset((str,))
_INTS = frozenset((int,))  # bool is not int here: True is no id
_INTS_OR_NONE = frozenset((int, _NONE))


def _fail(name: str, what: str, value: Any, error: type[Exception] = InvalidType) -> None:
    """Raise ``error`` for field ``name``, which should be ``what`` and is ``value``."""
    shown = type(value).__name__ if isinstance(value, dict | list | tuple) else f"{type(value).__name__} {value!r:.60}"
    raise error(f"{name}: expected {what}, got {shown}")


def _key(value: Any, name: str) -> None:
    if type(value) is not str or not value:
        _fail(name, "a non-empty str", value, InvalidValue if type(value) is str else InvalidType)


# The checks below test the common, well-formed case with C loops (a many-key request costs the broker a few
# microseconds here) and build field names only to say what is wrong.
def _keys(value: Any, name: str) -> None:
    if type(value) not in _SEQ:
        _fail(name, "a list of keys", value)
    if not (_STRS.issuperset(map(type, value)) and all(value)):
        for i, k in enumerate(value):
            _key(k, f"{name}[{i}]")


def _int(value: Any, name: str) -> None:
    if type(value) is not int:
        _fail(name, "an int", value)


def _ints(value: Any, name: str) -> None:
    if type(value) not in _SEQ:
        _fail(name, "a list of ints", value)
    if not _INTS.issuperset(map(type, value)):
        for i, x in enumerate(value):
            _int(x, f"{name}[{i}]")


def check_seconds(value: Any, name: str) -> float | None:
    """A timeout: None (no limit) or a number of seconds >= 0 (TypeError / ValueError naming ``name``).

    Returns it as the broker keeps it: seconds as a float, or None for no limit, which
    :data:`~kvstrata.server.protocol.FOREVER_S` or more (infinity too) also means, as it does for the client's
    timeouts (``check_timeout``) and the waiters' deadlines: no deadline past the clock's range is ever computed.
    """
    if value is None:
        return None
    if (type(value) is float or type(value) is int) and value >= 0:  # the common case; NaN fails
        return float(value) if value < FOREVER_S else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, "a number of seconds >= 0 or None", value)
    if not value >= 0:  # NaN fails too
        _fail(name, "a number of seconds >= 0 or None", value, InvalidValue)
    return float(value) if value < FOREVER_S else None


def _specs(value: Any, name: str) -> None:
    """A key's tensor specs: a non-empty list of ``{"shape": [int >= 0, ...], "dtype": non-empty str}``."""
    if type(value) not in _SEQ:
        _fail(name, "a non-empty list of tensor specs", value)
    if not value:
        _fail(name, "a non-empty list of tensor specs", value, InvalidValue)
    for j, spec in enumerate(value):
        if type(spec) is not dict:
            _fail(f"{name}[{j}]", "a tensor spec (a map)", spec)
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if type(shape) not in _SEQ or not _INTS.issuperset(map(type, shape)) or (shape and min(shape) < 0):
            if type(shape) not in _SEQ:
                _fail(f"{name}[{j}].shape", "a list of ints", shape)
            for k, d in enumerate(shape):
                if type(d) is not int or d < 0:
                    _fail(f"{name}[{j}].shape[{k}]", "an int >= 0", d, InvalidValue if type(d) is int else InvalidType)
        if type(dtype) is not str or not dtype:
            _key(dtype, f"{name}[{j}].dtype")


#: a record's fields the broker reads besides its key and tensors: (field, types allowed besides None, what)
_RECORD_FIELDS = (
    ("device", (dict,), "a device record (a map)"),
    ("node_id", (str,), "a str"),
    ("pid", (int,), "an int"),
    ("transport", (str,), "a str"),
    ("handles", _SEQ, "a list"),
    ("events", _SEQ, "a list"),
)


def _record(item: Any, name: str, seen: set[int]) -> None:
    """A publish / mset / broadcast item: what the broker stores and reads of it later (``seen``: ids of spec
    lists checked already in this request: a client's items of one shape share one list object)."""
    if type(item) is not dict:
        _fail(name, "a record (a map)", item)
    get = item.get
    key = get("key")
    if type(key) is not str or not key:
        _key(key, f"{name}.key")
    tensors = get("tensors")
    if id(tensors) not in seen:
        _specs(tensors, f"{name}.tensors")
        seen.add(id(tensors))
    for field, types, what in _RECORD_FIELDS:
        value = get(field)
        if value is not None and type(value) not in types:
            _fail(f"{name}.{field}", f"{what} or None", value)


def _items(value: Any, name: str) -> None:
    if type(value) not in _SEQ:
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
        if type(specs) not in _SEQ:
            _fail("a.specs", "a list of spec lists (one per key) or None", specs)
        if len(specs) != len(keys):
            raise InvalidValue(f"a.specs: {len(specs)} spec lists for {len(keys)} keys (expected one per key)")
        if specs and specs.count(specs[0]) == len(specs):  # one shape for every key (C loop; equal, equally good)
            if specs[0] is not None:
                _specs(specs[0], "a.specs[0]")
        else:
            for i, spec in {id(s): (i, s) for i, s in enumerate(specs)}.values():
                if spec is not None:
                    _specs(spec, f"a.specs[{i}]")
    check_seconds(args.get("timeout"), "a.timeout")
    known = args.get("known")
    if known is not None:
        if type(known) not in _SEQ:
            _fail("a.known", "a list of object ids (or None per key)", known)
        if not _INTS_OR_NONE.issuperset(map(type, known)):
            for i, k in enumerate(known):
                if k is not None and type(k) is not int:
                    _fail(f"a.known[{i}]", "an object id (int) or None", k)


def _optional(types: tuple[type, ...], what: str) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if value is not None and type(value) not in types:
            _fail(name, f"{what} or None", value)

    return check


def _completion(item: Any, name: str) -> None:
    if type(item) is not dict:
        _fail(name, "a completion (a map)", item)
    _int(item.get("tid"), f"{name}.tid")
    _optional((str,), "a str")(item.get("error"), f"{name}.error")


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
        if type(value) not in _SEQ:
            _fail(name, what, value)
        for i, x in enumerate(value):
            check(x, f"{name}[{i}]")

    return check_all


#: a client's hello info, fields the broker reads when it matches that client's receives and publishes (the path of a
#: copy, a broadcast's groups): (field, types allowed besides None, what)
_INFO_FIELDS = (
    ("pid", (int,), "an int"),
    ("node_id", (str,), "a str"),
    ("device", (dict,), "a device record (a map)"),
    ("visible", _SEQ, "a list of GPU uuids (str)"),
)


def _info(value: Any, name: str) -> None:
    """hello's ``info`` (None or a map): checked here, because the broker reads it later inside other clients'
    requests (a publish matching this client's receive), where a bad field would fail them instead."""
    if value is None:
        return
    if type(value) is not dict:
        _fail(name, "a map or None", value)
    for field, types, what in _INFO_FIELDS:
        x = value.get(field)
        if x is not None and type(x) not in types:
            _fail(f"{name}.{field}", f"{what} or None", x)
    visible = value.get("visible")
    if visible is not None and not _STRS.issuperset(map(type, visible)):
        for i, uuid in enumerate(visible):
            if type(uuid) is not str:
                _fail(f"{name}.visible[{i}]", "a GPU uuid (str)", uuid)
    uuid = (value.get("device") or {}).get("uuid")
    if uuid is not None and type(uuid) is not str:
        _fail(f"{name}.device.uuid", "a str or None", uuid)


def _broadcast(args: dict[str, Any]) -> None:
    _record(args.get("item"), "a.item", set())


#: per operation, the checks of its arguments (``done``, which any request may carry, is checked for all)
CHECKS: dict[str, tuple[Callable[[dict[str, Any]], None], ...]] = {
    "hello": (_field("info", _info),),
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
    "nccl_failed": (_field("tid", _int),),
    "chain_ready": (_field("tid", _int), _field("export", _map)),
    "member_ready": (_field("tid", _int), _field("export", _map)),
    "wait_events": (_field("timeout", check_seconds),),
    "goodbye": (_field("taken", _optional(_SEQ, "a list")),),
    # offer_fate checks its own (a stale or bad answer is an answer, not an error: kvstrata.devobj.broker_offers)
}


def check_args(op: str, args: Any) -> None:
    """Refuse ``args`` of device-object operation ``op`` unless they are shaped as the broker reads them
    (TypeError / ValueError naming the field); unknown operations are the broker's to refuse."""
    if type(args) is not dict:
        _fail("a", "the operation's arguments (a map)", args)
    done = args.get("done")
    if done is not None and type(done) not in _SEQ:
        _fail("a.done", "a list of completions", done)
    for check in CHECKS.get(op, ()):
        check(args)


__all__ = ["CHECKS", "check_args", "check_seconds"]
