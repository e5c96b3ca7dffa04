"""How a :class:`~kvstrata.client.Client` reaches the engine: a remote worker, or an in-process store.

Both backends answer the same small set of calls with the same results, so the Client holds all the
API logic once. ``RemoteBackend`` (:mod:`kvstrata.client.remote`) speaks :mod:`kvstrata.server.protocol`
over a transport and maps the worker's segments from the descriptors it is sent; ``EmbeddedBackend``
(:mod:`kvstrata.client.embedded`) calls the :class:`~kvstrata.store.ObjectStore` directly, with views
straight into its segments. This module names both, and what they share (from
:mod:`kvstrata.client._shared`).
"""

from __future__ import annotations

from kvstrata.client._shared import Lease, Loc
from kvstrata.client.embedded import EmbeddedBackend
from kvstrata.client.remote import RemoteBackend

__all__ = ["EmbeddedBackend", "Lease", "Loc", "RemoteBackend"]
