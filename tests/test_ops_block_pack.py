"""pack_blocks / unpack_blocks against the torch reference, over dtypes, layouts and shapes (CPU: Triton's
interpreter; GPU: the kernel), and their bad input."""

from __future__ import annotations

import pytest
import torch

from kvstrata.errors import InvalidType, InvalidValue
from kvstrata.ops import KVLayout
from kvstrata.ops.block_pack import pack_blocks, pack_blocks_reference, unpack_blocks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _layout(
    kind: str, dtype: torch.dtype, device: str, blocks: int = 12, tokens: int = 4, heads: int = 2, dim: int = 8
):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if kind == "vllm":
        return KVLayout.from_vllm([rand(2, blocks, tokens, heads, dim) for _ in range(3)])
    if kind == "vllm_block_major":  # [num_blocks, 2, ...] passed as a transposed view
        return KVLayout.from_vllm([rand(blocks, 2, tokens, heads, dim).transpose(0, 1) for _ in range(2)])
    if kind == "sglang":
        k = [rand(blocks * tokens, heads, dim) for _ in range(2)]
        return KVLayout.from_sglang(k, [rand(blocks * tokens, heads, dim) for _ in range(2)], page_size=tokens)
    return KVLayout.from_mla([rand(blocks, tokens, dim * 3) for _ in range(4)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["vllm", "vllm_block_major", "sglang", "mla"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_pack_matches_the_reference_and_unpack_inverts_it(device, kind, dtype):
    layout = _layout(kind, dtype, device)
    ids = [7, 0, 11, 3]
    out = torch.full((5, layout.block_bytes), 0xAB, dtype=torch.uint8, device=device)
    ref = out.clone()
    assert pack_blocks(layout, ids, out).shape == (4, layout.block_bytes)
    pack_blocks_reference(layout, ids, ref, to_buffer=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)  # row 4 untouched too
    before = [view.clone() for view in layout.seg_views]
    targets = [1, 2, 5, 9]
    unpack_blocks(layout, targets, out)
    if device == "cuda":
        torch.cuda.synchronize()
    chunk = layout.chunk_bytes
    for s, view in enumerate(layout.seg_views):
        for row, dst in enumerate(targets):
            assert torch.equal(view[dst], ref[row, s * chunk : (s + 1) * chunk])
        untouched = [b for b in range(layout.num_blocks) if b not in targets]
        assert torch.equal(view[untouched], before[s][untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_many_blocks_and_odd_sizes(device):
    layout = _layout("vllm", torch.float16, device, blocks=300, tokens=3, heads=1, dim=5)  # 30-byte chunks
    ids = list(range(299, -1, -2))
    out = torch.empty(len(ids), layout.block_bytes, dtype=torch.uint8, device=device)
    ref = torch.empty_like(out)
    pack_blocks(layout, ids, out)
    pack_blocks_reference(layout, ids, ref, to_buffer=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)


def test_bad_input_names_the_argument():
    layout = _layout("vllm", torch.float16, "cpu")
    good = torch.empty(4, layout.block_bytes, dtype=torch.uint8)
    cases = [
        (lambda: pack_blocks(layout, [12], good), InvalidValue, r"block_ids\[0\]: 12 is outside the cache's 12 blocks"),
        (lambda: pack_blocks(layout, [1.0], good), InvalidType, r"block_ids\[0\]: must be an int"),
        (lambda: pack_blocks(layout, torch.zeros(2, 2, dtype=torch.long), good), InvalidValue, "1-D integer"),
        (lambda: pack_blocks(layout, [0] * 5, good), InvalidValue, "out: 4 rows for 5 blocks"),
        (lambda: pack_blocks(layout, [0], good.view(torch.int8)), InvalidValue, "out: must be a contiguous uint8"),
        (lambda: pack_blocks(layout, [0], good[:, :-1]), InvalidValue, "out: must be a contiguous uint8"),
        (lambda: pack_blocks(layout, [0], good.t().contiguous().t()), InvalidValue, "not contiguous"),
        (lambda: unpack_blocks(layout, [0], "x"), InvalidType, "src: must be a torch.Tensor"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert pack_blocks(layout, [], good).shape == (0, layout.block_bytes)


@pytest.mark.parametrize("kind", ["vllm", "vllm_block_major", "sglang", "mla"])
def test_the_cpu_path_without_the_interpreter(monkeypatch, kind):
    from kvstrata.ops import block_pack

    monkeypatch.setattr(block_pack, "interpreting", lambda: False)
    layout = _layout(kind, torch.bfloat16, "cpu")
    out, ref = (torch.zeros(3, layout.block_bytes, dtype=torch.uint8) for _ in range(2))
    pack_blocks(layout, [5, 1, 10], out)
    pack_blocks_reference(layout, [5, 1, 10], ref, to_buffer=True)
    assert torch.equal(out, ref)
    unpack_blocks(layout, [0, 2, 3], out)
    assert all(torch.equal(v[0], v[5]) and torch.equal(v[3], v[10]) for v in layout.seg_views)


def test_the_custom_ops_are_registered_and_run():
    layout = _layout("vllm", torch.float16, "cpu")
    out = torch.zeros(2, layout.block_bytes, dtype=torch.uint8)
    geom = [layout.num_segments, layout.chunk_bytes, layout.block_stride, layout.block_bytes, layout.align]
    torch.ops.kvstrata.pack_blocks(*layout.op_args(), out, torch.tensor([4, 9]), geom)
    ref = torch.zeros_like(out)
    pack_blocks_reference(layout, [4, 9], ref, to_buffer=True)
    assert torch.equal(out, ref)
    torch.ops.kvstrata.unpack_blocks(*layout.op_args(), out, torch.tensor([0, 1]), geom)
    assert all(torch.equal(v[0], v[4]) and torch.equal(v[1], v[9]) for v in layout.seg_views)


@pytest.mark.gpu
def test_gpu_pack_under_torch_compile_with_device_ids():
    layout = _layout("vllm", torch.bfloat16, "cuda", blocks=64, tokens=16, heads=8, dim=128)
    out = torch.zeros(8, layout.block_bytes, dtype=torch.uint8, device="cuda")
    ids = torch.arange(8, 16, device="cuda")

    @torch.compile(fullgraph=True)
    def pack(ids):
        pack_blocks(layout, ids, out, check=False)

    pack(ids)
    ref = torch.zeros_like(out)
    pack_blocks_reference(layout, list(range(8, 16)), ref, to_buffer=True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
