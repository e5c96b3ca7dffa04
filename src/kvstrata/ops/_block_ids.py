"""Block ids of a ``transfer_blocks`` call: accepted forms, per-call checks, and their way to the device.

Ids come as lists, numpy arrays or int32/int64 tensors (host or device). The eager path keeps host ids
on the host (numpy) and checks their values every call; the in-place kernel gets host ids through a
lane's pinned, device-mapped slot (read in place, no upload), and a staging call gets them with one
``cudaMemcpyAsync`` from that slot. Device-resident ids are used as they are (checking them costs a sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.ops import _transfer_plan as _plan
from kvstrata.ops import copy_engine
from kvstrata.ops.kv_layout import HostPool, KVLayout

Ids = Sequence[int] | np.ndarray | torch.Tensor


def _as_ids(ids: Ids, name: str) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int32, torch.int64):
            raise InvalidType(f"{name} must hold int32 or int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidValue(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        return ids
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise InvalidType(f"{name} must hold integers, got {ids.dtype}")
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).reshape(-1)
    if not isinstance(ids, Sequence) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InvalidType(f"{name} must be a list of ints or an int tensor")
    return torch.tensor(list(ids), dtype=torch.int64)


def _eager_ids(ids: Ids, name: str) -> np.ndarray | torch.Tensor:
    """Ids as a 1-D numpy array (host) or a CUDA tensor, checked for type and shape; no copy where avoidable."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int32, torch.int64):
            raise InvalidType(f"{name} must hold int32 or int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidValue(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        return ids.numpy() if ids.device.type == "cpu" else ids
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise InvalidType(f"{name} must hold integers, got {ids.dtype}")
        if ids.ndim != 1:  # as a tensor's ids must be (never flattened silently)
            raise InvalidValue(f"{name} must be 1-D, got shape {ids.shape}")
        return ids if ids.dtype.isnative else ids.astype(ids.dtype.newbyteorder("="))
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise InvalidType(f"{name} must be a list of ints or an int tensor")
    if len(ids) == 0:
        return np.zeros(0, dtype=np.int64)
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:  # floats, bools, strings, nested lists
        raise InvalidType(f"{name} must be a list of ints or an int tensor")
    return arr


def _host_np(ids: np.ndarray | torch.Tensor) -> np.ndarray:
    return ids if isinstance(ids, np.ndarray) else ids.cpu().numpy()  # a sync for device ids


def _as_tensor(ids: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids)) if isinstance(ids, np.ndarray) else ids


def _check_ids(layout: KVLayout, pool: HostPool, dev_ids, host_ids, direction: str) -> None:
    """Per-call checks of the id values (never cached): ranges and duplicate destinations."""
    if not pool.matches(layout):
        raise InvalidValue(
            f"host_pool: {pool.num_segments} segments of {pool.chunk_bytes} B, the device layout has "
            f"{layout.num_segments} of {layout.chunk_bytes} B"
        )
    d, h = _host_np(dev_ids), _host_np(host_ids)
    for name, v, n in (("device_block_ids", d, layout.num_blocks), ("host_block_ids", h, pool.num_blocks)):
        if v.size:
            lo, hi = _span(v)
            if lo < 0 or hi >= n:
                raise InvalidValue(f"{name}: ids must be in [0, {n}), got range [{lo}, {hi}]")
    dst_name, dst = ("host_block_ids", h) if direction == "d2h" else ("device_block_ids", d)
    if dst.size > 1 and (len(set(dst.tolist())) if dst.size <= 64 else np.unique(dst).size) != dst.size:
        raise InvalidValue(f"{dst_name}: duplicate destination ids")


def _span(v: np.ndarray) -> tuple[int, int]:
    if v.size <= 64:  # one request's ids: Python's min/max beat numpy's reductions' call overhead
        values = v.tolist()
        return min(values), max(values)
    return int(v.min()), int(v.max())


def _on_device(ids: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """Ids for a kernel on ``device``: host ids go through pinned memory, so the copy is truly async."""
    if ids.device == device:
        return ids
    if device.type != "cuda":
        return ids.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise InvalidValue(
            f"{name}: pass device-resident ids under CUDA graph capture (a host buffer is not replayable)"
        )
    return (ids if ids.is_pinned() else ids.pin_memory()).to(device, non_blocking=True)


def _kernel_ids(ids, name: str, lane, k: int | None, which: int, device: torch.device, capturing: bool):
    """(device address, thunk giving a CUDA tensor) of one id list for the in-place kernel.

    Device tensors are used as they are; host ids are written into the lane's slot ``k`` (pinned,
    device-mapped, read by the kernel in place), or uploaded when no slot is free or the list is long.
    """
    if isinstance(ids, torch.Tensor):
        t = _on_device(ids, device, name).contiguous()
        return t.data_ptr(), lambda: t
    if capturing:
        raise InvalidValue(
            f"{name}: pass device-resident ids under CUDA graph capture (a host buffer is not replayable)"
        )
    n = ids.size
    if k is not None and n <= _plan.LANE_IDS:
        off = k * 2 * _plan.LANE_IDS + which * _plan.LANE_IDS
        lane.ids_np[off : off + n] = ids
        return lane.base + off * 8, lambda: _alias(lane.ids[off : off + n], device)
    t = _on_device(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), device, name)
    return t.data_ptr(), lambda: t


def _staging_dev_ids(ids, lane, k: int | None, index: int) -> torch.Tensor:
    """Device ids of a staging call on the device: host lists go through the lane's pinned slot ``k`` and one
    ``cudaMemcpyAsync`` on the current stream (a few us, against ~20 for ``pin_memory().to(device)``)."""
    device = lane.device if lane is not None else torch.device("cuda", index)
    direct = k is not None and _plan._raw_stream is not None and copy_engine._runtime() is not None
    if isinstance(ids, torch.Tensor) or not direct or ids.size > _plan.LANE_IDS:
        return _on_device(_as_tensor(ids), device, "device_block_ids")
    n = ids.size
    off = k * 2 * _plan.LANE_IDS  # the slot's first list (staging reads host ids on the host)
    lane.ids_np[off : off + n] = ids
    out = torch.empty(n, dtype=torch.int64, device=device)
    # The slot is rewritten only after the lane event of this call (recorded after the join) has passed.
    copy_engine.memcpy_raw([out.data_ptr()], [lane.base + off * 8], [n * 8], _plan._raw_stream(index))
    return out


def _alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    from kvstrata.memory.pinned import device_alias

    return device_alias(host, device)
