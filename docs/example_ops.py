import torch
from kvstrata.memory import alloc_pinned
from kvstrata.ops import HostPool, KVLayout, gather, transfer_blocks

device = "cuda" if torch.cuda.is_available() else "cpu"
# A vLLM-style paged KV cache: per layer [2 (K/V), num_blocks, block_size, heads, head_dim].
kv_caches = [torch.randn(2, 256, 16, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(4)]
layout = KVLayout.from_vllm(kv_caches)
pool = HostPool.allocate(layout, 64)                 # block_first: one host block = every layer of a block
transfer_blocks(layout, pool, [3, 17, 42], [0, 1, 2], direction="d2h")  # offload 3 blocks, all layers
transfer_blocks(layout, pool, [5, 6, 7], [0, 1, 2], direction="h2d")    # load them into blocks 5-7
assert torch.equal(kv_caches[2][:, 17], kv_caches[2][:, 6])

# Embedding rows gathered from a table in pinned host memory (read in place over PCIe on a GPU).
host = alloc_pinned(10_000 * 256 * 2)                 # NUMA-bound, registered with CUDA
table = host.view(torch.float16).view(10_000, 256)
table.copy_(torch.randn(10_000, 256))
ids = torch.tensor([5, 9_999, 0, 5])
out = torch.empty(4, 256, dtype=torch.float16, device=device)
gather(table, out, ids.to(device))
assert torch.equal(out.cpu(), table[ids])
print(host.pinned_info)                              # what it got, and every fallback
