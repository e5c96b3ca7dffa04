"""Rendezvous placement: the same owners from any client, keys spread evenly, and a change of members moves only
the keys it must (to a joining node; from a leaving one)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstrata.cluster.placement import owners, rank, score
from kvstrata.errors import InvalidValue

NODES = [f"10.0.0.{i}:7390" for i in range(1, 5)]
KEYS = [f"model/layer{i % 32}/block{i}" for i in range(8000)]


def test_rank_is_a_function_of_the_set_of_nodes_not_their_order():
    for key in KEYS[:200]:
        assert rank(key, NODES) == rank(key, list(reversed(NODES)))
        assert sorted(rank(key, NODES)) == sorted(NODES)


def test_keys_spread_evenly():
    counts = Counter(rank(key, NODES)[0] for key in KEYS)
    assert set(counts) == set(NODES)
    for node, n in counts.items():
        assert abs(n - len(KEYS) / len(NODES)) < 0.1 * len(KEYS) / len(NODES), (node, counts)


def test_a_joining_node_takes_only_the_keys_it_ranks_first_on():
    grown = [*NODES, "10.0.0.9:7390"]
    moved = [key for key in KEYS if rank(key, NODES)[0] != rank(key, grown)[0]]
    assert all(rank(key, grown)[0] == "10.0.0.9:7390" for key in moved)
    assert abs(len(moved) - len(KEYS) / len(grown)) < 0.1 * len(KEYS) / len(grown)


def test_a_leaving_node_gives_each_key_to_its_next_ranked_node():
    shrunk = NODES[1:]
    for key in KEYS:
        before = rank(key, NODES)
        after = rank(key, shrunk)
        assert after == [n for n in before if n != NODES[0]]


def test_owners_are_the_first_ranked_and_no_more_than_the_nodes():
    assert owners("k", NODES, 2) == rank("k", NODES)[:2]
    assert owners("k", NODES[:1], 3) == NODES[:1]
    assert owners("k", [], 1) == []


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2"])
def test_owners_refuse_a_bad_replica_count(bad):
    with pytest.raises(InvalidValue, match="replicas"):
        owners("k", NODES, bad)


def test_score_separates_node_and_key():
    assert score("ab", "c") != score("b", "ca")  # (the pair is hashed with a separator)
