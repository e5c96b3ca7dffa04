"""How a :class:`~kvstrata.client.Client` reaches the engine: a remote worker, or an in-process store.

Both backends answer the same small set of calls with the same results, so the Client holds all the
API logic once. ``RemoteBackend`` (:mod:`kvstrata.client.remote`) speaks :mod:`kvstrata.server.protocol`
over a transport and maps the worker's segments from the descriptors it is sent; ``EmbeddedBackend``
(:mod:`kvstrata.client.embedded`) calls the :class:`~kvstrata.store.ObjectStore` directly, with views
straight into its segments. This module holds what they share, and names both.
"""

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


# The backends, importable from here as before; last, since they import the names above.
from kvstrata.client.embedded import EmbeddedBackend  # noqa: E402
from kvstrata.client.remote import RemoteBackend  # noqa: E402

__all__ = ["EmbeddedBackend", "Lease", "Loc", "RemoteBackend"]
