"""Host memory for fast device transfers: NUMA-bound pinned buffers, CUDA registration, shared segments."""

from kvstrata.memory.numa import numa_node
from kvstrata.memory.pinned import (
    PinnedInfo,
    alloc_numa_pinned_tensor,
    alloc_pinned,
    device_ptr,
    device_view,
    get_device_ptr,
    host_register,
    is_registered,
    register,
    unregister,
)

__all__ = [
    "PinnedInfo",
    "alloc_numa_pinned_tensor",
    "alloc_pinned",
    "device_ptr",
    "device_view",
    "get_device_ptr",
    "host_register",
    "is_registered",
    "numa_node",
    "register",
    "unregister",
]
