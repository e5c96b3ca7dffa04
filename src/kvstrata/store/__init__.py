"""kvstrata.store: an in-process, thread-safe object store over DRAM (shared memory), SSD and HBM.

The worker (``kvstrata.server``) and the embedded client call :class:`ObjectStore`; see its
docstring for the write path (create -> fill -> seal/publish) and read path (acquire -> view ->
release).
"""

from kvstrata.store.config import StoreConfig, WriteMode
from kvstrata.store.engine import ObjectStore
from kvstrata.store.objects import Lease
from kvstrata.store.tiers.base import Location

__all__ = ["Lease", "Location", "ObjectStore", "StoreConfig", "WriteMode"]
