"""Which workers of a cluster hold a key: rendezvous (highest-random-weight) hashing.

Every node scores every key with a hash of the pair; a key's owners are the nodes with the highest scores, best
first. Any client with the same member list computes the same owners, with no table to share. When a node joins,
the only keys that move are those it now scores best on (about 1/N of them), and they move to it; when a node
leaves, only its keys move, each to its next-best node. So a client that keeps the previous member list finds a
key written before one change on the previous list's owners (:class:`kvstrata.client.cluster.ClusterClient`).

The score is 64-bit XXH3 of the key, seeded by the node id's own XXH3: about 0.1 us a node per key, so routing a
batch costs little beside its round trip.

>>> rank("prompt/0", ["a", "b", "c"]) == rank("prompt/0", ["c", "b", "a"])
True
>>> owners("prompt/0", ["a", "b", "c"], 2) == rank("prompt/0", ["a", "b", "c"])[:2]
True
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import xxhash

from kvstrata.errors import InvalidValue

_hash = xxhash.xxh3_64_intdigest
#: how many keys' ranks a Placement keeps
RANKS_KEPT = 1 << 16


def _check_replicas(replicas: object) -> int:
    if type(replicas) is not int or replicas < 1:
        raise InvalidValue(f"replicas: must be an int of at least 1, got {replicas!r}")
    return replicas


def score(key: str, node_id: str) -> int:
    """The weight of ``node_id`` for ``key``."""
    return _hash(key.encode(), seed=_hash(node_id.encode()))


class Placement:
    """Rendezvous ranks over one set of nodes (their seeds computed once): build one per member list."""

    def __init__(self, node_ids: Iterable[str]) -> None:
        self.nodes = tuple(sorted(set(node_ids)))
        self._seeded = [(_hash(node.encode()), node) for node in self.nodes]
        #: names the node set: two placements rank every key alike if and only if (but for a 2**-64 chance of a
        #: collision) their fingerprints are equal (cluster workers refuse writes routed by another list by it)
        self.fingerprint = fingerprint(self.nodes)
        #: recent keys' ranks (hot keys are ranked once per member list: ~0.1 us a key then, ~2 us unranked)
        self._ranked: dict[str, list[str]] = {}

    def rank(self, key: str) -> list[str]:
        """The nodes in the order they hold ``key``: best first (ties, which need equal hashes, by id). The list is
        shared: don't change it."""
        ranked = self._ranked.get(key)
        if ranked is None:
            data = key.encode()
            ranked = [node for _, node in sorted((-_hash(data, seed=seed), node) for seed, node in self._seeded)]
            if len(self._ranked) >= RANKS_KEPT:
                self._ranked.clear()  # (a bounded memo: cleared whole, cheaper than an LRU's bookkeeping per key)
            self._ranked[key] = ranked
        return ranked

    def rank_each(self, keys: Iterable[str]) -> Iterator[list[str]]:
        """:meth:`rank` of each key in turn, none kept (a worker going over all its objects once: kept ranks would
        only push the hot keys out)."""
        seeded = self._seeded
        for key in keys:
            data = key.encode()
            yield [node for _, node in sorted((-_hash(data, seed=seed), node) for seed, node in seeded)]

    def owners(self, key: str, replicas: int = 1) -> list[str]:
        """The ``replicas`` nodes that hold ``key`` (fewer where there are fewer nodes)."""
        return self.rank(key)[: _check_replicas(replicas)]

    def __len__(self) -> int:
        return len(self.nodes)


def fingerprint(node_ids: Iterable[str]) -> int:
    """A 64-bit name of a set of node ids (order and repeats do not count)."""
    return _hash("\n".join(sorted(set(node_ids))).encode())


def rank(key: str, node_ids: Iterable[str]) -> list[str]:
    """``node_ids`` in the order they hold ``key``: best first."""
    return Placement(node_ids).rank(key)


def owners(key: str, node_ids: Iterable[str], replicas: int = 1) -> list[str]:
    """The ``replicas`` nodes that hold ``key`` (fewer where the cluster has fewer nodes)."""
    _check_replicas(replicas)
    return Placement(node_ids).owners(key, replicas)
