"""Same-node data path: CUDA IPC export/import of tensors, and pulls on a side stream.

The exporter turns each tensor into a msgpack-able dict built from
:func:`torch.multiprocessing.reductions.reduce_tensor` (the CUDA IPC memory handle of the tensor's
allocation, offsets, and torch's cross-process reference counter, which keeps the exporter's block
out of reuse while an importer still maps it). The importer rebuilds the tensor with
``rebuild_cuda_tensor`` on the *local* index of the same physical GPU (found by UUID, so processes
with different ``CUDA_VISIBLE_DEVICES`` agree).

Opening a memory handle is slow (tens of microseconds), so :class:`ImportCache` keeps imported
allocations of each peer (bounded LRU) and drops them when the peer's object goes away. Readiness is
settled on the exporter's side: it registers an export only once its stream has reached the publish
point (a host wait on a local event), because waiting on interprocess CUDA events crashed readers on
the H200 machine (see ``DeviceObjects._ready_event``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported device-object dtype {name!r}") from None


def spec(t: torch.Tensor) -> dict[str, Any]:
    """The msgpack-able description of one tensor in a record."""
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "nbytes": t.numel() * t.element_size()}


def device_uuid(index: int) -> str:
    """The GPU's UUID as a string (stable across processes and ``CUDA_VISIBLE_DEVICES``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


_uuid_map: dict[str, int] | None = None
_uuid_lock = threading.Lock()


def local_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; ValueError when it is not visible here."""
    global _uuid_map
    with _uuid_lock:
        if _uuid_map is None:
            _uuid_map = {device_uuid(i): i for i in range(torch.cuda.device_count())}
    try:
        return _uuid_map[uuid]
    except KeyError:
        raise ValueError(
            f"GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES); use transport='nccl'"
        ) from None


def export_tensor(t: torch.Tensor) -> dict[str, Any]:
    """CUDA IPC export of one CUDA tensor (msgpack-able)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, a = reduce_tensor(t.detach())
    (
        _cls,
        size,
        stride,
        offset,
        _scls,
        _dtype,
        _dev,
        handle,
        storage_bytes,
        storage_offset,
        _rg,
        rc_handle,
        rc_offset,
        ev_handle,
        _ev_sync,
    ) = a
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "rc_handle": bytes(rc_handle),
        "rc_offset": int(rc_offset),
        # torch's interprocess event travels only because its import checks the argument is bytes: it
        # is imported with ev_sync=False, never waited on. A reader's cudaStreamWaitEvent on an opened
        # IPC event crashed readers on the H200 machine; the exporter host-waited for its data before
        # exporting (api._ready_event), so there is nothing to wait for.
        "ev_handle": bytes(ev_handle) if ev_handle is not None else bytes(64),
    }


def import_tensor(blob: dict[str, Any], dtype: torch.dtype, device: int) -> torch.Tensor:
    """Open an exported tensor in this process, on local GPU index ``device``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(blob["size"]),
        tuple(blob["stride"]),
        blob["offset"],
        torch.storage.TypedStorage,
        dtype,
        device,
        blob["handle"],
        blob["storage_bytes"],
        blob["storage_offset"],
        False,
        blob["rc_handle"],
        blob["rc_offset"],
        blob["ev_handle"],
        False,  # never wait on the interprocess event (see export_tensor)
    )


class EventPool:
    """CUDA events of this process (publish points, copy ends), reused once nothing waits on them."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.cuda.Event]] = {}
        self._lock = threading.Lock()

    def get(self, device: int) -> torch.cuda.Event:
        with self._lock:
            free = self._free.setdefault(device, [])
            if free:
                return free.pop()
        with torch.cuda.device(device):
            return torch.cuda.Event()

    def put(self, events: list[torch.cuda.Event], device: int) -> None:
        with self._lock:
            self._free.setdefault(device, []).extend(events)


class ImportCache:
    """Imported allocations per (peer, handle), bounded LRU."""

    def __init__(self, max_allocations: int = 256, max_bytes: int = 1 << 30) -> None:
        # A cached import pins the exporter's block (torch keeps it out of reuse while mapped), so the
        # cache is bounded by count and by bytes.
        self._allocs: OrderedDict[tuple[str, bytes, int], tuple[torch.Tensor, int]] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._objects: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._max_allocs = max_allocations
        self._lock = threading.Lock()

    def tensors(self, peer: str, record: dict[str, Any], *, reuse: bool = False) -> list[torch.Tensor]:
        """Views of the source tensors of ``record`` (exported by ``peer``) in this process.

        ``reuse``: keep the views of this object (a registered one, read again and again) until
        :meth:`drop_handles` names it, so repeated reads rebuild nothing.
        """
        if reuse:
            with self._lock:
                hit = self._objects.get((peer, record["obj"]))
            if hit is not None:
                return hit
        if len(record["handles"]) != len(record["tensors"]):
            raise ValueError(
                f"record of {record.get('key')!r}: {len(record['handles'])} exports for "
                f"{len(record['tensors'])} tensors"
            )
        device = local_index(record["device"]["uuid"])
        out = []
        for blob, sp in zip(record["handles"], record["tensors"]):
            with torch.cuda.device(device):  # the source GPU current while its memory is mapped here
                t = import_tensor(blob, dtype_of(sp["dtype"]), device)
            with self._lock:
                # Holding one view per allocation keeps torch's shared_cache entry (and the mapping) open.
                k = (peer, blob["handle"], blob["storage_offset"])
                old = self._allocs.pop(k, None)
                self._bytes -= old[1] if old else 0
                self._allocs[k] = (t, int(blob["storage_bytes"]))
                self._bytes += int(blob["storage_bytes"])
                while self._allocs and (len(self._allocs) > self._max_allocs or self._bytes > self._max_bytes):
                    self._bytes -= self._allocs.popitem(last=False)[1][1]
            out.append(t)
        if reuse:
            with self._lock:
                self._objects[(peer, record["obj"])] = out
        return out

    def drop_peer(self, peer: str) -> None:
        with self._lock:
            for k in [k for k in self._allocs if k[0] == peer]:
                self._bytes -= self._allocs.pop(k)[1]
            for k in [k for k in self._objects if k[0] == peer]:
                del self._objects[k]

    def drop_handles(self, peer: str, handles: list[dict[str, Any]], obj: int | None = None) -> None:
        with self._lock:
            self._objects.pop((peer, obj), None)
            for blob in handles:
                old = self._allocs.pop((peer, blob["handle"], blob["storage_offset"]), None)
                self._bytes -= old[1] if old else 0


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def pull(dst: list[torch.Tensor], src: list[torch.Tensor], ready: list[Any], streams: StreamSet) -> torch.cuda.Event:
    """Copy ``src[i]`` into ``dst[i]`` once ``ready`` events fired; return an event marking the end.

    Cross-device copies run on the source device's current stream in torch (copy engine, peer
    access over NVLink), so both devices' streams are set to this client's transfer streams.
    """
    dev = dst[0].device.index
    sd = streams.get(dev)
    last = torch.cuda.Event()
    waited: set[tuple[int, int]] = set()
    for d, s, ev in zip(dst, src, ready):
        ss = streams.get(s.device.index)
        if ev is not None:
            for st in (sd, ss):
                if (id(st), id(ev)) not in waited:
                    waited.add((id(st), id(ev)))
                    st.wait_event(ev)
        with torch.cuda.stream(ss), torch.cuda.stream(sd):
            d.copy_(s, non_blocking=True)
    last.record(sd)
    return last


class StreamSet:
    """One transfer stream per device for this client (created lazily)."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: int) -> torch.cuda.Stream:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device)
            return s


__all__ = [
    "EventPool",
    "ImportCache",
    "StreamSet",
    "device_uuid",
    "dtype_name",
    "dtype_of",
    "export_tensor",
    "flat_bytes",
    "import_tensor",
    "local_index",
    "pull",
    "spec",
]
