"""The host leg's helper thread in one process: peers are stood in for by writing their flags and call records
into the segment by hand (or by a pid that has exited), so each case is exact and takes well under a second."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstrata.comm import hostpath, segment
from kvstrata.errors import ConnectionLost, InvalidValue

TAIL = 4096  # one chunk


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(out.stdout)


def _call(seq: int, world: int, *, nbytes: int = TAIL, head: str | None = None) -> hostpath._Call:
    inp = torch.arange(TAIL, dtype=torch.int64).to(torch.uint8)
    outs = [torch.zeros(TAIL, dtype=torch.uint8) for _ in range(world)]
    return hostpath._Call(seq, inp, outs, None, nbytes, head)


def _arrive(seg: segment.NodeSegment, rank: int, call: hostpath._Call, record=None) -> None:
    """Stand in for ``rank`` having published ``call``'s only chunk (with ``record``, default: the same call)."""
    seg.calls[call.seq % 2, rank] = record if record is not None else call.record()
    seg.flags[rank] = (call.seq << 16) + 1


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def _host(tmp_path: Path, rank: int, node_of: tuple[int, ...], pids: tuple[int, ...], timeout: float = 3.0):
    world = len(node_of)
    seg = segment.NodeSegment.create(tmp_path / "seg", world, TAIL, huge=False, node=None)
    topo = hostpath.Topology(node_of=node_of, pids=pids)
    host = hostpath.HostPath(rank, topo, {node_of[rank]: seg}, device=torch.device("cpu"), timeout=timeout)
    return host, seg


def test_peer_with_another_call_is_named_not_read(tmp_path: Path) -> None:
    """A peer whose flags announce a different call (here: twice the bytes) raises InvalidValue naming it."""
    me = os.getpid()
    host, seg = _host(tmp_path, 0, (0, 0, 0), (me, me, me))
    call = _call(1, 3)
    _arrive(seg, 1, call)
    _arrive(seg, 2, call, record=_call(1, 3, nbytes=2 * TAIL).record())
    with pytest.raises(InvalidValue, match=r"rank 2 and rank 0 disagree on the call .*rank 2: call 1: 8192 bytes"):
        host.submit(call).result(timeout=10)
    with pytest.raises(ConnectionLost, match="broken by an earlier error"):  # the group's calls are out of step
        host.submit(_call(2, 3))
    host.close()
    seg.close()


def test_matching_records_pass(tmp_path: Path) -> None:
    me = os.getpid()
    host, seg = _host(tmp_path, 0, (0, 0), (me, me))
    call = _call(1, 2, nbytes=3 * TAIL, head="gather")
    seg.slot(1, 1)[:TAIL].fill_(7)
    _arrive(seg, 1, call)
    assert host.submit(call).result(timeout=10) is None
    assert torch.all(call.out_tails[1] == 7)
    assert tuple(seg.calls[1, 0]) == (1, 3 * TAIL, TAIL, 2)  # its own record, published for the peers
    host.close()
    seg.close()


def test_dead_relay_is_named_within_the_poll_interval(tmp_path: Path, dead_pid: int) -> None:
    """Rank 1 waits for rank 2 (node 1), whose slot only rank 0, the relay for node 1 -> node 0, copies over.
    Rank 0 exited after publishing its own slot: rank 1 names rank 0 at once instead of timing out on rank 2."""
    me = os.getpid()
    host, seg = _host(tmp_path, 1, (0, 0, 1), (dead_pid, me, me), timeout=3.0)
    assert host.topo.relays()[(1, 0)] == 0
    call = _call(1, 3)
    _arrive(seg, 0, call)
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost, match=r"rank 0 \(pid \d+\), which relays NUMA node 1's slots to node 0"):
        host.submit(call).result(timeout=10)
    assert time.monotonic() - t0 < 1.5
    host.close()
    seg.close()


def test_an_error_does_not_keep_the_segment_mapped(tmp_path: Path, dead_pid: int) -> None:
    """The stored error (in the future, in the caller's hands) holds no frames with views of the segment,
    so close() unmaps it at once even while the error is still referenced."""
    host, seg = _host(tmp_path, 0, (0, 0), (os.getpid(), dead_pid))
    future = host.submit(_call(1, 2))
    with pytest.raises(ConnectionLost, match="rank 1") as info:
        future.result(timeout=10)
    assert _mapped(tmp_path / "seg")
    host.close()
    seg.close()
    assert not _mapped(tmp_path / "seg"), "the error's traceback keeps the mapping alive"
    assert info.value is future.exception()  # still alive here
