"""The client <-> worker message protocol: request ops, replies, error records, write options.

A request is ``{"op": name, ...fields}``; the reply is ``{...fields}`` or ``{"err": [type, message]}``.
Batch ops answer ``{"items": [...]}``, one entry per key, where a failed key is its own error record.
Object locations travel as ``[segment, offset, size]``; a reply that mentions a segment this client
has not been sent yet carries ``{"segs": [[index, nbytes], ...]}`` and the segments' descriptors.
``release`` is one-way (no reply) so a zero-copy read costs one round trip. ``get`` and ``acquire``
with ``"cache": true`` mark leases the client may keep for local reads (``kvstrata.server.validity``).
A request may carry ``"tag": n``: its reply then carries the same tag, so a client can keep several
requests in flight on one connection (replies still come in request order) and match each reply to
its sender (``RemoteBackend.send_tagged``; the device calls pipeline their stages this way).
A read's ``"timeout"`` (``get``, ``mget``, ``acquire``) is seconds to wait for a missing key: left out, 0 (do not
wait); ``None``, until the key exists.
``reserve`` gives a client an extent of shared memory to lay new objects in without asking where, and
``commit`` makes the objects it wrote there sealed objects (``kvstrata.store.reservations``).
A ``commit`` with ``"landing": true`` may go before the copies into its objects finished: it is answered at
once, and its objects become visible when the client stores its tag in the lane page's ``landed`` word (freed
when it stores it in ``cancelled``: the copies failed).
Any request may carry ``"linger": us``, and the one-way ``linger`` op carries only that: the client's next
request follows within that many microseconds, so the worker's thread for it keeps polling until then (where
the worker polls at all) instead of going to sleep and paying a wake-up when it comes.
A worker whose hello says ``"columns": 1`` also takes a ``commit``'s items as columns (``"keys"``, and ``"sizes"``
and ``"offsets"`` as :func:`int_column` bytes) and answers an ``acquire`` with ``"cols": 1`` with its integer
columns as such bytes: a 256-key batch encodes and decodes in ~25-35 us instead of ~110 (one int at a time).
"""

from __future__ import annotations

import array
import numbers
from typing import Any

import kvstrata.errors as kverrors
from kvstrata.errors import InvalidType, InvalidValue

#: values below this many bytes travel inside the message; larger ones through shared memory
INLINE_MAX = 64 << 10
#: most keys one batch request may name (the seed's 100,000-key exists, with room)
MAX_BATCH = 100_000
MAX_KEY_BYTES = 1024
WRITE_MODES = ("memory", "write_through", "write_back", "evictable")
ONE_WAY_OPS = frozenset({"release", "linger"})
#: writes a cluster client routes by its member list, and tags with that list's fingerprint (``"view"``): a worker
#: whose own list differs refuses the keys it does not own under its list, each (:class:`~kvstrata.errors.NotOwner`)
ROUTED_WRITE_OPS = frozenset({"put", "mput", "create", "mcreate", "commit"})
_INT = frozenset({int})

_ERROR_TYPES: dict[str, type[BaseException]] = {
    name: getattr(kverrors, name) for name in kverrors.__all__ if isinstance(getattr(kverrors, name), type)
}
_ERROR_TYPES.update(ValueError=ValueError, TypeError=TypeError)


def error_record(exc: BaseException) -> dict[str, Any]:
    """``{"err": [type name, message]}``: what a worker replies for a refused request or key."""
    name = type(exc).__name__
    if name not in _ERROR_TYPES:
        # the nearest kvstrata class the client knows (e.g. a store-private subclass)
        name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERROR_TYPES), "ServerError")
    return {"err": [name, str(exc)]}


def error_from_record(record: list | tuple) -> BaseException:
    """The exception an error record stands for, of the same class the worker raised."""
    try:
        name, message = record
    except (TypeError, ValueError):
        return kverrors.ProtocolError(f"malformed error record {record!r:.200}")
    cls = _ERROR_TYPES.get(name)
    if cls is None:
        return kverrors.ServerError(f"{name}: {message}")
    return cls(message)


def check_key(key: Any, name: str = "key") -> str:
    """A key the worker can be sent: a str of 1 to :data:`MAX_KEY_BYTES` bytes in UTF-8 (so no lone surrogate, which
    UTF-8 cannot encode), else InvalidValue/InvalidType naming ``name``, as the embedded store's check words it. An
    ASCII key (``isascii`` reads a flag the str keeps) needs no encoding; any other is encoded once, which checks both
    its length and that it encodes (a lone surrogate let through made the client's request fail to encode, after the
    releases riding along with it had been taken: session 38)."""
    if not isinstance(key, str):
        raise InvalidType(f"{name}: must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidValue(f"{name}: must not be empty")
    if key.isascii():
        nbytes = len(key)
    else:
        try:
            nbytes = len(key.encode())
        except UnicodeEncodeError:
            raise InvalidValue(f"{name}: not encodable as UTF-8 (lone surrogate?)") from None
    if nbytes > MAX_KEY_BYTES:
        raise InvalidValue(f"{name}: {nbytes} bytes long, over the {MAX_KEY_BYTES}-byte limit")
    return key


def check_keys(keys: Any, name: str = "keys") -> list[str]:
    """A list of keys :func:`check_key` passes (a single str is one key) of at most ``MAX_BATCH`` entries."""
    if isinstance(keys, str):
        keys = [keys]
    elif isinstance(keys, bytes | bytearray | memoryview):  # iterable, as ints: say what is wrong with it
        raise InvalidType(f"{name}: expected a str or an iterable of str, got {type(keys).__name__} (decode it)")
    try:
        keys = list(keys)
    except TypeError:
        raise InvalidType(f"{name}: expected a str or an iterable of str, got {type(keys).__name__}") from None
    if len(keys) > MAX_BATCH:
        raise InvalidValue(f"{name}: {len(keys)} keys, over the {MAX_BATCH} per call limit")
    if not keys:
        return keys
    # The common case, in C loops: the join checks every key is a str, its flag that all are ASCII (a byte a
    # character, so the lengths are the byte counts). 64 keys: 3.6 us, against 5.1 for the check before session 38,
    # which looked at types and lengths only (development machine).
    try:
        ascii_only = "".join(keys).isascii()
    except TypeError:  # not all str: named below
        ascii_only = False
    if ascii_only and 0 not in (lengths := set(map(len, keys))) and max(lengths) <= MAX_KEY_BYTES:
        return keys
    for i, key in enumerate(keys):
        check_key(key, f"{name}[{i}]")
    return keys


def check_ids(ids: Any, name: str = "ids") -> list[int]:
    """A list of ids (lease ids, segment indices): ints, as the client sends them."""
    if type(ids) is not list and type(ids) is not tuple:
        raise InvalidType(f"{name}: expected a list of ints, got {type(ids).__name__}")
    if not _INT.issuperset(map(type, ids)):  # bool is not int here: True is no id
        bad = next(i for i, x in enumerate(ids) if type(x) is not int)
        raise InvalidType(f"{name}[{bad}]: expected an int, got {type(ids[bad]).__name__}")
    return ids if type(ids) is list else list(ids)


def int_column(values: Any) -> bytes:
    """Integers as one bytes column: int64 in the host's order (client and worker share the host)."""
    return array.array("q", values).tobytes()


def column_ints(raw: Any, n: int, name: str) -> list[int]:
    """The ``n`` integers of an :func:`int_column`; InvalidType naming ``name`` where it is not one."""
    if type(raw) is not bytes or len(raw) != 8 * n:
        got = f"{len(raw)} bytes" if type(raw) is bytes else type(raw).__name__
        raise InvalidType(f"{name}: expected {n} int64s as {8 * n} bytes, got {got}")
    column = array.array("q")
    column.frombytes(raw)
    return column.tolist()


#: a timeout or TTL of this many seconds or more (~31 years; infinity too) means forever (None)
FOREVER_S = 1e9


def check_ttl(ttl: Any) -> float | None:
    """Seconds to live; None or 0 means until deleted (so does :data:`FOREVER_S` or more)."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, numbers.Real):
        raise InvalidType(f"ttl: must be seconds (a number) or None, got {type(ttl).__name__}")
    if not ttl >= 0:  # NaN too
        raise InvalidValue(f"ttl: must be >= 0 seconds, got {ttl}")
    return (float(ttl) or None) if ttl < FOREVER_S else None


def check_timeout(timeout: Any) -> float | None:
    """Seconds to wait; 0 means do not wait, None waits until the key exists (the store's meaning)."""
    if timeout is None:
        return None
    if (type(timeout) is int or type(timeout) is float) and timeout >= 0:  # the common case: no ABC check
        return float(timeout) if timeout < FOREVER_S else None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidType(f"timeout: must be seconds (a number), got {type(timeout).__name__}")
    if not timeout >= 0:  # NaN too
        raise InvalidValue(f"timeout: must be >= 0 seconds, got {timeout}")
    return float(timeout) if timeout < FOREVER_S else None


def check_write_mode(mode: Any) -> str:
    value = getattr(mode, "value", mode)
    if value not in WRITE_MODES:
        raise InvalidValue(f"write_mode: must be one of {', '.join(WRITE_MODES)}, got {mode!r}")
    return value


def check_size(size: Any, name: str = "size") -> int:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise InvalidType(f"{name}: must be an int, got {type(size).__name__}")
    if size < 0:
        raise InvalidValue(f"{name}: must be >= 0, got {size}")
    return int(size)
