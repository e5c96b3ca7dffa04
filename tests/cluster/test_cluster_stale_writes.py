"""A write routed by an out-of-date member list: each routed write carries its list's fingerprint, and a worker whose
list differs refuses the keys it does not own under its own (NotOwner). A client whose watch is behind reads the list
again and writes those keys to their new owners (without this, they sat on a worker that had handed the keys on
already, under an older value's readers); a client whose list is current while a worker's is behind writes on
unchecked for a moment; matching lists, writes with no fingerprint, and workers outside a cluster check nothing."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvstrata
from _stages import fake_gpu
from kvstrata.cli.status import _rebalance_note
from kvstrata.cluster import owners
from kvstrata.cluster.placement import Placement, fingerprint
from kvstrata.errors import KeyNotFound, NotOwner
from kvstrata.server import Worker, WorkerConfig


def values(keys: range, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    sizes = [1, 100, 5000, 70_000]  # (the largest go as attachments)
    return {f"key-{i}": rng.integers(0, 255, sizes[i % len(sizes)], dtype=np.uint8).tobytes() for i in keys}


def _stop_watching(client) -> None:
    """``client``'s list stays as it is now (until something makes it read the list again)."""
    client._stop_watch()
    client._stop_watch = lambda: None


def test_a_client_whose_list_is_behind_reads_it_again_and_writes_to_the_new_owners(workers):
    workers.start(2, memory=64 << 20)
    old = values(range(300), seed=0)
    with kvstrata.connect(cluster=workers.url) as kv:
        assert kv.mset(old) == [None] * len(old)
        _stop_watching(kv)
        workers.start(1, memory=64 << 20)
        workers.settle(3)  # (the newcomer holds its keys' old values; the first two dropped theirs)
        assert len(kv.nodes) == 2
        new = values(range(300), seed=1)
        assert kv.mset(new) == [None] * len(new)
        assert len(kv.nodes) == 3  # (a worker refused keys it had handed on: the client read the list again)
        assert kv.mget(list(new)) == list(new.values())
    nodes = sorted(workers.by_node())
    newcomer = workers.started[2].member.node_id
    moved = [k for k in new if owners(k, nodes, 1)[0] == newcomer]
    assert moved
    where = workers.holders(list(new))
    assert all(where[k] == {owners(k, nodes, 1)[0]} for k in new)  # at its owner now, no stray left behind
    with kvstrata.connect(cluster=workers.url) as fresh:
        assert fresh.mget(list(new)) == list(new.values())  # the new values, the moved keys' too
    assert sum(w.stats()["cluster"]["stale_writes_refused"] for w in workers.started[:2]) >= 1
    assert any("stale write" in _rebalance_note(w.stats()) for w in workers.started[:2])  # (kvstrata status)
    assert workers.started[2].stats()["cluster"]["stale_writes_refused"] == 0


def test_a_worker_whose_list_is_behind_refuses_once_and_the_client_writes_on_unchecked(workers):
    a, _, c = workers.start(3, memory=64 << 20)
    a._stop_watch()  # (a's list stays at three workers: a worker whose watch lags)
    a._stop_watch = None
    c.stop()
    with kvstrata.connect(cluster=workers.url) as kv:
        assert len(kv.nodes) == 2
        data = values(range(300), seed=2)
        nodes = sorted(workers.by_node())
        me = a.member.node_id
        all_three = Placement([*nodes, c.member.node_id])
        gained = [k for k in data if owners(k, nodes, 1)[0] == me and me not in all_three.owners(k, 1)]
        assert gained  # (a owns these now, and did not under the list it still has)
        with pytest.raises(NotOwner, match=rf"worker {me} does not own key '{gained[0]}' under its member list"):
            kv.client(me).set(gained[0], b"x")  # (the per-worker client says which list routed it as well)
        assert kv.mset(data) == [None] * len(data)
        assert kv._unchecked_until > 0  # (its list did not change on reading it again: the worker's was behind)
        assert kv._routed_by() is None
        kv._unchecked_until = time.monotonic() - 0.01  # (UNCHECKED_S later: its writes carry the fingerprint again)
        assert kv._routed_by() == fingerprint(nodes)
        assert kv.mget(list(data)) == list(data.values())
    where = workers.holders(list(data))
    assert all(where[k] == {owners(k, nodes, 1)[0]} for k in data)


def test_only_a_write_routed_by_another_list_is_checked_and_only_its_keys_not_owned_are_refused(workers, tmp_path):
    a, _ = workers.start(2)
    nodes = sorted(workers.by_node())
    me = a.member.node_id
    mine = [f"k{i}" for i in range(40) if owners(f"k{i}", nodes, 1)[0] == me][:3]
    theirs = [f"k{i}" for i in range(40) if owners(f"k{i}", nodes, 1)[0] != me][:3]
    with kvstrata.connect(address=a.config.socket) as direct:  # (no fingerprint: a node-local client, any key)
        assert direct.mset({mine[0]: b"1", theirs[0]: b"2"}) == [None, None]
        backend = direct._backend
        backend.routed_by = lambda: fingerprint(nodes)  # the worker's own list: nothing checked
        assert direct.mset({mine[0]: b"3", theirs[0]: b"4"}) == [None, None]
        backend.routed_by = lambda: fingerprint([*nodes, "gone:1"])  # another list: keys not owned refused
        direct.set(mine[0], b"5")
        got = direct.mset({mine[0]: b"6", theirs[0]: b"7", mine[1]: b"8" * 100_000, theirs[1]: b"9" * 100_000})
        assert got[0] is None and got[2] is None and isinstance(got[1], NotOwner) and isinstance(got[3], NotOwner)
        assert f"does not own key '{theirs[0]}'" in str(got[1]) and owners(theirs[0], nodes, 1)[0] in str(got[1])
        with pytest.raises(NotOwner, match=rf"worker {me} does not own key '{theirs[2]}' under its member list"):
            direct.set(theirs[2], b"x" * 100_000)
        # device writes: through shared memory (create) here, or carved from a reservation (commit) on a GPU host
        blocks = [[torch.full((300,), float(i))] for i in range(4)]
        done = direct.mset_d2h([mine[2], theirs[2], "d-" + mine[2], "d-" + theirs[2]], blocks)
        refused = [isinstance(r, NotOwner) for r in done]
        assert refused[:2] == [False, True] and all(r is None for r, no in zip(done, refused) if not no)
        assert direct.mget([mine[0], theirs[0], mine[1]]) == [b"6", b"4", b"8" * 100_000]
        assert all(isinstance(r, KeyNotFound) for r in direct.mget(theirs[1:]))  # (no refused key written)
        assert direct.exists(["k-never"]) == [False]  # (reads and the rest carry no fingerprint)
        backend.routed_by = lambda: "not a fingerprint"  # (garbage from a client of its own: another list, no more)
        got = direct.mset({mine[0]: b"g", theirs[0]: b"h"})
        assert got[0] is None and isinstance(got[1], NotOwner)
    assert a.stats()["cluster"]["stale_writes_refused"] >= 4
    assert a.store.stats()["creates_in_progress"] == 0 and a.store.stats()["reserved_bytes"] == 0
    lone = Worker(WorkerConfig(socket=str(tmp_path / "lone.sock"), memory=16 << 20, disk_dir="")).start()
    try:
        with kvstrata.connect(address=lone.config.socket) as kv:
            kv._backend.routed_by = lambda: 12345  # (outside a cluster nothing is owned, nothing checked)
            kv.set(theirs[0], b"x")
            assert kv.get(theirs[0]) == b"x"
    finally:
        lone.stop()


@pytest.mark.parametrize("tensors", ["cpu-as-cuda", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_device_write_carved_from_a_reservation_refuses_keys_not_owned_and_frees_their_pieces(
    workers, monkeypatch, tensors
):
    a, _ = workers.start(2, memory=64 << 20)
    nodes = sorted(workers.by_node())
    me = a.member.node_id
    keys = [f"dev/{i}" for i in range(24)]
    mine = [owners(k, nodes, 1)[0] == me for k in keys]
    assert any(mine) and not all(mine)
    g = torch.Generator().manual_seed(3)
    lists = [[torch.randint(0, 255, (700,), generator=g, dtype=torch.uint8)] for _ in keys]
    if tensors == "cuda":
        lists = [[t.cuda() for t in ts] for ts in lists]
    with kvstrata.connect(address=a.config.socket) as direct:
        assert direct.mset_d2h(["dev/warm"], lists[:1]) == [None]  # (now a reservation is held)
        if tensors != "cuda":
            fake_gpu(monkeypatch, "copies")  # (CPU tensors taken for CUDA ones: laid out in the reservation)
        backend = direct._backend
        calls = []
        real_commit = backend.commit_start
        monkeypatch.setattr(backend, "commit_start", lambda *a, **kw: calls.append(1) or real_commit(*a, **kw))
        backend.routed_by = lambda: fingerprint([*nodes, "gone:1"])
        done = direct.mset_d2h(keys, lists)
        assert calls  # (the commit path, not create)
        assert [r is None for r in done] == mine and all(isinstance(r, NotOwner) for r, m in zip(done, mine) if not m)
        backend.routed_by = None
        got = direct.mget(keys)
        for key, ts, m, r in zip(keys, lists, mine, got):
            assert r == ts[0].cpu().numpy().tobytes() if m else isinstance(r, KeyNotFound), key
        # the refused keys' pieces went back: written now (routed by the worker's own list), they fit and read back
        redo = [k for k, m in zip(keys, mine) if not m]
        assert direct.mset_d2h(redo, [ts for ts, m in zip(lists, mine) if not m]) == [None] * len(redo)
        assert direct.mget(redo) == [ts[0].cpu().numpy().tobytes() for ts, m in zip(lists, mine) if not m]
    assert a.store.stats()["creates_in_progress"] == 0


def test_a_fingerprint_names_a_set_of_node_ids():
    assert fingerprint(["b", "a", "a"]) == fingerprint(["a", "b"]) == Placement(["a", "b"]).fingerprint
    assert fingerprint(["a"]) != fingerprint(["a", "b"])
