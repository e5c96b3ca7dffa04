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

import logging
import threading
from collections import OrderedDict
from typing import Any

import torch

from kvstrata.devobj.debug import trace
from kvstrata.errors import InvalidValue
from kvstrata.ops import copy_engine

log = logging.getLogger(__name__)

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


_NAMES = {d: n for n, d in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidValue(f"dtype: unsupported device-object dtype {name!r}") from None


def spec(t: torch.Tensor) -> dict[str, Any]:
    """The msgpack-able description of one tensor in a record."""
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "nbytes": t.nbytes}


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
        raise InvalidValue(
            f"GPU {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES); use transport='nccl'"
        ) from None


def _reduce_storage(t: torch.Tensor) -> dict[str, Any]:
    """The per-allocation part of a CUDA IPC export (torch's ``reduce_tensor``: an IPC memory handle,
    a cross-process reference counter and an interprocess event, all made anew on every call)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, a = reduce_tensor(t.detach())
    (_c, _sz, _st, _off, _sc, _dt, _dev, handle, storage_bytes, storage_offset, _rg, rc_handle, rc_offset, ev, _s) = a
    return {
        "handle": bytes(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "rc_handle": bytes(rc_handle),
        "rc_offset": int(rc_offset),
        # torch's interprocess event travels only because its import checks the argument is bytes: it
        # is imported with ev_sync=False, never waited on. A reader's cudaStreamWaitEvent on an opened
        # IPC event crashed readers on the H200 machine; the exporter host-waited for its data before
        # exporting (api._ready_event), so there is nothing to wait for.
        "ev_handle": bytes(ev) if ev is not None else bytes(64),
    }


class ExportCache:
    """One IPC export per storage of this process, reused by every later export of any view of it.

    Keyed by the storage's identity (its StorageImpl, held by a weak reference so that address cannot
    be taken by another storage while the entry lives) plus its data pointer and size: a block the
    caching allocator hands to a *new* tensor at a reused address is a new storage, hence a new export,
    never a stale handle. Torch's cross-process reference counter of a reused export is not relied on
    (several importers share one): the broker's protocol keeps an owner from reusing memory that a
    transfer may still read (see :mod:`kvstrata.devobj.broker`).

    The whole per-tensor export (handle fields plus the view's size, stride and offset) is kept per view
    geometry of the storage, and the same dict is returned for every later export of that view: callers
    must not change it (records are only read and packed). A re-published buffer costs a few attribute
    reads and two dict lookups (it cost ~66 us of the 4 KiB hand-off on the H200 host when rebuilt per call).
    """

    def __init__(self, reduce=_reduce_storage, max_entries: int = 4096) -> None:
        self._reduce = reduce
        # storage key -> (weak ref, data pointer, size, per-storage export, exports by view geometry)
        self._entries: OrderedDict[int, tuple[Any, int, int, dict[str, Any], dict]] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()
        self.hits = 0

    def export(self, t: torch.Tensor) -> dict[str, Any]:
        storage = t.untyped_storage()
        key, ptr, nbytes = storage._cdata, storage.data_ptr(), storage.nbytes()
        geometry = (t.shape, t.stride(), t.storage_offset())
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and (hit[1] != ptr or hit[2] != nbytes or hit[0].expired()):
                del self._entries[key]
                hit = None
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                blob = hit[4].get(geometry)
                if blob is not None:  # the common case: the same view exported again
                    return blob
        if hit is None:
            from torch.multiprocessing.reductions import StorageWeakRef

            base = self._reduce(t)
            hit = (StorageWeakRef(storage), ptr, nbytes, base, {})
            with self._lock:
                self._entries[key] = hit
                if len(self._entries) > self._max:
                    for k in [k for k, e in self._entries.items() if e[0].expired()]:
                        del self._entries[k]
                    while len(self._entries) > self._max:
                        self._entries.popitem(last=False)
        blob = {"size": list(t.shape), "stride": list(t.stride()), "offset": t.storage_offset(), **hit[3]}
        with self._lock:
            views = hit[4]
            if len(views) >= MAX_VIEWS:  # many views of one storage: start over rather than grow without bound
                views.clear()
            views[geometry] = blob
        return blob

    def __len__(self) -> int:
        return len(self._entries)


_exports = ExportCache()


def export_tensor(t: torch.Tensor) -> dict[str, Any]:
    """CUDA IPC export of one CUDA tensor (msgpack-able); one torch export per storage (:class:`ExportCache`)."""
    return _exports.export(t)


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


def import_storage(blob: dict[str, Any], device: int) -> torch.Tensor:
    """Open the whole allocation (storage) of an export as a flat uint8 tensor on local GPU ``device``."""

    with torch.cuda.device(device):  # the source GPU current while its memory is mapped here
        return _import_storage(blob, device)


def _import_storage(blob: dict[str, Any], device: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    n = int(blob["storage_bytes"])
    try:
        t = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([n]), (1,), 0, torch.storage.TypedStorage, torch.uint8, device,
            blob["handle"], n, blob["storage_offset"], False, blob["rc_handle"], blob["rc_offset"], blob["ev_handle"],
            False,  # never wait on the interprocess event (see _reduce_storage)
        )  # fmt: skip
    except RuntimeError:
        # torch's own cache (by handle and offset) returned an older, smaller storage at that offset:
        # open it directly (the mapping itself is shared per handle inside torch).
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            blob["handle"],
            n,
            blob["storage_offset"],
            blob["rc_handle"],
            blob["rc_offset"],
            blob["ev_handle"],
            False,
        )
        t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage, 0, (n,), (1,))
    return t


def view_of(base: torch.Tensor, blob: dict[str, Any], sp: dict[str, Any]) -> torch.Tensor:
    """The exported tensor ``blob`` (contiguous, ``sp``'s dtype) as a view of its allocation ``base``."""
    dtype = dtype_of(sp["dtype"])
    itemsize = dtype.itemsize  # no tensor made per call (this runs on every receive)
    start, n = int(blob["offset"]) * itemsize, int(sp["nbytes"])
    if start + n > base.numel():
        raise InvalidValue(f"export of {n} bytes at {start} lies outside its {base.numel()}-byte allocation")
    return base[start : start + n].view(dtype).view(blob["size"])


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


#: views kept per imported allocation (see ImportCache.tensors)
MAX_VIEWS = 64


class ImportCache:
    """Imported allocations per (peer, handle, offset) as whole storages, bounded LRU; records are views.

    One import serves every later export of the same allocation (a re-published buffer, another key in
    it): opening a handle costs tens of microseconds, a view one. ``open_storage(blob, device)`` is
    :func:`import_storage`; tests pass their own.
    """

    def __init__(self, max_allocations: int = 256, max_bytes: int = 1 << 40, *, open_storage=None) -> None:
        # A cached import pins the exporter's block (torch keeps it out of reuse while mapped), so the
        # cache is bounded by count and by bytes.
        # (peer, handle, offset) -> (whole allocation, its size, views of it made so far by (offset, shape, dtype))
        self._allocs: OrderedDict[tuple[str, bytes, int], tuple[torch.Tensor, int, dict]] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._objects: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._max_allocs = max_allocations
        self._open = open_storage or import_storage
        self._lock = threading.Lock()
        self.opened = 0

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
            raise InvalidValue(
                f"record of {record.get('key')!r}: {len(record['handles'])} exports for "
                f"{len(record['tensors'])} tensors"
            )
        device = None
        out = []
        for blob, sp in zip(record["handles"], record["tensors"]):
            k = (peer, blob["handle"], blob["storage_offset"])
            size = int(blob["storage_bytes"])
            with self._lock:
                hit = self._allocs.get(k)
                if hit is not None and hit[1] == size:
                    self._allocs.move_to_end(k)
            if hit is None or hit[1] != size:  # a block at a reused offset may have another size: reopen
                if device is None:
                    device = local_index(record["device"]["uuid"])
                trace(f"opening an IPC handle of {size} B")
                base = self._open(blob, device)
                with self._lock:
                    self.opened += 1
                    old = self._allocs.pop(k, None)
                    self._bytes -= old[1] if old else 0
                    hit = self._allocs[k] = (base, size, {})
                    self._bytes += size
                    # Never the one just opened (a single block larger than the bound is still cached:
                    # a 1 GiB bound once made every read of a 2 GiB buffer re-open it, ~80 us a key).
                    while len(self._allocs) > 1 and (
                        len(self._allocs) > self._max_allocs or self._bytes > self._max_bytes
                    ):
                        self._bytes -= self._allocs.popitem(last=False)[1][1]
            # A buffer published again and again is the same view each time: made once (3 tensor ops).
            vk = (blob["offset"], tuple(blob["size"]), sp["dtype"], sp["nbytes"])
            view = hit[2].get(vk)
            if view is None:
                view = view_of(hit[0], blob, sp)
                if len(hit[2]) >= MAX_VIEWS:
                    hit[2].clear()
                hit[2][vk] = view
            out.append(view)
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


_peer_enabled: set[tuple[int, int]] = set()
_batch_ok: list[bool] = []


def _enable_peer(rt: Any, a: int, b: int) -> None:
    """Let device ``a``'s copies reach device ``b``'s memory directly (NVLink/PCIe peer access), once."""
    if a == b or (a, b) in _peer_enabled:
        return
    err, can = rt.cudaDeviceCanAccessPeer(a, b)
    if int(err) == 0 and can:
        with torch.cuda.device(a):
            rt.cudaDeviceEnablePeerAccess(b, 0)  # "already enabled" (torch did it) is fine too
            rt.cudaGetLastError()  # never leave that error for torch's next launch check to find
    _peer_enabled.add((a, b))


def copy_into(dst: list[torch.Tensor], src: list[torch.Tensor], streams: StreamSet, device: int) -> None:
    """Queue ``dst[i] <- src[i]`` (contiguous, equal byte sizes, any devices) on the transfer stream of
    ``device`` (``streams.get(device)``), after what that stream already waits for.

    One ``cudaMemcpyBatchAsync`` for all of them (copy engines, no SMs, one host call; a single pair
    is one ``cudaMemcpyAsync``) on the stream's raw handle where cuda-bindings has it; else torch's
    ``copy_`` per tensor, with ``stream`` current on both devices. Sources need no wait: exports are
    complete when registered.
    """
    if not _batch_ok:
        _batch_ok.append(copy_engine.has_batch_api())
    dev = device
    stream = streams.get(device)
    if _batch_ok[0]:
        rt = copy_engine._runtime()
        for other in {t.device.index for t in (*src, *dst)} - {dev}:
            _enable_peer(rt, dev, other)
            _enable_peer(rt, other, dev)
        sizes = [d.numel() * d.element_size() for d in dst]
        dptrs, sptrs = [d.data_ptr() for d in dst], [s.data_ptr() for s in src]
        try:
            # On the transfer stream's raw handle (never the legacy default stream, never captured): no
            # torch stream context, which cost more host time than the copy call itself.
            trace("copy call")
            if torch.cuda.current_device() == dev:
                copy_engine.memcpy_raw(dptrs, sptrs, sizes, stream.cuda_stream)
            else:
                with torch.cuda.device(dev):
                    copy_engine.memcpy_raw(dptrs, sptrs, sizes, stream.cuda_stream)
            return
        except copy_engine.CopyEngineError as exc:
            log.warning("devobj: batched copy unavailable (%s); copying tensor by tensor", exc)
            _batch_ok[0] = False
    for d, s in zip(dst, src):
        # torch runs a cross-device copy on the source device's current stream, synced with the destination's.
        with torch.cuda.stream(streams.get(s.device.index)), torch.cuda.stream(stream):
            d.copy_(s, non_blocking=True)


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
    "ExportCache",
    "ImportCache",
    "StreamSet",
    "copy_into",
    "device_uuid",
    "dtype_name",
    "dtype_of",
    "export_tensor",
    "flat_bytes",
    "import_storage",
    "import_tensor",
    "local_index",
    "pull",
    "spec",
    "view_of",
]
