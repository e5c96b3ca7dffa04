"""kvstrata: move and cache AI tensors across GPU memory, host memory and local SSD.

Layers, each calling only downward::

    memory  <-  ops  <-  store  <-  server / client / transport / devobj  <-  comm
                                                                              cli and bench on top

One node for now: the cluster mode over etcd and the model-code integrations are not built yet.

Submodules are imported lazily so ``import kvstrata`` stays cheap and works without a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstrata.errors import (
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
    OwnerGone,
    ProtocolError,
    ServerError,
    Timeout,
    TransferAborted,
    TransportError,
)

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("memory", "ops", "store", "client", "server", "transport", "devobj", "comm", "bench", "cli")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"kvstrata.{name}")
    if name == "connect":
        return importlib.import_module("kvstrata.client").connect
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")


__all__ = [
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
    "OwnerGone",
    "ProtocolError",
    "ServerError",
    "Timeout",
    "TransferAborted",
    "TransportError",
    "__version__",
    "connect",
]
