"""Host-path building blocks in one process: segments, chunking, relay assignment, stale sweeping."""

from __future__ import annotations

import errno
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstrata.comm import hostpath, segment
from kvstrata.comm.hybrid import _parse_numa_map
from kvstrata.errors import CapacityError


@pytest.mark.parametrize("tail", [1, 7, 4095, 4096, 4097, 3 * (4 << 20) + 5, 200 << 20])
def test_chunk_bounds_tile_the_tail(tail: int) -> None:
    bounds = hostpath.chunk_bounds(tail)
    assert bounds[0][0] == 0 and bounds[-1][1] == tail
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(lo % 4096 == 0 and hi > lo for lo, hi in bounds)
    assert len(bounds) <= hostpath.MAX_CHUNKS
    assert hostpath.chunk_bounds(0) == []


def test_relays_cover_every_node_pair_once_and_spread() -> None:
    topo = hostpath.Topology(node_of=(0, 1, 2, 0, 1, 2, 2), pids=tuple(range(7)))
    relays = topo.relays()
    assert set(relays) == {(s, d) for s in range(3) for d in range(3) if s != d}
    for (_, dst), rank in relays.items():
        assert topo.node_of[rank] == dst
    # Node 2 has three ranks and two sources: two different ranks relay.
    assert relays[(0, 2)] != relays[(1, 2)]
    assert hostpath.Topology(node_of=(0, 0, 0), pids=(1, 2, 3)).relays() == {}


def test_segment_create_attach_share_and_unlink(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    a = segment.NodeSegment.create(path, world=3, slot_bytes=8192, huge=False, node=0)
    b = segment.NodeSegment.attach(path, world=3, slot_bytes=8192, huge=False)
    assert a.size == segment.segment_bytes(3, 8192, huge=False) and torch.count_nonzero(a.data) == 0
    a.slot(1, 2).fill_(7)
    a.flags[2] = 123
    a.calls[1, 2] = (5, 6, 7, 8)
    assert b.flags[2] == 123 and torch.all(b.slot(1, 2) == 7) and tuple(b.calls[1, 2]) == (5, 6, 7, 8)
    assert not b.calls[0].any() and not b.flags[:2].any()
    assert torch.count_nonzero(b.slot(0, 2)) == 0 and torch.count_nonzero(b.slot(1, 1)) == 0
    a.unlink()
    assert not path.exists()
    b.slot(0, 0).fill_(1)  # still mapped after the name is gone
    assert torch.all(a.slot(0, 0) == 1)
    b.close()
    a.close()
    a.close()


def test_segment_refuses_what_tmpfs_cannot_hold(tmp_path: Path) -> None:
    huge_slot = 1 << 50
    with pytest.raises(CapacityError, match="bytes free"):
        segment.NodeSegment.create(tmp_path / "big", world=2, slot_bytes=huge_slot, huge=False, node=None)
    assert not (tmp_path / "big").exists()


def test_segment_reserves_its_pages_and_reports_a_full_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free space can go between the check and the first touch (two creators at once): the pages are
    reserved with posix_fallocate, so a full tmpfs is a CapacityError naming the directory and size, not
    a SIGBUS, and nothing is left behind."""
    reserved = []

    def full(fd: int, offset: int, length: int) -> None:
        reserved.append((offset, length))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(segment.os, "posix_fallocate", full)
    path = tmp_path / "seg"
    size = segment.segment_bytes(2, 8192, huge=False)
    with pytest.raises(
        CapacityError, match=rf"{re.escape(str(tmp_path))} has \d+ bytes free, a hybrid all-gather segment needs {size}"
    ):
        segment.NodeSegment.create(path, world=2, slot_bytes=8192, huge=False, node=0)
    assert reserved == [(0, size)]
    assert not path.exists()
    assert str(path) not in Path("/proc/self/maps").read_text()


def test_sweep_removes_files_of_dead_creators_only(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"{segment.PREFIX}ab12-n0-g1-p{dead_pid}"
    live = tmp_path / f"{segment.PREFIX}ab12-n1-g1-p{os.getpid()}"
    other = tmp_path / "unrelated-p1"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert segment.sweep_stale(tmp_path) == 1
    assert not stale.exists() and live.exists() and other.exists()


def test_numa_map_parsing() -> None:
    assert _parse_numa_map([0, 1], 2) == (0, 1)
    assert _parse_numa_map({1: 0, 0: 1}, 2) == (1, 0)
    for bad in ([0], {0: 0, 2: 1}, [0, -1], [0, 1.0], [True, 0]):
        with pytest.raises(ValueError, match="numa_map"):
            _parse_numa_map(bad, 2)
