"""Stream-ordered flag writes (``kvstrata.ops.stream_ops``)."""

import pytest
import torch

from kvstrata.ops.stream_ops import stream_writes_supported, write_value64


def test_unsupported_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine answers from its driver")
    assert stream_writes_supported(0) is False


@pytest.mark.gpu
def test_write_lands_after_the_work_before_it_on_the_stream() -> None:
    from kvstrata.memory import alloc_pinned, device_ptr

    if not stream_writes_supported(torch.cuda.current_device()):
        pytest.skip("no 64-bit stream memory operations on this GPU/driver")
    flags = alloc_pinned(64).view(torch.int64)
    flags.zero_()
    data = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    host = alloc_pinned(64 << 20)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        data.fill_(3)
        host.copy_(data, non_blocking=True)
        write_value64(s, device_ptr(flags.data_ptr()) + 8, 0x1234_5678_9ABC)
    s.synchronize()
    assert int(flags[1]) == 0x1234_5678_9ABC and int(flags[0]) == 0
    assert bool((host[-4096:] == 3).all())
