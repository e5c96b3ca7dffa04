"""What the two backends share: where an object lies (:class:`Loc`), a lease on it (:class:`Lease`), a
segment's bytes as a tensor, and the checks of the keys and sizes a client is given (:func:`check_key` and
:func:`check_keys`, the protocol's; :data:`MAX_OBJECT_BYTES`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvstrata.server.protocol import check_key, check_keys  # the client's checks are the protocol's

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


__all__ = ["MAX_OBJECT_BYTES", "Lease", "Loc", "check_key", "check_keys"]
