from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstrata.memory.shm import SharedSegment


def test_create_attach_share_bytes():
    seg = SharedSegment.create(1 << 20, name="t", hugepages="auto")
    assert seg.nbytes == 1 << 20 and seg.hugepages in ("hugetlb", "thp", "off")
    seg.buffer[100:105] = b"hello"
    peer = SharedSegment.attach(os.dup(seg.fd), seg.nbytes)
    assert bytes(peer.buffer[100:105]) == b"hello"
    peer.as_numpy()[0] = 7  # writes through the peer mapping land in the owner's
    assert seg.buffer[0] == 7
    t = seg.as_tensor()
    assert t.dtype == torch.uint8 and t.numel() == seg.nbytes and t.data_ptr() == seg.address
    assert seg.as_numpy().ctypes.data == seg.address
    del t
    peer.close()
    seg.close()
    seg.close()  # idempotent
    assert seg.closed


def test_close_with_live_view_keeps_mapping_valid():
    seg = SharedSegment.create(4096, hugepages=False, populate=True)
    arr = seg.as_numpy()
    arr[:] = 3
    seg.close()  # must not unmap under arr
    assert int(arr.sum()) == 3 * 4096
    with pytest.raises(OSError):
        os.fstat(seg.fd)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="nbytes"):
        SharedSegment.create(0)
    with pytest.raises(ValueError, match="hugepages"):
        SharedSegment.create(4096, hugepages="maybe")
    with pytest.raises(ValueError, match="node"):
        SharedSegment.create(4096, numa_node=4096)
    with pytest.raises(ValueError, match="fd"):
        SharedSegment.attach(-1, 10)
    seg = SharedSegment.create(4096)
    with pytest.raises(ValueError, match="nbytes"):
        SharedSegment.attach(os.dup(seg.fd), 8192)
    seg.close()


def test_numa_bind_node0_when_available():
    seg = SharedSegment.create(1 << 20, numa_node=0, populate=True)
    assert seg.numa_node in (0, None)  # None: this kernel refused mbind, recorded not hidden
    assert np.all(seg.as_numpy()[:16] == 0)
    seg.close()


def test_hugetlb_unavailable_falls_back_and_records_it(monkeypatch):
    import kvstrata.memory.shm as shm

    monkeypatch.setattr(shm, "_free_hugetlb_bytes", lambda: 1 << 40)  # claims pages the kernel lacks
    seg = SharedSegment.create(3 << 20, hugepages="auto")
    assert seg.nbytes == 3 << 20 and len(seg.buffer) == 3 << 20
    assert seg.hugepages in ("hugetlb", "thp", "off")
    seg.buffer[-1] = 9
    assert seg.as_numpy()[-1] == 9
    seg.close()
    off = SharedSegment.create(1 << 20, hugepages="off")
    assert off.hugepages == "off"
    off.close()


def test_another_process_writes_through_a_passed_fd():
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    seg = SharedSegment.create(1 << 20)
    child = (
        "import sys; sys.path.insert(0, sys.argv[3]);"
        "from kvstrata.memory.shm import SharedSegment;"
        "s = SharedSegment.attach(int(sys.argv[1]), int(sys.argv[2]));"
        "s.buffer[4096:4101] = b'child'; s.close()"
    )
    subprocess.run([sys.executable, "-c", child, str(seg.fd), str(seg.nbytes), src], pass_fds=[seg.fd], check=True)
    assert bytes(seg.buffer[4096:4101]) == b"child"
    seg.close()
