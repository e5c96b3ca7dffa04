"""``kvstrata.ops.peer_copy.sm_copy`` against plain copies (interpreter on CPU, real SMs on a GPU)."""

import pytest
import torch

from kvstrata.ops import peer_copy
from kvstrata.ops.peer_copy import sm_copy


@pytest.mark.parametrize("nbytes", [1, 7, 4096, 3 * 1024 + 5])
@pytest.mark.parametrize("dst_offset", [0, 1, 8])
def test_sm_copy_exact_and_nothing_outside(monkeypatch, nbytes, dst_offset):
    monkeypatch.setattr(peer_copy, "PIECE_BYTES", 1024)  # several pieces plus a remainder at small sizes
    g = torch.Generator().manual_seed(nbytes + dst_offset)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    buf = torch.full((nbytes + 32,), 0xA5, dtype=torch.uint8)
    sm_copy(buf[dst_offset : dst_offset + nbytes], src)
    assert torch.equal(buf[dst_offset : dst_offset + nbytes], src)
    assert bool((buf[:dst_offset] == 0xA5).all()) and bool((buf[dst_offset + nbytes :] == 0xA5).all())


def test_sm_copy_bad_input():
    with pytest.raises(ValueError, match="src"):
        sm_copy(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dst"):
        sm_copy(torch.zeros(4, 2)[:, 0], torch.zeros(4))
    with pytest.raises(TypeError, match="src"):
        sm_copy(torch.zeros(4), [1, 2, 3, 4])


@pytest.mark.multigpu
def test_sm_copy_pulls_from_the_peer_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    src = torch.randint(0, 256, ((64 << 20) + 3,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros_like(src, device="cuda:1")
    from kvstrata.devobj.ipc import _enable_peer
    from kvstrata.ops.copy_engine import _runtime

    if _runtime() is None:
        pytest.skip("needs cuda-bindings to enable peer access")
    _enable_peer(_runtime(), 1, 0)  # GPU1's SMs read GPU0's memory
    torch.cuda.set_device(1)
    try:
        sm_copy(dst, src)
        torch.cuda.synchronize(1)
    finally:
        torch.cuda.set_device(0)
    assert torch.equal(dst.cpu(), src.cpu())
