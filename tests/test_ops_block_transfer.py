import importlib

import pytest
import torch

from kvstrata.memory import alloc_pinned
from kvstrata.ops import fused_memcpy_multi_layer_block_transfer, multi_layer_block_transfer
from kvstrata.ops._common import SUPPORTED_DTYPES
from kvstrata.ops.block_transfer import choose_method

bt = importlib.import_module("kvstrata.ops.block_transfer")
POISON = 0x5A


def _random(shape, dtype, gen, device="cpu"):
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape).to(device)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _setup(shape, dtype, gen, device="cpu", block=None):
    """Device pool [num_blocks, L, H, T, D] and the pointers of block ``block``'s layers."""
    nb, L = shape[:2]
    pool = _random(shape, dtype, gen, device)
    b = nb - 1 if block is None else block
    ptrs = torch.tensor([pool[b, layer].data_ptr() for layer in range(L)], dtype=torch.int64, device=device)
    return pool, b, ptrs


def _host(shape, dtype, gen, pinned):
    T, L, H, D = shape
    if not pinned:
        return _random(shape, dtype, gen)
    t = alloc_pinned(T * L * H * D * dtype.itemsize).view(dtype).view(shape)
    t.copy_(_random(shape, dtype, gen))
    return t


def _run_and_check(shape, dtype, direction, method, gen, *, device="cpu", pinned=False, staging=None, ptrs_on=None):
    nb, L, H, T, D = shape
    pool, b, ptrs = _setup(shape, dtype, gen, device)
    if ptrs_on is not None:
        ptrs = ptrs.to(ptrs_on)
    others = [i for i in range(nb) if i != b]
    pool_before = pool.clone()
    host = _host((T, L, H, D), dtype, gen, pinned)
    host_before = host.clone()
    if direction == "h2d":
        pool[b].view(torch.uint8).fill_(POISON)
    else:
        host.view(torch.uint8).fill_(POISON)
    multi_layer_block_transfer(ptrs, host, direction=direction, method=method, staging=staging)
    if device != "cpu":
        torch.cuda.synchronize()
    if direction == "h2d":
        assert torch.equal(_bytes(pool[b].permute(2, 0, 1, 3).cpu()), _bytes(host))
        assert torch.equal(_bytes(host), _bytes(host_before))  # source unchanged
    else:
        assert torch.equal(_bytes(host), _bytes(pool_before[b].permute(2, 0, 1, 3).cpu()))
        assert torch.equal(_bytes(pool[b]), _bytes(pool_before[b]))
    assert torch.equal(_bytes(pool[others]), _bytes(pool_before[others]))  # other blocks untouched


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("method", ["zero_copy", "staging"])
def test_block_transfer_every_dtype(dtype, direction, method, seeded):
    _run_and_check((2, 3, 2, 9, 80), dtype, direction, method, seeded)


@pytest.mark.parametrize("shape", [(1, 7, 1, 9, 80), (3, 2, 3, 5, 1), (2, 1, 1, 1, 1500)])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_transfer_odd_shapes(shape, direction, seeded):
    _run_and_check(shape, torch.bfloat16, direction, "auto", seeded)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_transfer_staging_ring_smaller_than_block(direction, seeded):
    # 2 staging tokens for 9: one-token pieces through a two-slot ring, every slot reused.
    staging = torch.empty(2, 7, 2, 80, dtype=torch.float16)
    _run_and_check((2, 7, 2, 9, 80), torch.float16, direction, "staging", seeded, staging=staging)


def test_fused_memcpy_alias(seeded):
    pool, b, ptrs = _setup((1, 3, 2, 9, 16), torch.int8, seeded)
    host = _random((9, 3, 2, 16), torch.int8, seeded)
    fused_memcpy_multi_layer_block_transfer(ptrs, host, torch.empty(9, 3, 2, 16, dtype=torch.int8))
    assert torch.equal(_bytes(pool[b].permute(2, 0, 1, 3)), _bytes(host))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_transfer_cpu_implementation(monkeypatch, direction, seeded):
    monkeypatch.setattr(bt, "runs_triton", lambda *t: False)
    _run_and_check((2, 7, 2, 9, 80), torch.float8_e5m2, direction, "auto", seeded)


def test_choice_without_calibration():
    assert choose_method(1024, "h2d") == "zero_copy"
    assert choose_method(64 << 20, "d2h") == "staging"
    assert choose_method(64 << 20, "d2h", row_bytes=2048, device=torch.device("cpu")) == "staging"


def test_auto_uses_the_calibration_with_a_row_as_the_chunk(monkeypatch):
    """On CUDA, auto asks the calibration (zero_copy/staging only, row bytes as the chunk size)."""
    from kvstrata.ops import calibration

    seen = []

    def fake(direction, chunk, n_chunks, *, device=None, methods=None, concurrent=False, other=None):
        seen.append((direction, chunk, n_chunks, tuple(sorted(methods))))
        return "zero_copy" if chunk < 4096 else "staging"

    monkeypatch.setattr(calibration, "choose_method", fake)
    cuda = torch.device("cuda", 0)
    assert choose_method(64 << 20, "d2h", row_bytes=2048, device=cuda) == "zero_copy"  # no fixed threshold
    assert choose_method(1024, "h2d", row_bytes=8192, device=cuda) == "staging"
    assert seen == [("d2h", 2048, 32768, ("staging", "zero_copy")), ("h2d", 8192, 1, ("staging", "zero_copy"))]


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_transfer_staging_many_pieces(monkeypatch, direction, seeded):
    # Small slots: tokens in several pieces through a reused ring, and a token split across pieces.
    from kvstrata.ops import staging

    monkeypatch.setattr(staging, "SLOT_BYTES", 3 * 2 * 80 * 2)
    _run_and_check((2, 5, 2, 9, 80), torch.bfloat16, direction, "staging", seeded)
    monkeypatch.setattr(staging, "SLOT_BYTES", 80 * 2)  # one row per slot
    _run_and_check((1, 3, 2, 4, 80), torch.bfloat16, direction, "staging", seeded)


def _args(gen):
    pool, _, ptrs = _setup((2, 3, 2, 9, 8), torch.float16, gen)
    return pool, ptrs, torch.zeros(9, 3, 2, 8, dtype=torch.float16)


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda p, h, kw: (p[:2], h, kw), ValueError, "layer_ptrs"),
        (lambda p, h, kw: (p.to(torch.int32), h, kw), TypeError, "layer_ptrs"),
        (lambda p, h, kw: (torch.zeros_like(p), h, kw), ValueError, "layer_ptrs"),
        (lambda p, h, kw: (torch.full_like(p, -4096), h, kw), ValueError, "layer_ptrs"),  # segfaulted
        (lambda p, h, kw: (p, h.transpose(0, 1), kw), ValueError, "host_block"),
        (lambda p, h, kw: (p, h[0], kw), ValueError, "host_block"),
        (lambda p, h, kw: (p, h.double(), kw), TypeError, "host_block"),
        (lambda p, h, kw: (p, h, {**kw, "direction": "up"}), ValueError, "direction"),
        (lambda p, h, kw: (p, h, {**kw, "method": "fast"}), ValueError, "method"),
        (lambda p, h, kw: (p, h, {**kw, "num_ctas": -2}), ValueError, "num_ctas"),
        (lambda p, h, kw: (p, h, {**kw, "staging": torch.zeros(9, 3, 2, 9).half()}), ValueError, "staging"),
        (lambda p, h, kw: (p, h, {**kw, "staging": torch.zeros(9, 3, 2, 8)}), TypeError, "staging"),
    ],
)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_transfer_bad_input_raises_before_writing(change, exc, match, direction, seeded):
    pool, ptrs, host = _args(seeded)
    host.fill_(4.0)
    pool_before, host_before = pool.clone(), host.clone()
    p, h, kw = change(ptrs, host, {"direction": direction})
    with pytest.raises(exc, match=match):
        multi_layer_block_transfer(p, h, **kw)
    assert torch.equal(_bytes(pool), _bytes(pool_before)) and torch.equal(_bytes(host), _bytes(host_before))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_transfer_custom_ops(direction, seeded):
    pool, b, ptrs = _setup((1, 3, 2, 9, 16), torch.float32, seeded)
    host = _random((9, 3, 2, 16), torch.float32, seeded)
    torch.ops.kvstrata.multi_layer_block_transfer(ptrs, host, direction, "zero_copy", None, None)
    assert torch.equal(_bytes(pool[b].permute(2, 0, 1, 3)), _bytes(host))
    assert hasattr(torch.ops.kvstrata, f"block_transfer_{direction}")


# --------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(3, 7, 2, 9, 80), (2, 32, 8, 16, 128), (1, 2, 1, 4, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("method", ["zero_copy", "staging", "auto"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_block_transfer(dtype, direction, method, shape, seeded):
    _run_and_check(shape, dtype, direction, method, seeded, device="cuda", pinned=True)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_gpu_block_transfer_host_ptrs_and_staging_ring(direction, seeded):
    staging = torch.empty(3, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    _run_and_check(
        (2, 32, 8, 16, 128),
        torch.bfloat16,
        direction,
        "staging",
        seeded,
        device="cuda",
        pinned=True,
        staging=staging,
        ptrs_on="cpu",
    )
    _run_and_check((2, 32, 8, 64, 128), torch.bfloat16, direction, "staging", seeded, device="cuda", pinned=True)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("method", ["staging", "auto"])
def test_gpu_block_transfer_many_pieces(monkeypatch, direction, method, seeded):
    # 1 MiB slots: a 2.25 MiB block in 3 pieces through the ring, heads > 1, pointers on the device.
    from kvstrata.ops import staging

    monkeypatch.setattr(staging, "SLOT_BYTES", 1 << 20)
    _run_and_check((2, 6, 4, 384, 128), torch.bfloat16, direction, method, seeded, device="cuda", pinned=True)


@pytest.mark.gpu
def test_gpu_block_transfer_unregistered_host_refused(seeded):
    _, _, ptrs = _setup((1, 2, 2, 4, 64), torch.float16, seeded, "cuda")
    host = torch.zeros(4, 2, 2, 64, dtype=torch.float16)
    for method in ("zero_copy", "staging"):
        with pytest.raises(ValueError, match="host_block"):
            multi_layer_block_transfer(ptrs, host, direction="d2h", method=method)
    assert bool((host == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["zero_copy", "staging"])
def test_gpu_block_transfer_compile_and_graph(method, seeded):
    pool, b, ptrs = _setup((2, 4, 2, 16, 128), torch.bfloat16, seeded, "cuda")
    host = _host((16, 4, 2, 128), torch.bfloat16, seeded, pinned=True)

    @torch.compile(fullgraph=True)
    def load(ptrs, host):
        multi_layer_block_transfer(ptrs, host, direction="h2d", method=method)

    load(ptrs, host)
    torch.cuda.synchronize()
    assert torch.equal(_bytes(pool[b].permute(2, 0, 1, 3).cpu()), _bytes(host))

    back = _host((16, 4, 2, 128), torch.bfloat16, seeded, pinned=True)
    multi_layer_block_transfer(ptrs, back, direction="d2h", method=method)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        multi_layer_block_transfer(ptrs, back, direction="d2h", method=method)
    back.zero_()
    pool[b].normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bytes(back), _bytes(pool[b].permute(2, 0, 1, 3).cpu()))
