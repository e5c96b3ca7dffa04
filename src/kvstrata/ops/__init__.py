"""Transfer operators between GPU memory and host memory (each also a ``torch.ops.kvstrata`` op)."""

from kvstrata.ops.kv_layout import HostPool, KVLayout
from kvstrata.ops.transfer_blocks import transfer_blocks

__all__ = ["HostPool", "KVLayout", "transfer_blocks"]
