"""Host memory for fast device transfers: NUMA-bound pinned buffers, CUDA registration, shared segments."""

from kvstrata.memory.numa import numa_node

__all__ = ["numa_node"]
