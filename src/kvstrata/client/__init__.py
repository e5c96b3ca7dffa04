"""The kvstrata client SDK: :func:`connect` returns a :class:`Client` (a worker's, or an embedded store's)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvstrata.client.buffers import ReadBuffer, WritableBuffer
from kvstrata.client.client import Client
from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.units import parse_size

_SIZE_OPTIONS = ("memory_bytes", "disk_bytes", "gpu_bytes", "segment_bytes")
EMBEDDED_MEMORY_CAP = 4 << 30


def connect(
    address: str | None = None,
    *,
    embedded: bool = False,
    timeout: float = 10.0,
    name: str | None = None,
    store: Any = None,
    reserve_bytes: int | str | None = None,
    cluster: Any = None,
    replicas: int | None = None,
    **store_options: Any,
) -> Any:
    """A client of the node's worker, of an in-process store, or of a whole cluster.

    ``reserve_bytes``: the most shared memory this client keeps reserved for ``mset_d2h`` objects it
    lays out without asking the worker (:mod:`kvstrata.client.reservation`; default 256 MiB, 0: off).
    ``address``: ``unix:///path.sock`` (default: ``$KVSTRATA_WORKER`` or the default socket path).
    ``cluster``: a cluster's address (``etcd://HOST:2379/NAME``) or :class:`~kvstrata.cluster.Membership`: a
    :class:`~kvstrata.client.cluster.ClusterClient` that routes each key to the workers owning it, ``replicas`` of
    them per key (default: the cluster's ``cluster_replicas``; ``address`` and store options don't apply).
    ``embedded=True``: no worker process; an :class:`~kvstrata.store.ObjectStore` is built in this
    process from ``store_options`` (:class:`~kvstrata.store.StoreConfig` fields; sizes may be
    strings like ``"1GiB"``; memory defaults to a quarter of RAM, at most 4 GiB; an SSD tier only with
    ``disk_dir`` and ``disk_bytes`` both given, ``disk_dir=""`` or None meaning none, as for the worker), or an
    existing one is shared through ``store=``.

    >>> import kvstrata
    >>> with kvstrata.connect(embedded=True, memory_bytes="64MiB") as kv:
    ...     kv.set("k", b"v"); kv.get("k")
    b'v'
    """
    from kvstrata.client.backends import EmbeddedBackend, RemoteBackend
    from kvstrata.client.reservation import RESERVE_BYTES

    reserve = RESERVE_BYTES if reserve_bytes is None else parse_size(reserve_bytes, "reserve_bytes")
    if cluster is not None:
        if address is not None or embedded or store is not None or store_options:
            raise InvalidValue("cluster: a cluster client finds its workers itself (drop address, embedded, store...)")
        from kvstrata.client.cluster import ClusterClient

        def connect_worker(*, address: str, timeout: float, name: str | None) -> Client:
            return connect(address, timeout=timeout, name=name, reserve_bytes=reserve)

        # (a listed worker is up: its connection is not waited for as long as a worker starting on this node)
        wait = min(timeout, 3.0) if isinstance(timeout, int | float) and not isinstance(timeout, bool) else timeout
        return ClusterClient(cluster, replicas=replicas, timeout=wait, name=name, connect=connect_worker)
    if replicas is not None:
        raise InvalidValue(f"replicas: only for a cluster client (cluster=...), got {replicas!r}")

    if embedded or store is not None:
        if address is not None:
            raise InvalidValue("address: not used by an embedded client (drop it or embedded=True)")
        if store is not None:
            if store_options:
                raise InvalidValue(f"{next(iter(store_options))}: options don't apply to a store passed in")
            return Client(EmbeddedBackend(store, own_store=False), reserve_bytes=reserve)
        from kvstrata.server.config import default_memory_bytes
        from kvstrata.store import ObjectStore, StoreConfig

        options = dict(store_options)
        fields = {f.name for f in dataclasses.fields(StoreConfig)}
        for key in options:
            if key not in fields:
                raise InvalidType(
                    f"{key}: not an option of an embedded store (its options: {', '.join(sorted(fields))})"
                )
        if options.get("disk_dir") == "":  # the worker's way (--disk-dir '') of saying "no SSD tier"
            options["disk_dir"] = None
        for key in _SIZE_OPTIONS:
            if key in options:
                options[key] = parse_size(options[key], key)
        options.setdefault("memory_bytes", min(default_memory_bytes(), EMBEDDED_MEMORY_CAP))
        options.setdefault("segment_bytes", min(256 << 20, options["memory_bytes"]))
        return Client(EmbeddedBackend(ObjectStore(StoreConfig(**options)), own_store=True), reserve_bytes=reserve)
    if store_options:
        raise InvalidValue(f"{next(iter(store_options))}: store options apply only with embedded=True")
    from kvstrata.server.config import worker_address

    if address is None:
        address = worker_address(None)
    if not isinstance(address, str | os.PathLike):
        raise InvalidType(f"address: a socket path or an address such as 'unix:///run/kv.sock', got {address!r}")
    address = os.fspath(address)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise InvalidValue(f"timeout: seconds to wait for the worker (a number > 0), got {timeout!r}")
    return Client(RemoteBackend(worker_address(address), timeout=timeout, name=name), reserve_bytes=reserve)


__all__ = ["Client", "ReadBuffer", "WritableBuffer", "connect"]
