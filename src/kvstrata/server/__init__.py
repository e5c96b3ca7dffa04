"""The node worker: an :class:`~kvstrata.store.ObjectStore` served to the node's clients.

Run it with ``kvstrata worker`` (foreground) or in-process::

    from kvstrata.server import Worker, WorkerConfig
    with Worker(WorkerConfig.load(flags={"socket": "/tmp/kv.sock", "memory": "1GiB", "disk_dir": ""})) as w:
        ...  # kvstrata.connect("unix:///tmp/kv.sock")
"""

from kvstrata.server.config import WorkerConfig, default_address, default_socket_path
from kvstrata.server.metrics import to_prometheus
from kvstrata.server.worker import Worker

__all__ = ["Worker", "WorkerConfig", "default_address", "default_socket_path", "to_prometheus"]
