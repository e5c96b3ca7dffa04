"""What the two backends share: where an object lies (:class:`Loc`), a lease on it (:class:`Lease`), a
segment's bytes as a tensor, and the checks of the keys and sizes a client is given (:func:`check_key`,
:func:`check_keys`, :data:`MAX_OBJECT_BYTES`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.server.protocol import MAX_BATCH, MAX_KEY_BYTES

#: the largest size or offset a client sends: the protocol's integers are 64-bit (msgpack cannot encode 2**64, and
#: the worker's integer columns are int64), and no store holds that much
MAX_OBJECT_BYTES = (1 << 63) - 1


class Loc(NamedTuple):
    segment: int
    offset: int
    size: int


class Lease(NamedTuple):
    lease_id: int
    location: Any
    mutable: bool


def _segment_tensor(seg: Any) -> Any:
    if hasattr(seg, "as_tensor"):
        return seg.as_tensor()
    import torch

    return torch.frombuffer(seg.buffer, dtype=torch.uint8)


def check_key(key: Any, name: str = "key") -> str:
    """A key the worker can be sent: a str of 1 to :data:`MAX_KEY_BYTES` bytes in UTF-8 (so no lone surrogate, which
    UTF-8 cannot encode), else InvalidValue/InvalidType naming ``name``, as the embedded store's check words it. An
    ASCII key (``isascii`` reads a flag the str keeps) needs no encoding; any other is encoded once, which checks both
    its length and that it encodes (``kvstrata.server.protocol.check_key`` lets a lone surrogate through: the request
    then failed to encode, after the releases riding along with it had been taken)."""
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
    # character, so the lengths are the byte counts). 64 keys: 3.6 us, against 5.1 for protocol.check_keys, which
    # looked at types and lengths only (development machine, session 38).
    try:
        ascii_only = "".join(keys).isascii()
    except TypeError:  # not all str: named below
        ascii_only = False
    if ascii_only and 0 not in (lengths := set(map(len, keys))) and max(lengths) <= MAX_KEY_BYTES:
        return keys
    for i, key in enumerate(keys):
        check_key(key, f"{name}[{i}]")
    return keys


__all__ = ["MAX_OBJECT_BYTES", "Lease", "Loc", "check_key", "check_keys"]
