import importlib

import pytest
import torch

from kvstrata.memory import alloc_pinned
from kvstrata.ops import gather
from kvstrata.ops._common import SUPPORTED_DTYPES
from kvstrata.ops.gather import gather_reference

gather_mod = importlib.import_module("kvstrata.ops.gather")  # the attribute `gather` is the function
plan_mod = importlib.import_module("kvstrata.ops._gather_plan")
HAS_CUDA = torch.cuda.is_available()
POISON = 0xA5


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test starts and ends without cached launch plans (a patched CPU path must not leak)."""
    gather_mod.clear_plans()
    yield
    gather_mod.clear_plans()


def _random(shape, dtype, gen):
    """Random bytes of any dtype (fp8 included); exact comparisons go through bytes."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _poisoned(shape, dtype, device="cpu"):
    return (
        torch.full((torch.Size(shape).numel() * dtype.itemsize,), POISON, dtype=torch.uint8, device=device)
        .view(dtype)
        .view(shape)
    )


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("width", [1, 80, 333])
def test_gather_matches_reference(dtype, id_dtype, width, seeded):
    table = _random((41, width), dtype, seeded)
    source = table.clone()
    ids = torch.randint(0, 41, (9,), dtype=id_dtype, generator=seeded)
    ids[0], ids[1] = 40, 0
    out = _poisoned((9, width), dtype)
    assert gather(table, out, ids) is out
    assert torch.equal(_bytes(out), _bytes(gather_reference(table, ids)))
    assert torch.equal(_bytes(table), _bytes(source))
    for i, row in enumerate(ids.tolist()):  # the reference itself, against the definition
        assert torch.equal(_bytes(out[i]), _bytes(table[row]))


def test_gather_strided_rows_and_wide_rows(seeded):
    big = _random((12, 3000), torch.float16, seeded)
    table = big[:, 7:2900]  # row stride != width, odd offset: falls back to narrower words
    ids = torch.tensor([11, 3, 3, 0], dtype=torch.int64)
    out = _poisoned((4, 2893), torch.float16)
    gather(table, out, ids, num_ctas=1)
    assert torch.equal(_bytes(out), _bytes(gather_reference(table, ids)))


def test_gather_empty_ids_writes_nothing(seeded):
    table = _random((5, 8), torch.bfloat16, seeded)
    backing = _poisoned((3, 8), torch.bfloat16)
    before = _bytes(backing).clone()
    assert gather(table, backing[:0], torch.empty(0, dtype=torch.int64)).shape == (0, 8)
    assert torch.equal(_bytes(backing), before)  # the rows around the empty output are untouched


def test_gather_cpu_implementation(monkeypatch, seeded):
    monkeypatch.setattr(plan_mod, "runs_triton", lambda *t: False)
    gather_mod.clear_plans()
    table = _random((20, 33), torch.float8_e4m3fn, seeded)
    ids = torch.tensor([19, 0, 5], dtype=torch.int32)
    out = _poisoned((3, 33), torch.float8_e4m3fn)
    gather(table, out, ids)
    assert torch.equal(_bytes(out), _bytes(table[ids.long()].view(torch.uint8).view(torch.float8_e4m3fn)))


def test_gather_unchecked_out_of_range_ids_leave_rows_untouched(seeded):
    table = _random((6, 16), torch.int8, seeded)
    ids = torch.tensor([1, 6, -1, 2], dtype=torch.int64)
    out = _poisoned((4, 16), torch.int8)
    gather(table, out, ids, check=False)
    assert torch.equal(out[0], table[1]) and torch.equal(out[3], table[2])
    assert bool((_bytes(out[1:3]) == POISON).all())


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"ids": torch.tensor([0, 6])}, ValueError, "ids"),
        ({"ids": torch.tensor([-1, 0])}, ValueError, "ids"),
        ({"ids": torch.tensor([0.0, 1.0])}, TypeError, "ids"),
        ({"ids": torch.tensor([[0, 1]])}, ValueError, "ids"),
        ({"out": torch.zeros(2, 8, dtype=torch.float32)}, TypeError, "out"),
        ({"out": torch.zeros(3, 8, dtype=torch.float16)}, ValueError, "out"),
        ({"table": torch.zeros(6, 8, dtype=torch.float64)}, TypeError, "table"),
        ({"table": torch.zeros(6, 8, 2, dtype=torch.float16)}, ValueError, "table"),
        ({"num_ctas": 0}, ValueError, "num_ctas"),
        ({"table": [1, 2]}, TypeError, "table"),
        # rows of out that overlap each other (silently wrong data), an expanded out, meta tensors named right
        ({"out": torch.full((10,), 9.0, dtype=torch.float16).as_strided((2, 8), (2, 1))}, ValueError, "overlap"),
        ({"out": torch.full((8,), 9.0, dtype=torch.float16).expand(2, 8)}, ValueError, "overlap"),
        ({"out": torch.zeros(2, 8, dtype=torch.float16, device="meta")}, ValueError, "out: expected a CPU or CUDA"),
        ({"ids": torch.tensor([0, 1], device="meta")}, ValueError, "ids: expected a CPU or CUDA"),
        ({"out": torch.zeros(2, 8, dtype=torch.float16, requires_grad=True)}, ValueError, "out: requires grad"),
    ],
)
def test_gather_bad_input_raises_before_writing(kwargs, exc, match):
    args = {"table": torch.ones(6, 8, dtype=torch.float16), "ids": torch.tensor([0, 1]), "num_ctas": None}
    args["out"] = torch.full((2, 8), 9.0, dtype=torch.float16)
    args.update(kwargs)
    out = args["out"]
    before = out.detach().clone()
    with pytest.raises(exc, match=match):
        gather(args["table"], out, args["ids"], num_ctas=args["num_ctas"])
    if out.device.type != "meta":
        assert torch.equal(out.detach(), before)


def test_gather_overlap_refused():
    table = torch.zeros(8, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match="overlap"):
        gather(table, table[2:4], torch.tensor([0, 1]))


def test_gather_is_a_custom_op():
    assert hasattr(torch.ops.kvstrata, "gather")
    table = torch.arange(12, dtype=torch.float32).view(6, 2)
    out = torch.zeros(2, 2)
    torch.ops.kvstrata.gather(table, out, torch.tensor([5, 1]), None, True)
    assert torch.equal(out, table[[5, 1]])


# --------------------------------------------------------------------------------------------- GPU
def _host_table(rows, width, dtype, gen, finite=False):
    t = alloc_pinned(rows * width * dtype.itemsize).view(dtype).view(rows, width)
    t.copy_(torch.randn(rows, width, generator=gen).to(dtype) if finite else _random((rows, width), dtype, gen))
    return t


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("where", ["host_table_device_ids", "host_table_host_ids", "device_table"])
@pytest.mark.parametrize("width", [80, 512, 4099])
def test_gpu_gather(dtype, id_dtype, where, width, seeded):
    table = _host_table(1000, width, dtype, seeded)
    source = table.clone()
    ids = torch.randint(0, 1000, (1025,), dtype=id_dtype, generator=seeded)
    if where == "device_table":
        table = table.cuda()
    if where != "host_table_host_ids":
        ids = ids.cuda()
    out = _poisoned((1025, width), dtype, "cuda")
    gather(table, out, ids)
    torch.cuda.synchronize()
    expected = gather_reference(table.cpu(), ids.cpu())
    assert torch.equal(_bytes(out.cpu()), _bytes(expected))
    assert torch.equal(_bytes(table.cpu()), _bytes(source))


@pytest.mark.gpu
def test_gpu_gather_unregistered_host_table_refused(seeded):
    table = torch.zeros(10, 64, dtype=torch.float16)
    out = torch.full((2, 64), 3.0, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="table"):
        gather(table, out, torch.tensor([0, 1], device="cuda"))
    assert bool((out == 3).all())
    with pytest.raises(ValueError, match="ids"):
        gather(table.cuda(), out, torch.tensor([0, 10], device="cuda"))
    assert bool((out == 3).all())


@pytest.mark.gpu
def test_gpu_gather_num_ctas_and_torch_compile(seeded):
    table = _host_table(4096, 512, torch.bfloat16, seeded, finite=True)
    ids = torch.randint(0, 4096, (777,), device="cuda", generator=None)
    out = _poisoned((777, 512), torch.bfloat16, "cuda")
    gather(table, out, ids, num_ctas=1)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[ids.cpu()])

    @torch.compile(fullgraph=True)
    def fn(table, out, ids):
        gather(table, out, ids, check=False)
        return out * 2

    out2 = _poisoned((777, 512), torch.bfloat16, "cuda")
    doubled = fn(table, out2, ids)
    torch.cuda.synchronize()
    assert torch.equal(out2.cpu(), table[ids.cpu()])
    assert torch.equal(doubled.cpu(), table[ids.cpu()] * 2)


@pytest.mark.gpu
def test_gpu_gather_cuda_graph_capture_and_replay(seeded):
    table = _host_table(2048, 256, torch.float16, seeded, finite=True)
    ids = torch.randint(0, 2048, (300,), device="cuda")
    out = _poisoned((300, 256), torch.float16, "cuda")
    gather(table, out, ids, check=False)  # warm-up: compile the kernel outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather(table, out, ids, check=False)
    out.fill_(0)
    ids.copy_(torch.randint(0, 2048, (300,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[ids.cpu()])
