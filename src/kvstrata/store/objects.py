"""Object metadata: the entry the engine keeps per version of a key, leases, argument checks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.store.config import WriteMode
from kvstrata.store.tiers.base import Location

MAX_KEY_BYTES = 1024
ZERO_LOCATION = Location(0, 0, 0)  # empty values own no bytes
#: a non-empty ASCII str of at most this many characters is a valid key (batch loops test this inline and
#: call check_key only for the rest, which names what is wrong)
FAST_KEY_CHARS = MAX_KEY_BYTES // 4
#: a timeout or TTL of this many seconds or more (~31 years; infinity too) means forever
FOREVER_S = 1e9


class Lease(NamedTuple):
    """A reader's (or a mutable writer's) hold on one version of an object's bytes (a NamedTuple: one
    is built per key read, and a tuple builds in a third of a frozen dataclass's time).

    While a lease is held the bytes at ``location`` stay exactly where they are: the object is not
    evicted, spilled or freed, even if it is deleted or replaced meanwhile. Give it back with
    ``ObjectStore.release(lease_id)``.
    """

    lease_id: int
    key: str
    location: Location
    size: int
    mutable: bool
    placement: int = 0  # which placement of the version (kvstrata.store.placements); 0 for HBM copies


class Entry:
    """One version of a key. ``loc`` is None while the bytes live only on SSD."""

    __slots__ = (
        "dead",
        "dirty",
        "disk_hold",
        "expires",
        "flushing",
        "gpu",
        "key",
        "leases",
        "loading",
        "loc",
        "mode",
        "mutable",
        "on_disk",
        "owner",
        "placed",
        "ref",
        "referenced",
        "sealed",
        "size",
        "ttl",
        "version",
        "write_hold",
    )

    def __init__(self, key: str, size: int, loc: Location | None, mode: WriteMode, version: int, owner: object):
        self.key = key
        self.size = size
        self.loc = loc
        self.mode = mode
        self.version = version
        # The placement of these bytes (kvstrata.store.placements): a promotion back from SSD is a new one.
        self.placed = version
        self.owner = owner
        self.sealed = False  # visible to readers (sealed or published)
        self.mutable = False
        self.dead = False  # deleted or replaced: bytes freed when the last lease goes
        self.leases = 0  # reader leases plus internal pins (flusher)
        self.ref = 0  # global reference count (incref/decref)
        self.ttl = 0.0  # seconds to live asked at write time (the deadline starts at seal)
        self.expires = 0.0  # monotonic deadline, 0 = never
        self.on_disk = False  # a committed SSD file holds this version
        self.dirty = False  # write-back data not yet on SSD
        self.disk_hold = 0  # SSD bytes reserved for a write-back version's file until it is flushed (or dies)
        self.flushing = False  # its file is being written by a write-back flush or a spill (the other leaves it)
        self.write_hold = 0  # SSD bytes held for that write's file; given back at once if the version dies meanwhile
        self.loading = False  # being promoted from SSD; readers wait for it
        self.gpu = None  # the HBM copy (kvstrata.store.device.GpuCopy), if any
        self.referenced = False  # second-chance bit


def check_key(key: object, name: str = "key") -> str:
    if type(key) is not str and not isinstance(key, str):  # (a str subclass, numpy's str_ say, is a str)
        raise InvalidValue(f"{name}: must be a str, got {type(key).__name__}")
    n = len(key)
    if n == 0:
        raise InvalidValue(f"{name}: must not be empty")
    if n > FAST_KEY_CHARS or not key.isascii():
        try:
            nbytes = len(key.encode())
        except UnicodeEncodeError:
            raise InvalidValue(f"{name}: not encodable as UTF-8 (lone surrogate?)") from None
        if nbytes > MAX_KEY_BYTES:
            raise InvalidValue(f"{name}: {nbytes} bytes in UTF-8, the limit is {MAX_KEY_BYTES}")
    return key


def check_keys(keys: object) -> list[str]:
    """A batch of keys as a list (a single str is a batch of one); ValueError naming ``keys``."""
    if type(keys) is str:
        return [check_key(keys, "keys")]
    if not isinstance(keys, Iterable):
        raise InvalidValue(f"keys: must be a sequence of str, got {type(keys).__name__}")
    keys = list(keys)
    types = set(map(type, keys))
    if types and types != {str}:
        for k in keys:
            check_key(k, "keys")
    return keys


def check_ttl(ttl: object) -> float:
    """Seconds to live as a float, 0.0 meaning forever (None and 0 both mean forever)."""
    if ttl is None:
        return 0.0
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl < 0 or ttl != ttl:
        raise InvalidValue(f"ttl: must be None or a number of seconds >= 0, got {ttl!r}")
    return float(ttl) if ttl < FOREVER_S else 0.0


def check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0 or timeout != timeout:
        raise InvalidValue(f"timeout: must be None or a number of seconds >= 0, got {timeout!r}")
    return float(timeout) if timeout < FOREVER_S else None


def check_mode(write_mode: object) -> WriteMode:
    if type(write_mode) is WriteMode:
        return write_mode
    try:
        return WriteMode(write_mode)
    except ValueError:
        raise InvalidValue(f"write_mode: must be one of {[m.value for m in WriteMode]}, got {write_mode!r}") from None


def check_size(size: object, name: str = "size") -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidValue(f"{name}: must be an int >= 0, got {size!r}")
    return size


def as_bytes_view(data: object) -> memoryview:
    """A flat byte view of ``data`` (bytes-like, numpy array, CPU tensor); ValueError/TypeError naming ``data``."""
    if type(data) is bytes:
        return memoryview(data)
    if hasattr(data, "__dlpack__") and hasattr(data, "is_cuda") and not isinstance(data, memoryview):
        if data.is_cuda:
            raise InvalidValue("data: a CUDA tensor; copy it to the host first (or use the client's mset_d2h)")
        import torch

        data = data.detach().contiguous().view(-1).view(torch.uint8).numpy() if data.numel() else b""
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidType(f"data: must be bytes-like (buffer protocol), got {type(data).__name__}") from None
    if not mv.c_contiguous:
        raise InvalidValue("data: must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B") if mv.nbytes else memoryview(b"")
    return mv


__all__ = [
    "FAST_KEY_CHARS",
    "MAX_KEY_BYTES",
    "ZERO_LOCATION",
    "Entry",
    "Lease",
    "check_key",
    "check_keys",
    "check_mode",
]
