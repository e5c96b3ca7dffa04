"""Configuration of the object store: capacities, watermarks, write modes."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.errors import InvalidValue
from kvstrata.stat_names import STORE_COUNTERS  # noqa: F401 - stats that only grow (metrics' counters)


class WriteMode(enum.StrEnum):
    """Where a value lives and what may happen to it under memory pressure."""

    MEMORY = "memory"  # DRAM only; spilled to SSD under pressure (never lost while the store runs)
    WRITE_THROUGH = "write_through"  # DRAM + SSD file written before the write returns; survives restarts
    WRITE_BACK = "write_back"  # DRAM now, SSD soon (background flusher; flushed on close)
    EVICTABLE = "evictable"  # DRAM only; may be dropped under pressure (a later get misses)


def _positive_int(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValue(f"{name}: must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidValue(f"{name}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class StoreConfig:
    """Capacities and policies of one :class:`~kvstrata.store.ObjectStore`.

    Example::

        StoreConfig(memory_bytes=1 << 30, disk_dir="/var/cache/kvstrata", disk_bytes=64 << 30)
    """

    memory_bytes: int
    disk_dir: str | None = None
    disk_bytes: int = 0
    gpu_bytes: int = 0
    gpu_device: int | None = None
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    hugepages: str = "auto"
    numa_node: int | str | None = "auto"
    segment_bytes: int = 256 << 20  # the memory tier grows by segments of this size up to memory_bytes
    disk_sync: bool = False  # fsync SSD files (and their directory) before a write counts as done
    flush_interval: float = 0.05  # seconds between write-back flushes and TTL sweeps

    def __post_init__(self) -> None:
        _positive_int("memory_bytes", self.memory_bytes)
        _positive_int("disk_bytes", self.disk_bytes, allow_zero=True)
        _positive_int("gpu_bytes", self.gpu_bytes, allow_zero=True)
        _positive_int("segment_bytes", self.segment_bytes)
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            raise InvalidValue(f"disk_dir: must be a path string or None, got {self.disk_dir!r}")
        if self.disk_dir is not None and self.disk_bytes == 0:
            raise InvalidValue("disk_bytes: must be > 0 when disk_dir is set")
        if self.disk_dir is None and self.disk_bytes:
            raise InvalidValue("disk_dir: must be set when disk_bytes > 0")
        if self.gpu_device is not None and (isinstance(self.gpu_device, bool) or not isinstance(self.gpu_device, int)):
            raise InvalidValue(f"gpu_device: must be a CUDA device index or None, got {self.gpu_device!r}")
        for name in ("high_watermark", "low_watermark", "flush_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidValue(f"{name}: must be a number, got {value!r}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise InvalidValue(f"high_watermark: must be in (0, 1], got {self.high_watermark}")
        if not 0.0 <= self.low_watermark <= self.high_watermark:
            raise InvalidValue(
                f"low_watermark: must be in [0, high_watermark={self.high_watermark}], got {self.low_watermark}"
            )
        if self.flush_interval <= 0:
            raise InvalidValue(f"flush_interval: must be > 0, got {self.flush_interval}")
        if self.hugepages not in ("auto", "on", "off", True, False):
            raise InvalidValue(f"hugepages: must be 'auto', 'on' or 'off', got {self.hugepages!r}")
        node = self.numa_node
        if not (node is None or node == "auto" or (isinstance(node, int) and not isinstance(node, bool) and node >= 0)):
            raise InvalidValue(f"numa_node: must be 'auto', None or a node index >= 0, got {node!r}")
        if not isinstance(self.disk_sync, bool):
            raise InvalidValue(f"disk_sync: must be a bool, got {self.disk_sync!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> StoreConfig:
        """Build from a dict (YAML, environment); unknown keys raise ValueError naming them."""
        if not isinstance(data, Mapping):
            raise InvalidValue(f"data: must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidValue(f"data: unknown store settings {unknown} (known: {sorted(known)})")
        return cls(**dict(data))

    def resolved_numa_node(self) -> int | None:
        """The NUMA node to bind DRAM segments to: ``"auto"`` means the GPU's node when there is one."""
        if self.numa_node != "auto":
            return self.numa_node  # type: ignore[return-value]
        try:
            from kvstrata.memory.numa import numa_node

            return numa_node(self.gpu_device)
        except Exception:  # no torch / no CUDA: no binding, and that is fine
            return None


__all__ = ["StoreConfig", "WriteMode"]
