"""``sm_copy``: one contiguous byte range copied by the SMs of the current GPU.

The copy engines move a peer GPU's memory at ~330 GB/s when it was opened through CUDA IPC on the
H200 pair (torch's push copy between two allocations of one process reaches ~390); an SM copy
reads the peer's memory with many loads in flight per SM, as NCCL does, at the price of the SMs it
occupies while it runs (``num_ctas`` caps them). Built on the chunk-copy kernel of
:mod:`kvstrata.ops.chunk_copy`: the range is cut into pieces, one tile loop per piece.

Example::

    sm_copy(local_buffer, peer_tensor)   # on torch.cuda.current_stream(); peer access must be enabled
"""

from __future__ import annotations

import torch

from kvstrata.ops.chunk_copy import alignment, default_ctas, launch_copy_chunks

PIECE_BYTES = 256 << 10  # per tile loop: enough pieces to cover every SM from 32 MiB up
_ids: dict[tuple[str, int], torch.Tensor] = {}


def _piece_ids(device: torch.device, n: int) -> torch.Tensor:
    key = (str(device), n)
    ids = _ids.get(key)
    if ids is None:
        if len(_ids) > 64:
            _ids.clear()
        ids = _ids[key] = torch.arange(n, dtype=torch.int32, device=device)
    return ids


def _address_table(addr: int, device: torch.device) -> torch.Tensor:
    table = torch.tensor([addr], dtype=torch.int64)
    if device.type == "cuda":
        # Pinned + non_blocking: no host sync; torch's host allocator keeps the block until the copy ran.
        return table.pin_memory().to(device, non_blocking=True)
    return table


def sm_copy(dst: torch.Tensor, src: torch.Tensor, *, num_ctas: int | None = None) -> None:
    """``dst <- src`` byte for byte by the current device's SMs, on its current stream.

    Both contiguous with the same number of bytes; ``src`` may live on another GPU (peer access
    enabled, e.g. memory opened through CUDA IPC) or in registered host memory. No host sync.
    """
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
    nbytes = dst.numel() * dst.element_size()
    if src.numel() * src.element_size() != nbytes:
        raise ValueError(f"src: {src.numel() * src.element_size()} bytes, dst has {nbytes}")
    if nbytes == 0:
        return
    device = dst.device if dst.device.type == "cuda" else src.device
    ctas = num_ctas or default_ctas(device)
    full, rest = divmod(nbytes, PIECE_BYTES)
    src_ptr, dst_ptr = src.data_ptr(), dst.data_ptr()
    for count, piece, offset in ((full, PIECE_BYTES, 0), (1 if rest else 0, rest, full * PIECE_BYTES)):
        if not count:
            continue
        ids = _piece_ids(device, count)
        launch_copy_chunks(
            _address_table(src_ptr + offset, device),
            ids,
            ids,
            dst_ptr + offset,
            n_blocks=count,
            nseg=1,
            chunk_bytes=piece,
            dev_block_stride=piece,
            other_block_stride=piece,
            other_seg_stride=0,
            to_other=True,
            align=alignment(src_ptr + offset, dst_ptr + offset, piece),
            num_ctas=ctas,
        )


__all__ = ["PIECE_BYTES", "sm_copy"]
