"""What the two backends share: where an object lies (:class:`Loc`), a lease on it (:class:`Lease`), and a
segment's bytes as a tensor."""

from __future__ import annotations

from typing import Any, NamedTuple


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


__all__ = ["Lease", "Loc"]
