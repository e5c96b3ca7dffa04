"""Device objects: GPU tensors handed between processes and GPUs without touching host memory.

* :mod:`~kvstrata.devobj.broker`: the registry and meeting point, hosted in the worker.
  Its parts: :mod:`~kvstrata.devobj.broker_match`, :mod:`~kvstrata.devobj.broker_events`,
  :mod:`~kvstrata.devobj.broker_offers`, :mod:`~kvstrata.devobj.bcast_plan`, and the checks of every request's
  arguments before any of them acts, :mod:`~kvstrata.devobj.broker_args`.
* :mod:`~kvstrata.devobj.api`: the client side (:class:`DeviceObjects`, the ``dev_*`` methods).
  Its parts: :mod:`~kvstrata.devobj.publish`, :mod:`~kvstrata.devobj.request`,
  :mod:`~kvstrata.devobj.receive`, :mod:`~kvstrata.devobj.events`, :mod:`~kvstrata.devobj.broadcast`,
  :mod:`~kvstrata.devobj.nccl_ends`.
* :mod:`~kvstrata.devobj.link`: the client's broker link, settings and argument checks, and the errors of
  device objects (:class:`OwnerGone`, :class:`TransferAborted`: ServerErrors of :mod:`kvstrata.errors`).
* :mod:`~kvstrata.devobj.ipc`: the same-node data path (CUDA IPC, peer copies over NVLink/PCIe).
* :mod:`~kvstrata.devobj.nccl`: the between-nodes data path (NCCL send/recv per pair).
* :mod:`~kvstrata.devobj.service`: the worker handler and the Client mixin; parked polls are answered through
  :mod:`~kvstrata.devobj.outbox` (never waiting on a client that stopped reading).

The client-side names load torch, so they are imported on first use (the worker needs only the broker).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstrata.devobj.broker import DeviceBroker

_LAZY = {
    "BrokerLink": "kvstrata.devobj.link",
    "DeviceObjectConfig": "kvstrata.devobj.link",
    "DeviceObjects": "kvstrata.devobj.api",
    "InprocBrokerLink": "kvstrata.devobj.link",
    "OwnerGone": "kvstrata.errors",
    "TransferAborted": "kvstrata.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvstrata.devobj' has no attribute {name!r}")


__all__ = [
    "BrokerLink",
    "DeviceBroker",
    "DeviceObjectConfig",
    "DeviceObjects",
    "InprocBrokerLink",
    "OwnerGone",
    "TransferAborted",
]
