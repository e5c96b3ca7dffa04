"""The node worker: an :class:`~kvstrata.store.ObjectStore` served to the node's clients.

Run it with ``kvstrata worker`` (foreground) or in-process::

    from kvstrata.server import Worker, WorkerConfig
    with Worker(WorkerConfig.load(flags={"socket": "/tmp/kv.sock", "memory": "1GiB", "disk_dir": ""})) as w:
        ...  # kvstrata.connect("unix:///tmp/kv.sock")

The names below are imported on first use: the wire format (:mod:`~kvstrata.server.protocol`), the
config and the metrics text load without the store (and torch), which keeps ``kvstrata status`` quick.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Worker": "kvstrata.server.worker",
    "WorkerConfig": "kvstrata.server.config",
    "default_address": "kvstrata.server.config",
    "default_socket_path": "kvstrata.server.config",
    "to_prometheus": "kvstrata.server.metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvstrata.server' has no attribute {name!r}")
