"""Host <-> device copies between user tensors and objects in shared memory.

Everything that moves bytes between a device and the shared segments goes through :func:`copy_batch`,
so a batched kernel (``kvstrata.ops``) can replace the per-pair copies in one place. The segments
are registered with CUDA once per client (:func:`register_segment`), which makes them pinned memory
for the copy engines: ``non_blocking`` copies run as DMA straight from and to the worker's memory.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def cuda_in_use(tensors: list[Any]) -> bool:
    return any(t.device.type == "cuda" for t in tensors)


def register_segment(tensor: Any) -> bool:
    """Register a segment's CPU tensor view with CUDA (one use in :mod:`kvstrata.memory`'s registry).

    Returns False, with a warning, where CUDA refuses (pinnable memory exhausted): copies stay correct
    at pageable speed, and the caller must not :func:`unregister_segment` it. No-op (False) without CUDA.
    """
    import torch

    from kvstrata.errors import CapacityError
    from kvstrata.memory import register

    if not torch.cuda.is_available():
        return False
    try:
        register(tensor.data_ptr(), tensor.numel())
    except CapacityError as exc:
        log.warning("shared segment not registered with CUDA (%s): copies run at pageable speed", exc)
        return False
    return True


def unregister_segment(tensor: Any) -> None:
    """Undo one successful :func:`register_segment`, before the mapping goes away."""
    from kvstrata.memory import unregister

    unregister(tensor.data_ptr())


def copy_batch(pairs: list[tuple[Any, Any]], *, stream: Any = None) -> Any:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair of flat uint8 tensors, as one batch.

    Device copies are enqueued on ``stream`` (default: the current stream) after it waits for the
    current stream, so they see the caller's pending work; the returned CUDA event (None when no
    device was involved) completes when the bytes have landed. The caller must keep the source and
    destination memory alive until then.
    """
    import torch

    if not pairs:
        return None
    on_device = [p for p in pairs if p[0].device.type == "cuda" or p[1].device.type == "cuda"]
    host_only = [p for p in pairs if not (p[0].device.type == "cuda" or p[1].device.type == "cuda")]
    if host_only:
        dsts, srcs = zip(*host_only)
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(list(dsts), list(srcs))
        else:
            for dst, src in host_only:
                dst.copy_(src)
    if not on_device:
        return None
    device = next(t.device for p in on_device for t in p if t.device.type == "cuda")
    current = torch.cuda.current_stream(device)
    stream = stream or current
    if stream != current:
        stream.wait_stream(current)
    with torch.cuda.stream(stream):
        if not _copy_engine_batch(on_device, device):
            for dst, src in on_device:
                dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _copy_engine_batch(pairs: list[tuple[Any, Any]], device: Any) -> bool:
    """All pairs in one ``cudaMemcpyBatchAsync`` on the current stream (no SMs, one host call for many
    keys); False where the batch call is unavailable, so the caller copies pair by pair."""
    from kvstrata.ops import copy_engine

    if len(pairs) < 2 or not copy_engine.has_batch_api():
        return False
    dsts = [dst.data_ptr() for dst, _ in pairs]
    srcs = [src.data_ptr() for _, src in pairs]
    sizes = [dst.numel() * dst.element_size() for dst, _ in pairs]
    try:
        copy_engine.memcpy_batch(dsts, srcs, sizes, device=device)
    except copy_engine.CopyEngineError:
        return False
    return True
