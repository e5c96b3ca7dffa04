"""Pinned host memory the GPU can reach: NUMA-bound allocation, CUDA registration, device views.

:func:`alloc_pinned` returns a 1-D ``uint8`` CPU tensor over an anonymous ``mmap`` bound to the NUMA
node of the GPU's PCIe slot, every page touched, and registered with CUDA as mapped + portable, so
DMA runs at pinned speed and kernels read and write it in place (UVA). The memory is unregistered
and unmapped when the last tensor viewing it dies. Whatever the machine lacks (GPU, NUMA, huge
pages) is recorded in ``tensor.pinned_info.fallbacks`` and logged at INFO, never silently skipped.

:func:`register` / :func:`unregister` do the CUDA part for any contiguous CPU tensor or raw address
range (a shared-memory segment, say); a registry of registered regions answers
:func:`device_ptr` and :func:`is_registered` by range lookup, and :func:`device_view` turns registered
host memory into a CUDA tensor aliasing it, so any torch or Triton code can address it.

Without CUDA the same calls work: regions are recorded with ``cuda_registered=False``,
``device_ptr`` returns the host address and ``device_view`` returns the tensor itself.

Example::

    buf = alloc_pinned(1 << 20)               # 1 MiB, NUMA-bound, registered
    view = device_view(buf)                   # CUDA tensor over the same bytes (CPU: buf itself)
    assert device_ptr(buf.data_ptr() + 10) == view.data_ptr() + 10
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import operator
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from kvstrata.errors import CapacityError, InvalidType, InvalidValue
from kvstrata.memory import numa as _numa

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MAP_HUGE_2MB = 21 << 26  # log2(2 MiB) << MAP_HUGE_SHIFT
_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2

HugePages = Literal["auto", "explicit", "transparent", "none"]


@dataclass(frozen=True)
class PinnedInfo:
    """What :func:`alloc_pinned` obtained, and what it had to fall back from."""

    nbytes: int
    numa_node: int | None
    numa_bound: bool
    hugepages: Literal["explicit", "transparent", "none"]
    cuda_registered: bool
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class Region:
    """One registered host range. ``cuda_registered``: we called cudaHostRegister and must undo it."""

    start: int
    nbytes: int
    device_ptr: int
    cuda_registered: bool
    device: int | None

    @property
    def end(self) -> int:
        return self.start + self.nbytes


# --------------------------------------------------------------------------------------------- CUDA
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _device_index(device: int | str | torch.device | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _cuda_register(addr: int, nbytes: int) -> None:
    flags = _CUDA_HOST_REGISTER_MAPPED | _CUDA_HOST_REGISTER_PORTABLE
    rc = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, flags))
    if rc != 0:
        _clear_cuda_error()
        raise CapacityError(
            f"cudaHostRegister({addr:#x}, {nbytes}) failed with cudaError {rc} "
            "(out of pinnable memory? check RLIMIT_MEMLOCK and free host memory)"
        )


def _cuda_unregister(addr: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(addr))
    if rc != 0:
        _clear_cuda_error()
        log.warning("cudaHostUnregister(%#x) failed with cudaError %d", addr, rc)


def _clear_cuda_error() -> None:
    """Reset libcudart's last error, so torch's next launch check does not report our failure."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass


# ----------------------------------------------------------------------------------------- registry
class _Registry:
    """Registered host regions, kept sorted by start address for range lookup (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self._uses: dict[int, int] = {}  # region start -> registrations not yet undone
        # Bumped whenever a region appears or disappears, so callers that cache "this address is
        # registered" (the ops' launch plans) know when to look again.
        self.generation = 0

    def find(self, addr: int, nbytes: int = 1) -> Region | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            region = self._regions[i]
            return region if addr + max(nbytes, 1) <= region.end else None

    def add(self, start: int, nbytes: int, device: int | None) -> tuple[Region, bool]:
        """Register ``[start, start + nbytes)``; returns (region, created). A range inside an existing
        region reuses it and counts one more use (each use is undone by one :meth:`remove`); a partial
        overlap is a ValueError."""
        with self._lock:
            i = bisect.bisect_right(self._starts, start) - 1
            if i >= 0 and start + nbytes <= self._regions[i].end:
                self._uses[self._regions[i].start] += 1
                return self._regions[i], False
            for j in (i, i + 1):
                if 0 <= j < len(self._regions):
                    other = self._regions[j]
                    if start < other.end and other.start < start + nbytes:
                        raise InvalidValue(
                            f"tensor_or_addr: [{start:#x}, {start + nbytes:#x}) overlaps the registered region "
                            f"[{other.start:#x}, {other.end:#x})"
                        )
            cuda = _cuda_available()
            if cuda:
                _cuda_register(start, nbytes)
            # Under UVA (every 64-bit CUDA platform) a registered host range has the same address on the device.
            region = Region(start, nbytes, start, cuda, device)
            k = bisect.bisect_left(self._starts, start)
            self._starts.insert(k, start)
            self._regions.insert(k, region)
            self._uses[start] = 1
            self.generation += 1
            return region, True

    def remove(self, start: int, *, every_use: bool = False) -> Region:
        """Undo one :meth:`add` of a range starting at ``start`` (inside a region); the last use
        unregisters the region from CUDA. ``every_use``: drop the region whatever its count (its memory is
        being unmapped: the uses a caller's own :func:`register` calls added end with it)."""
        with self._lock:
            k = bisect.bisect_right(self._starts, start) - 1
            if k < 0 or start >= self._regions[k].end:
                raise InvalidValue(f"tensor_or_addr: no registered region contains {start:#x}")
            region = self._regions[k]
            self._uses[region.start] = 0 if every_use else self._uses[region.start] - 1
            if self._uses[region.start] > 0:
                return region
            del self._uses[region.start]
            self._starts.pop(k)
            self._regions.pop(k)
            self.generation += 1
        if region.cuda_registered:
            _cuda_unregister(region.start)
        return region

    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions)


_REGISTRY = _Registry()


def _span(tensor_or_addr: torch.Tensor | int, nbytes: int | None) -> tuple[int, int]:
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)):
        raise InvalidType(f"nbytes: expected an int, got {type(nbytes).__name__} {nbytes!r}")
    if isinstance(tensor_or_addr, torch.Tensor):
        t = tensor_or_addr
        if t.device.type != "cpu":
            raise InvalidValue(f"tensor_or_addr: expected a CPU tensor, got one on {t.device}")
        if not t.is_contiguous():
            raise InvalidValue("tensor_or_addr: tensor must be contiguous")
        size = t.numel() * t.element_size()
        if nbytes is not None and nbytes > size:  # CUDA would pin pages the tensor does not own
            raise InvalidValue(f"nbytes: {nbytes} bytes, more than the tensor's {size}")
        return t.data_ptr(), size if nbytes is None else nbytes
    if isinstance(tensor_or_addr, bool) or not isinstance(tensor_or_addr, int):
        raise InvalidType(f"tensor_or_addr: expected a tensor or an int address, got {type(tensor_or_addr).__name__}")
    if tensor_or_addr <= 0:
        raise InvalidValue(f"tensor_or_addr: expected a host address > 0, got {tensor_or_addr}")
    if nbytes is None:
        raise InvalidValue("nbytes: required when registering a raw address")
    return tensor_or_addr, nbytes


def register(tensor_or_addr: torch.Tensor | int, nbytes: int | None = None) -> int:
    """Register a contiguous CPU tensor (or ``nbytes`` at a raw address) with CUDA; return its device pointer.

    Registration is mapped + portable: every GPU can DMA from it at pinned speed and address it from
    kernels. A range inside an already registered region returns that region's pointer. Memory
    torch already pinned (``pin_memory()``) needs no registration and is not recorded. The caller
    keeps the memory alive until :func:`unregister`. Raises :class:`~kvstrata.errors.CapacityError`
    when CUDA refuses (pinnable memory exhausted).
    """
    start, n = _span(tensor_or_addr, nbytes)
    if n <= 0:
        raise InvalidValue(f"nbytes: must be positive, got {n}")
    torch_pinned = isinstance(tensor_or_addr, torch.Tensor) and _cuda_available() and tensor_or_addr.is_pinned()
    if torch_pinned and _REGISTRY.find(start, n) is None:
        return start  # torch's pinned memory is mapped under UVA: device address == host address
    device = torch.cuda.current_device() if _cuda_available() else None
    region, _ = _REGISTRY.add(start, n, device)
    return region.device_ptr + (start - region.start)


def unregister(tensor_or_addr: torch.Tensor | int) -> None:
    """Undo :func:`register` for the region starting at the tensor's data pointer (or address)."""
    start = tensor_or_addr.data_ptr() if isinstance(tensor_or_addr, torch.Tensor) else int(tensor_or_addr)
    _REGISTRY.remove(start)


def is_registered(ptr: int, nbytes: int = 1) -> bool:
    """True when ``[ptr, ptr + nbytes)`` lies inside one registered region."""
    return _REGISTRY.find(int(ptr), int(nbytes)) is not None


def device_ptr(host_ptr: int) -> int:
    """The device address of registered host address ``host_ptr`` (ValueError naming it when unregistered)."""
    try:
        host_ptr = operator.index(host_ptr)  # ints, numpy integers (not strings or floats)
    except TypeError:
        raise InvalidType(f"host_ptr: expected an int address, got {type(host_ptr).__name__} {host_ptr!r}") from None
    region = _REGISTRY.find(host_ptr)
    if region is None:
        raise InvalidValue(f"host_ptr: {host_ptr:#x} is not in any registered host region")
    return region.device_ptr + (host_ptr - region.start)


def registry_generation() -> int:
    """A counter that changes whenever a registered region is added or removed (for caches of lookups)."""
    return _REGISTRY.generation


def registered_regions() -> list[Region]:
    """A snapshot of the registry (for diagnostics and tests)."""
    return _REGISTRY.regions()


# ------------------------------------------------------------------------------------- device views
_TYPESTR_BY_SIZE = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _CudaArray:
    """A ``__cuda_array_interface__`` holder; keeps the host tensor alive as long as the view."""

    def __init__(self, host: torch.Tensor, ptr: int) -> None:
        self._host = host
        size = host.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR_BY_SIZE[size],
            "data": (ptr, False),
            "strides": tuple(s * size for s in host.stride()),
            "version": 3,
        }


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """First byte and byte length the tensor's elements span (strides may be non-contiguous)."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    first = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    size = t.element_size()
    return t.data_ptr() + first * size, (last - first + 1) * size


def _device_address(tensor: torch.Tensor, name: str) -> tuple[int, int, Region | None]:
    """(first byte, byte extent, region) of a host tensor the GPU can address; ValueError otherwise."""
    start, nbytes = _extent(tensor)
    region = _REGISTRY.find(start, nbytes)
    if region is None and not (_cuda_available() and tensor.is_pinned()):
        raise InvalidValue(
            f"{name}: host memory at {start:#x} ({nbytes} bytes) is not registered; "
            "use kvstrata.memory.alloc_pinned or register() first"
        )
    return start, nbytes, region


def _target_device(region: Region | None, device: int | str | torch.device | None) -> torch.device:
    if device is None and region is not None and region.device is not None:
        device = region.device
    return torch.device("cuda", _device_index(device))


def _raw_cuda_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor | None:
    """A non-owning CUDA uint8 tensor over ``[ptr, ptr + nbytes)`` (None where torch lacks the hook)."""
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None:
        return None
    storage = construct(ptr, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def device_alias(tensor: torch.Tensor, device: int | str | torch.device | None = None) -> torch.Tensor:
    """Like :func:`device_view` but cheaper and without keeping ``tensor`` alive: for ops that use the
    alias only while their caller holds ``tensor`` (the usual contract of any CPU tensor argument)."""
    if tensor.device.type == "cuda":
        return tensor
    start, nbytes, region = _device_address(tensor, "tensor")
    if not _cuda_available():
        return tensor
    dev = _target_device(region, device)
    dev_start = start if region is None else region.device_ptr + (start - region.start)
    raw = _raw_cuda_bytes(dev_start, nbytes, dev) if nbytes else None
    if raw is None:
        return device_view(tensor, dev)
    size = tensor.element_size()
    typed = raw if tensor.dtype == torch.uint8 else raw.view(tensor.dtype)
    return typed.as_strided(tensor.shape, tensor.stride(), (tensor.data_ptr() - start) // size)


def device_view(tensor: torch.Tensor, device: int | torch.device | None = None) -> torch.Tensor:
    """A CUDA tensor aliasing registered host memory (same dtype, shape and strides).

    Writes through the view land in host memory and vice versa; reads and writes cross PCIe. The
    view keeps ``tensor`` alive. A CUDA tensor is returned unchanged. Raises ValueError when the
    host memory is neither registered nor pinned by torch. Without CUDA, returns ``tensor`` itself
    (after the same registration check), so CPU code paths stay testable.
    """
    if tensor.device.type == "cuda":
        return tensor
    start, _, region = _device_address(tensor, "tensor")
    if not _cuda_available():
        return tensor
    dev_start = start if region is None else region.device_ptr + (start - region.start)
    ptr = dev_start + (tensor.data_ptr() - start)
    dev = _target_device(region, device)
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=dev)
    raw = torch.as_tensor(_CudaArray(tensor, ptr), device=dev)
    view = raw if raw.dtype == tensor.dtype else raw.view(tensor.dtype)
    if view.data_ptr() != ptr:
        # torch placed the memory on the device it was registered from and copied to ``dev``: alias
        # through a non-owning storage instead, keeping ``tensor`` alive through the view object.
        view = device_alias(tensor, dev)
        view._kvstrata_host = tensor  # type: ignore[attr-defined]
    return view


# ---------------------------------------------------------------------------------------- alloc_pinned
class _Mapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA before the base class unmaps it.

    ``torch.frombuffer`` holds a reference to this object for as long as the tensor's storage
    lives (views included), so ``__del__`` runs exactly when the last view is gone.
    """

    registered_start: int | None = None

    def __del__(self) -> None:
        start, self.registered_start = self.registered_start, None
        try:
            region = _REGISTRY.find(start) if start is not None else None
            if region is not None and region.start == start:
                if region.cuda_registered and not torch.cuda.is_current_stream_capturing():
                    # Like cudaFreeHost: let queued copies and kernels that use the memory finish.
                    torch.cuda.synchronize(region.device)
                _REGISTRY.remove(start, every_use=True)  # the memory goes now, whoever else registered it
        except Exception as exc:  # a finalizer must not raise (e.g. CUDA already torn down at exit)
            log.debug("releasing pinned memory at %#x: %s", start or 0, exc)
        try:
            self.close()
        except (BufferError, ValueError):
            pass  # base dealloc unmaps


def _map(nbytes: int, hugepages: str, fallbacks: list[str]) -> tuple[_Mapping, str]:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if hugepages == "auto" and nbytes < HUGE_PAGE:
        fallbacks.append("smaller than one 2 MiB huge page; using 4 KiB pages")
        hugepages = "none"
    if hugepages in ("auto", "explicit"):
        length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        try:
            return _Mapping(-1, length, flags=flags | _MAP_HUGETLB | _MAP_HUGE_2MB), "explicit"
        except OSError as exc:
            fallbacks.append(f"no explicit 2 MiB huge pages ({exc.strerror}); using transparent huge pages")
    if hugepages != "none":
        length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        mapping = _Mapping(-1, length, flags=flags)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
            return mapping, "transparent"
        except (OSError, AttributeError) as exc:
            fallbacks.append(f"transparent huge pages unavailable ({exc}); using 4 KiB pages")
            return mapping, "none"
    return _Mapping(-1, max(nbytes, 1), flags=flags), "none"


def alloc_pinned(
    nbytes: int,
    *,
    device: int | torch.device | None = None,
    numa: Literal["auto"] | int | None = "auto",
    hugepages: HugePages = "auto",
) -> torch.Tensor:
    """Allocate ``nbytes`` of NUMA-local, touched, CUDA-registered host memory as a 1-D uint8 tensor.

    Args:
        nbytes: size in bytes (> 0).
        device: the CUDA device whose NUMA node to bind to (current device when None).
        numa: ``"auto"`` (the GPU's node), an int node, or None (no binding).
        hugepages: ``"auto"`` (explicit 2 MiB pages, else transparent), ``"explicit"``,
            ``"transparent"`` or ``"none"``; ``"explicit"`` still falls back when none are reserved.

    The result carries ``.pinned_info`` (:class:`PinnedInfo`). Freed when the last view dies.

    Example::

        buf = alloc_pinned(64 << 20)
        print(buf.pinned_info)   # PinnedInfo(nbytes=67108864, numa_node=0, numa_bound=True, ...)
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise InvalidValue(f"nbytes: expected a positive int, got {nbytes!r}")
    if not (numa is None or numa == "auto" or (isinstance(numa, int) and not isinstance(numa, bool) and numa >= 0)):
        raise InvalidValue(f"numa: expected 'auto', None or a node number >= 0, got {numa!r}")
    if hugepages not in ("auto", "explicit", "transparent", "none"):
        raise InvalidValue(f"hugepages: expected 'auto', 'explicit', 'transparent' or 'none', got {hugepages!r}")
    fallbacks: list[str] = []
    cuda = _cuda_available()
    dev_index = _device_index(device) if cuda else None

    node: int | None
    if numa == "auto":
        node = _numa.numa_node(dev_index) if cuda else None
        if node is None:
            fallbacks.append("GPU NUMA node unknown (no GPU or no NUMA information); memory not bound")
    else:
        node = numa

    try:
        mapping, huge_kind = _map(nbytes, hugepages, fallbacks)
    except OSError as exc:  # ENOMEM and the like: say how much was asked for
        raise MemoryError(f"alloc_pinned: could not map {nbytes} bytes of host memory ({exc.strerror})") from exc
    except OverflowError as exc:  # beyond what an address space can hold
        raise MemoryError(f"alloc_pinned: {nbytes} bytes is more than a mapping can hold") from exc
    tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    addr = tensor.data_ptr()
    bound = False
    if node is not None:
        try:
            bound = _numa.bind(addr, len(mapping), node)
        except ValueError as exc:
            raise InvalidValue(f"numa: {exc}") from exc
        if not bound:
            fallbacks.append(f"mbind to NUMA node {node} refused by this kernel; memory not bound")
    tensor.zero_()  # touch every page now, after binding, so the pages land on the node
    if cuda:
        with torch.cuda.device(dev_index):
            _REGISTRY.add(addr, nbytes, dev_index)
    else:
        _REGISTRY.add(addr, nbytes, None)
        fallbacks.append("no CUDA: memory not registered (pageable); device views are the tensor itself")
    mapping.registered_start = addr
    for reason in fallbacks:
        log.info("alloc_pinned(%d): %s", nbytes, reason)
    tensor.pinned_info = PinnedInfo(nbytes, node, bound, huge_kind, cuda, tuple(fallbacks))
    return tensor


def alloc_numa_pinned_tensor(size_bytes: int) -> torch.Tensor:
    """HeteroFusedKernels' name for :func:`alloc_pinned` with defaults."""
    return alloc_pinned(size_bytes)


def host_register(tensor: torch.Tensor) -> int:
    """HeteroFusedKernels' name for :func:`register`; returns the device pointer."""
    return register(tensor)


def get_device_ptr(host_ptr: int) -> int:
    """HeteroFusedKernels' name for :func:`device_ptr` (raises ValueError instead of returning 0)."""
    return device_ptr(host_ptr)


__all__ = [
    "PinnedInfo",
    "Region",
    "alloc_numa_pinned_tensor",
    "alloc_pinned",
    "device_alias",
    "device_ptr",
    "device_view",
    "get_device_ptr",
    "host_register",
    "is_registered",
    "register",
    "registered_regions",
    "registry_generation",
    "unregister",
]
