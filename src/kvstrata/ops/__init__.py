"""Transfer operators (each also a torch custom op ``torch.ops.kvstrata.<name>``)."""

from kvstrata.ops._common import current_stream
from kvstrata.ops.block_pack import pack_blocks, unpack_blocks
from kvstrata.ops.block_transfer import fused_memcpy_multi_layer_block_transfer, multi_layer_block_transfer
from kvstrata.ops.calibration import calibrate
from kvstrata.ops.gather import gather
from kvstrata.ops.kv_layout import HostPool, KVLayout
from kvstrata.ops.transfer_blocks import interleave, transfer_blocks, transfer_blocks_steps

__all__ = [
    "HostPool",
    "KVLayout",
    "calibrate",
    "current_stream",
    "fused_memcpy_multi_layer_block_transfer",
    "gather",
    "interleave",
    "multi_layer_block_transfer",
    "pack_blocks",
    "transfer_blocks",
    "transfer_blocks_steps",
    "unpack_blocks",
]
