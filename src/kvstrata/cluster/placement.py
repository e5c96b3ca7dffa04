"""Which workers of a cluster hold a key: rendezvous (highest-random-weight) hashing.

Every node scores every key with a hash of the pair; a key's owners are the nodes with the highest scores, best
first. Any client with the same member list computes the same owners, with no table to share. When a node joins,
the only keys that move are those it now scores best on (about 1/N of them), and they move to it; when a node
leaves, only its keys move, each to its next-best node. So a client that keeps the previous member list finds a
key written before one change on the previous list's owners (:class:`kvstrata.client.cluster.ClusterClient`).

>>> rank("prompt/0", ["a", "b", "c"]) == rank("prompt/0", ["c", "b", "a"])
True
>>> owners("prompt/0", ["a", "b", "c"], 2) == rank("prompt/0", ["a", "b", "c"])[:2]
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from kvstrata.errors import InvalidValue


def score(key: str, node_id: str) -> int:
    """The weight of ``node_id`` for ``key``: 64 bits of blake2b over both (ids hold no NUL, so pairs can't blur)."""
    digest = hashlib.blake2b(node_id.encode() + b"\0" + key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rank(key: str, node_ids: Iterable[str]) -> list[str]:
    """``node_ids`` in the order they hold ``key``: best first (ties, which need equal digests, by id)."""
    return sorted(node_ids, key=lambda node: (-score(key, node), node))


def owners(key: str, node_ids: Iterable[str], replicas: int = 1) -> list[str]:
    """The ``replicas`` nodes that hold ``key`` (fewer where the cluster has fewer nodes)."""
    if type(replicas) is not int or replicas < 1:
        raise InvalidValue(f"replicas: must be an int of at least 1, got {replicas!r}")
    return rank(key, node_ids)[:replicas]
