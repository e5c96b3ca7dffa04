"""Hybrid all-gather ranks that disagree: every rank raises the same clear error, none hangs, none returns wrong data.

One gloo group of three CPU processes (NUMA map [0, 1, 0]: the cross-node relay runs, and the default head is
"gather") runs every case in turn; spawning a group costs seconds here. The gloo timeout is short, so a rank left
alone in a collective fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUMA = [0, 1, 0]


def _ranks_values(world: int, n: int, scale: float) -> torch.Tensor:
    """What every rank gathers when rank q passes ``torch.full((n,), scale * (q + 1))``."""
    return torch.cat([torch.full((n,), scale * (q + 1)) for q in range(world)])


def _async_gather_heads_stay_apart(rank: int, world: int) -> None:
    """Two async calls before any wait, the later one waited first: on CPU the copy out of the gather head's
    scratch buffer runs at wait(), so each call must own its buffer until then."""
    from kvstrata.comm.hybrid import HybridAllGather

    ag = HybridAllGather(ratio=4, numa_map=NUMA, timeout=10.0)
    assert ag.default_head == "gather"
    n = 4096
    for it in range(4):
        a, b = torch.full((n,), float(it + 1) * (rank + 1)), torch.full((n,), -float(it + 1) * (rank + 1))
        out_a, out_b = torch.empty(world * n), torch.empty(world * n)
        token_a = ag.all_gather(out_a, a, async_op=True)
        token_b = ag.all_gather(out_b, b, async_op=True)
        token_b.wait()
        token_a.wait()
        assert torch.equal(out_a, _ranks_values(world, n, it + 1)), f"rank {rank} call a, iteration {it}"
        assert torch.equal(out_b, _ranks_values(world, n, -(it + 1))), f"rank {rank} call b, iteration {it}"
    ag.all_gather(out_a, a)  # a synchronous call reuses the buffer given back
    assert torch.equal(out_a, _ranks_values(world, n, 4))
    ag.close()


def _options_must_agree(rank: int, world: int) -> None:
    from kvstrata.comm.hybrid import HybridAllGather
    from kvstrata.errors import InvalidValue

    with pytest.raises(
        InvalidValue, match=r"head: must be the same on every rank \(rank 0: 'p2p'; ranks 1, 2: 'gather'"
    ):
        HybridAllGather(ratio=2, head="p2p" if rank == 0 else "gather", timeout=10.0)
    with pytest.raises(InvalidValue, match=r"cross_node: must be the same on every rank \(ranks 0, 1: 'relay'; rank 2"):
        HybridAllGather(ratio=1, cross_node="direct" if rank == 2 else "relay", numa_map=NUMA, timeout=10.0)


def _bad_arguments_raise_everywhere(rank: int, world: int) -> None:
    """A bad argument on one rank raises on every rank (a rank raising alone would leave the others waiting)."""
    from kvstrata.comm.hybrid import HybridAllGather
    from kvstrata.errors import InvalidType, InvalidValue

    with pytest.raises(InvalidValue, match=r"rank 1: numa_map: needs 3 entries, got 1"):
        HybridAllGather(numa_map=[0] if rank == 1 else NUMA, timeout=10.0)
    with pytest.raises(InvalidType, match=r"rank 2: timeout: expected a number of seconds, got '5'"):
        HybridAllGather(timeout="5" if rank == 2 else 10.0)
    with pytest.raises(InvalidType, match=r"ranks 0, 1, 2: timeout: expected a number of seconds, got True"):
        HybridAllGather(timeout=True)
    for bad in (float("inf"), float("nan"), 0, -1.0):
        with pytest.raises(InvalidValue, match=r"timeout: expected a finite number of seconds > 0"):
            HybridAllGather(timeout=bad)
    ag = HybridAllGather(ratio=2, numa_map=NUMA, timeout=10.0)
    n = 64
    inp, out = torch.ones(n), torch.empty(world * n)
    with pytest.raises(InvalidType, match=r"rank 1: out and inp must both be torch.Tensor"):
        ag.all_gather(out, inp.numpy() if rank == 1 else inp)
    with pytest.raises(InvalidValue, match=r"rank 2: ratio: expected 'auto', None or an int >= 0"):
        ag.all_gather(out, inp, ratio=-1 if rank == 2 else None)
    with pytest.raises(InvalidValue, match=r"rank 0: ratio: expected 'auto', None or an int >= 0"):
        ag.all_gather(out, inp, ratio=2.0 if rank == 0 else None)
    ag.all_gather(out, inp)  # the group and the instance still work
    assert torch.equal(out, torch.ones(world * n))
    ag.close()


def _a_bad_ratio_after_validation_raises_at_once_on_its_rank(rank: int, world: int) -> None:
    """Past the first call the peers skip the collective check: rank 1's bad ratio waited in it alone, then failed
    with gloo's timeout. It is said at once on its rank; the group goes on."""
    from kvstrata.comm.hybrid import HybridAllGather
    from kvstrata.errors import InvalidValue

    ag = HybridAllGather(ratio=2, numa_map=NUMA, timeout=10.0)
    n = 4096
    inp, out = torch.full((n,), float(rank + 1)), torch.empty(world * n)
    ag.all_gather(out, inp)
    if rank == 1:
        began = time.monotonic()
        with pytest.raises(InvalidValue, match="ratio: expected"):
            ag.all_gather(out, inp, ratio=-1)
        assert time.monotonic() - began < 5.0  # not gloo's 10 s (room for a loaded machine)
    ag.all_gather(out, inp)  # the call every rank makes
    assert torch.equal(out, _ranks_values(world, n, 1))
    ag.close()


def _a_full_dev_shm_is_capacity_error_on_every_rank(rank: int, world: int) -> None:
    """Rank 0 found /dev/shm full: every rank raised a RuntimeError, not the CapacityError the README promises."""
    from kvstrata.comm import segment
    from kvstrata.comm.hybrid import HybridAllGather
    from kvstrata.errors import CapacityError

    real = segment.NodeSegment.create

    def full(*args, **kwargs):
        raise CapacityError("/dev/shm: no room for the segment (a test's)")

    ag = HybridAllGather(ratio=2, numa_map=NUMA, timeout=10.0)
    if rank == 0:  # node 0's segment is rank 0's to create
        segment.NodeSegment.create = full
    try:
        with pytest.raises(CapacityError, match="could not create segments"):
            ag.all_gather(torch.empty(world * 4096), torch.zeros(4096))
    finally:
        segment.NodeSegment.create = real
    ag.close()


def _validated_sizes_that_differ_raise(rank: int, world: int) -> None:
    """Both sizes were validated (the check is cached), then rank 2 alone passes the other one: every rank
    raises naming a rank it disagrees with, instead of returning stale or half-filled output."""
    from kvstrata.comm.hybrid import HybridAllGather
    from kvstrata.errors import InvalidValue

    ag = HybridAllGather(ratio=1, numa_map=NUMA, timeout=10.0)
    for n in (1000, 2000):
        ag.all_gather(torch.empty(world * n), torch.zeros(n))
    n = 2000 if rank == 2 else 1000
    with pytest.raises(InvalidValue, match="disagree on the call") as info:
        ag.all_gather(torch.full((world * n,), -7.0), torch.full((n,), float(rank)))
    assert f"rank {2 if rank != 2 else 0}" in str(info.value) and "bytes per rank" in str(info.value)
    ag.close()


def _validated_ratios_that_differ_raise(rank: int, world: int) -> None:
    """Per-call ratios 1 and 2 were both validated, then rank 2 alone passes 2 (its heads go to a collective
    nobody else joins: this case comes last)."""
    from kvstrata.comm.hybrid import HybridAllGather
    from kvstrata.errors import InvalidValue

    ag = HybridAllGather(ratio=1, numa_map=NUMA, timeout=10.0)
    n = 8192
    for r in (1, 2):
        ag.all_gather(torch.empty(world * n), torch.zeros(n), ratio=r)
    with pytest.raises(InvalidValue, match="disagree on the call"):
        ag.all_gather(torch.empty(world * n), torch.ones(n), ratio=2 if rank == 2 else 1)


def _cases(rank: int, world: int, store: str, done_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
    )
    _async_gather_heads_stay_apart(rank, world)
    _options_must_agree(rank, world)
    _bad_arguments_raise_everywhere(rank, world)
    _a_bad_ratio_after_validation_raises_at_once_on_its_rank(rank, world)
    _a_full_dev_shm_is_capacity_error_on_every_rank(rank, world)
    _validated_sizes_that_differ_raise(rank, world)
    _validated_ratios_that_differ_raise(rank, world)
    # The group is out of step now (rank 2's head collective is unmatched): meet through files, skip the teardown.
    Path(done_dir, f"rank{rank}").touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(done_dir)) < world and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(0)


def test_gloo_ranks_that_disagree_all_raise(tmp_path: Path) -> None:
    """Async gather heads, constructor options, bad arguments on one rank, and validated calls that differ."""
    world = 3
    done = tmp_path / "done"
    done.mkdir()
    mp.spawn(_cases, args=(world, str(tmp_path / "store"), str(done)), nprocs=world, join=True)
