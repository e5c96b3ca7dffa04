"""The HBM tier: one device buffer on a CUDA GPU carved by an offset allocator.

The buffer is allocated once through torch (so it comes from torch's caching allocator and is
visible to torch streams); objects are byte ranges of it, handed out as uint8 device tensors. On a
machine without CUDA the tier cannot be configured (``StoreConfig.gpu_bytes`` must stay 0); the
``device`` argument also accepts a torch CPU device so the bookkeeping can be exercised anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from kvstrata.errors import InvalidValue
from kvstrata.store.allocator import OffsetAllocator
from kvstrata.store.tiers.base import BlockTier, Location

log = logging.getLogger(__name__)


class GpuTier(BlockTier):
    """``capacity`` bytes of device memory on ``device`` (an index or a torch device)."""

    name = "gpu"

    def __init__(self, capacity: int, *, device: int | str | Any = 0):
        import torch

        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidValue("gpu_bytes: an HBM tier needs a CUDA GPU, and none is available")
        self.device = dev
        self._buffer = torch.empty(capacity, dtype=torch.uint8, device=dev)
        self._alloc = OffsetAllocator(capacity)
        self._registered: dict[int, int] = {}  # host address -> bytes registered with CUDA

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def used(self) -> int:
        return self._alloc.used_bytes

    def allocate(self, size: int) -> Location | None:
        off = self._alloc.allocate(size)
        return None if off is None else Location(0, off, size)

    def free(self, location: Location) -> None:
        self._alloc.free(location.offset)

    def tensor(self, location: Location) -> Any:
        """The uint8 device tensor over ``location`` (no copy)."""
        return self._buffer[location.offset : location.offset + location.size]

    def write(self, location: Location, src: Any, *, non_blocking: bool = False) -> None:
        """Copy a tensor's bytes (any device, contiguous) into ``location``."""
        import torch

        flat = src.detach().contiguous().view(-1).view(torch.uint8)
        if flat.numel() != location.size:
            raise InvalidValue(f"src: {flat.numel()} bytes, location holds {location.size}")
        self.tensor(location).copy_(flat, non_blocking=non_blocking)

    def register_host(self, address: int, nbytes: int) -> bool:
        """Page-lock a host range with CUDA so loads from it run at DMA speed (False: stays pageable).

        Registers through :func:`kvstrata.memory.register` (mapped + portable, one process-wide
        registry); a failure is logged and the copies stay correct, only slower.
        """
        if self.device.type != "cuda" or address in self._registered:
            return address in self._registered
        from kvstrata.errors import CapacityError
        from kvstrata.memory import register

        try:
            register(address, nbytes)
        except (CapacityError, RuntimeError) as exc:
            log.warning("HBM tier: cannot page-lock %d host bytes (%s); loads use pageable copies", nbytes, exc)
            return False
        self._registered[address] = nbytes
        return True

    def unregister_host(self, address: int) -> None:
        """Undo :meth:`register_host` of the range at ``address`` (a no-op where it was not registered)."""
        if self._registered.pop(address, None) is not None:
            from kvstrata.memory import unregister

            unregister(address)

    def unregister_all(self) -> None:
        """Undo :meth:`register_host` (before the host memory is unmapped). Every region is tried, whatever fails
        (a CUDA error on one must not leave the others registered past their unmapping); the first error is raised
        once all were tried."""
        from kvstrata.memory import unregister

        first: BaseException | None = None
        for address in list(self._registered):
            try:
                unregister(address)
            except Exception as exc:
                first = first or exc
        self._registered.clear()
        if first is not None:
            raise first

    def stats(self) -> dict:
        return {**self._alloc.stats(), "device": str(self.device), "host_registered": sum(self._registered.values())}

    def close(self) -> None:
        self.unregister_all()
        self._buffer = None


__all__ = ["GpuTier"]
