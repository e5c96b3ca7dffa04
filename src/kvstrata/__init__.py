"""kvstrata: move and cache AI tensors across GPU memory, host memory and local SSD.

Layers, each calling only downward::

    memory  <-  ops  <-  store  <-  cluster / transport  <-  server / client / devobj  <-  comm / integrations
                                                                                          cli and bench on top

One node's worker serves its processes through shared memory; workers of many nodes form a cluster over etcd
(``kvstrata.cluster``; ``kvstrata.connect(cluster="etcd://HOST:2379/NAME")``). ``kvstrata.integrations`` holds the
KV-cache offload path for model code.

Submodules are imported lazily so ``import kvstrata`` stays cheap and works without a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstrata.errors import (
    AuthenticationError,
    CapacityError,
    ClosedError,
    ConnectionLost,
    CorruptData,
    DeadlockError,
    InvalidArgument,
    InvalidType,
    InvalidValue,
    KeyExists,
    KeyNotFound,
    KvstrataError,
    NotOwner,
    OwnerGone,
    ProtocolError,
    ServerError,
    Timeout,
    TransferAborted,
    TransportError,
)

__version__ = "0.1.0"

_LAZY_SUBMODULES = (
    "memory", "ops", "store", "cluster", "client", "server", "transport", "devobj", "comm", "integrations",
    "bench", "cli",
)  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"kvstrata.{name}")
    if name == "connect":
        return importlib.import_module("kvstrata.client").connect
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")


__all__ = [
    "AuthenticationError",
    "CapacityError",
    "ClosedError",
    "ConnectionLost",
    "CorruptData",
    "DeadlockError",
    "InvalidArgument",
    "InvalidType",
    "InvalidValue",
    "KeyExists",
    "KeyNotFound",
    "KvstrataError",
    "NotOwner",
    "OwnerGone",
    "ProtocolError",
    "ServerError",
    "Timeout",
    "TransferAborted",
    "TransportError",
    "__version__",
    "connect",
]
