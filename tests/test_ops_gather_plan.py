"""gather's launch plans: reused only for the same signature, never stale, checks still enforced."""

import gc
import importlib
import weakref

import pytest
import torch

from kvstrata.memory import alloc_pinned, pinned, register, unregister
from kvstrata.ops import gather
from kvstrata.ops.gather import SCHEDULES, gather_reference

gather_mod = importlib.import_module("kvstrata.ops.gather")
plan_mod = importlib.import_module("kvstrata.ops._gather_plan")
POISON = 0xA5


@pytest.fixture(autouse=True)
def builds(monkeypatch):
    """Count plan builds (every call that is not a cache hit), starting from an empty cache."""
    gather_mod.clear_plans()
    count = {"n": 0}
    real = gather_mod.build_plan

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(gather_mod, "build_plan", counting)
    yield count
    gather_mod.clear_plans()


def _random(shape, dtype, gen):
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _poisoned(shape, dtype):
    return torch.full((torch.Size(shape).numel() * dtype.itemsize,), POISON, dtype=torch.uint8).view(dtype).view(shape)


def _same(out, table, ids):
    return torch.equal(_bytes(out), _bytes(gather_reference(table, ids)))


def test_same_signature_reuses_the_plan_with_new_ids(builds, seeded):
    table = _random((50, 24), torch.float16, seeded)
    out = _poisoned((7, 24), torch.float16)
    for _ in range(3):
        ids = torch.randint(0, 50, (7,), generator=seeded)  # a new ids tensor each call, as engines do
        gather(table, out, ids, check=False)
        assert _same(out, table, ids)
    assert builds["n"] == 1


def test_new_out_strides_dtype_or_length_build_new_plans(builds, seeded):
    table = _random((30, 16), torch.bfloat16, seeded)
    ids = torch.tensor([29, 0, 7], dtype=torch.int32)
    out = _poisoned((3, 16), torch.bfloat16)
    gather(table, out, ids)
    wide = _poisoned((3, 40), torch.bfloat16)
    gather(table, wide[:, 5:21], ids)  # same shape, row stride 40 and an offset: a different plan
    assert _same(wide[:, 5:21], table, ids) and builds["n"] == 2
    assert bool((_bytes(wide[:, :5]) == POISON).all()) and bool((_bytes(wide[:, 21:]) == POISON).all())
    as_half = table.view(torch.float16)  # the same memory as another dtype
    out16 = _poisoned((3, 16), torch.float16)
    gather(as_half, out16, ids)
    assert _same(out16, as_half, ids) and builds["n"] == 3
    gather(table, _poisoned((2, 16), torch.bfloat16), ids[:2])
    gather(table, out, ids.long())
    assert builds["n"] == 5


def test_check_true_still_checks_ids_on_a_cached_plan(builds, seeded):
    table = _random((10, 8), torch.float32, seeded)
    out = _poisoned((2, 8), torch.float32)
    gather(table, out, torch.tensor([1, 2]))
    before = _bytes(out).clone()
    for bad in ([1, 10], [-1, 0]):
        with pytest.raises(ValueError, match="ids"):
            gather(table, out, torch.tensor(bad))
    assert torch.equal(_bytes(out), before) and builds["n"] == 1


def test_bad_input_after_a_cached_plan_still_raises_before_writing(seeded):
    table = _random((10, 8), torch.float16, seeded)
    out = _poisoned((2, 8), torch.float16)
    gather(table, out, torch.tensor([1, 2]))
    before = _bytes(out).clone()
    with pytest.raises(TypeError, match="out"):
        gather(table, out.view(torch.int16), torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="ids"):
        gather(table, out, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="out"):
        gather(table, out, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="overlap"):
        gather(table, table[:2], torch.tensor([1, 2]))
    assert torch.equal(_bytes(out), before)


def test_registry_changes_invalidate_plans(builds, seeded):
    table = _random((12, 32), torch.uint8, seeded)
    out = _poisoned((4, 32), torch.uint8)
    ids = torch.tensor([11, 3, 3, 0])
    gather(table, out, ids)
    plan = next(iter(gather_mod._PLANS.values()))
    assert plan.usable(table, out, gather_mod.TILE, gather_mod.SCHEDULE)
    register(table)
    assert not plan.usable(table, out, gather_mod.TILE, gather_mod.SCHEDULE)  # a region appeared
    gather(table, out, ids)
    assert builds["n"] == 2
    unregister(table)
    gather(table, out, ids)  # and one disappeared
    assert builds["n"] == 3 and _same(out, table, ids)


def test_freed_pinned_table_is_not_reused_at_its_address(builds, seeded):
    def make():
        t = alloc_pinned(64 * 128, numa=None, hugepages="none").view(torch.float16).view(64, 64)
        t.copy_(_random((64, 64), torch.float16, seeded))
        return t

    out = _poisoned((5, 64), torch.float16)
    ids = torch.tensor([63, 0, 9, 9, 1])
    first = make()
    gather(first, out, ids)
    address, probe = first.data_ptr(), weakref.ref(first.untyped_storage())
    del first
    gc.collect()
    assert probe() is None  # the cached plan kept no reference to the table
    second = make()  # munmap then mmap of the same size: often the very same address
    out.fill_(0)
    gather(second, out, ids)
    assert _same(out, second, ids)
    assert builds["n"] == 2, f"plan reused after the table was freed (same address: {second.data_ptr() == address})"


def test_plans_hold_no_tensors(seeded):
    table = _random((20, 8), torch.float16, seeded)
    probe = weakref.ref(table)
    gather(table, _poisoned((3, 8), torch.float16), torch.tensor([0, 5, 19]))
    del table
    gc.collect()
    assert probe() is None


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("rows", "width", "num_ctas"), [(37, 300, 2), (64, 2100, None), (1, 5, 1)])
def test_every_schedule_copies_exactly(monkeypatch, schedule, rows, width, num_ctas, seeded):
    # Small tiles and a short max row: many tiles per program and several column tiles per row.
    monkeypatch.setattr(gather_mod, "SCHEDULE", schedule)
    monkeypatch.setattr(gather_mod, "TILE", gather_mod.TileConfig(tile_bytes=1024, max_row_bytes=512))
    table = _random((90, width), torch.float16, seeded)
    source = table.clone()
    ids = torch.randint(0, 90, (rows,), generator=seeded, dtype=torch.int32)
    out = _poisoned((rows, width), torch.float16)
    gather(table, out, ids, num_ctas=num_ctas)
    assert _same(out, table, ids) and torch.equal(_bytes(table), _bytes(source))


def test_tuning_changes_take_effect_without_clearing(monkeypatch, builds, seeded):
    table = _random((20, 8), torch.float16, seeded)
    out = _poisoned((3, 8), torch.float16)
    ids = torch.tensor([0, 5, 19])
    gather(table, out, ids)
    monkeypatch.setattr(gather_mod, "SCHEDULE", "prefetch")
    gather(table, out, ids)
    monkeypatch.setattr(gather_mod, "TILE", gather_mod.TileConfig(tile_bytes=2048))
    gather(table, out, ids)
    assert builds["n"] == 3 and _same(out, table, ids)
    monkeypatch.setattr(gather_mod, "SCHEDULE", "sideways")
    with pytest.raises(ValueError, match="SCHEDULE"):
        gather(table, out, ids)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors take the CPU implementation where CUDA exists")
def test_direct_launch_passes_every_parameter_in_signature_order(monkeypatch, seeded):
    """The GPU path launches Triton's compiled kernel with raw addresses; check its argument list here."""
    table = _random((40, 64), torch.int8, seeded)
    out = _poisoned((6, 64), torch.int8)
    ids = torch.randint(0, 40, (6,), generator=seeded)
    gather(table, out, ids)
    plan = next(iter(gather_mod._PLANS.values()))
    calls = []

    def runner(args, stream):
        calls.append((dict(zip(plan_mod.kernel_arg_names(gather_mod._gather_kernel), args, strict=True)), stream))
        out.copy_(gather_reference(table, ids))

    plan.device, plan.device_index = torch.device("cpu"), 3  # pretend: a GPU plan whose runner is ready
    plan.runners[ids.data_ptr() % 16 == 0] = runner
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(plan_mod, "_raw_stream", lambda index: 1000 + index)
    out.fill_(0)
    gather(table, out, ids, check=False)
    ((args, stream),) = calls
    assert stream == 1003 and _same(out, table, ids)
    assert args["table_ptr"] == table.data_ptr() and args["out_ptr"] == out.data_ptr()
    assert args["ids_ptr"] == ids.data_ptr() and args["n_ids"] == 6 and args["n_table_rows"] == 40
    assert args["row_words"] * plan.word == 64 and args["table_stride"] * plan.word == 64
    assert {k: args[k] for k in plan.constexprs} == plan.constexprs


class _Launcher:
    """Triton 3.6's CudaLauncher layout: what ``direct_launch`` calls past."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []
        self.launch = lambda *a: self.calls.append(("launch", a))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("the direct path must not go through the Python launcher")


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, launcher):
        self.run = launcher
        self.runner_calls = []

    def __getitem__(self, grid):
        return lambda *args, stream: self.runner_calls.append((grid, args, stream))


class _HookChain:
    """Triton 3.6's always-present hook holder (``knobs.HookChain``): hooked when it holds a call."""

    def __init__(self, *calls):
        self.calls = list(calls)


@pytest.mark.parametrize("unset", [None, _HookChain()], ids=["None", "empty HookChain"])
def test_direct_launch_calls_the_c_launch_with_triton_36s_argument_layout(monkeypatch, unset):
    from triton import knobs

    from kvstrata.ops._common import direct_launch

    for hook in ("launch_enter_hook", "launch_exit_hook"):  # Triton 3.6 holds them in empty HookChains
        monkeypatch.setattr(knobs.runtime, hook, unset)

    launcher = _Launcher()
    fire = direct_launch(_Compiled(launcher), 7)
    fire([1, 2, 3], 99)
    grid_stream_fn = (7, 1, 1, 99, "fn", False, True)
    scratch_meta_hooks = (None, None, "meta", None, None, None)
    assert launcher.calls == [("launch", (*grid_stream_fn, *scratch_meta_hooks, 1, 2, 3))]


def test_direct_launch_uses_the_runner_while_a_launch_hook_is_set(monkeypatch):
    from triton import knobs

    from kvstrata.ops._common import direct_launch

    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", _HookChain())
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _HookChain(print))  # a profiler's hook, from the start
    compiled = _Compiled(_Launcher())
    direct_launch(compiled, 3)([1], 5)
    assert compiled.run.calls == [] and compiled.runner_calls == [((3, 1, 1), (1,), 5)]
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _HookChain())
    compiled = _Compiled(_Launcher())
    fire = direct_launch(compiled, 3)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", _HookChain(print))  # ... or set after the plan was made
    fire([2], 6)
    assert compiled.run.calls == [] and compiled.runner_calls == [((3, 1, 1), (2,), 6)]


def test_direct_launch_uses_the_runner_for_another_launcher_layout():
    from kvstrata.ops._common import direct_launch

    class Other(_Launcher):
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):  # another Triton
            raise AssertionError

    compiled = _Compiled(Other())
    direct_launch(compiled, 5)([4, 5], 11)
    assert compiled.run.calls == [] and compiled.runner_calls == [((5, 1, 1), (4, 5), 11)]
    scratch = _Launcher()
    scratch.global_scratch_size = 64  # needs scratch memory: only Triton's own path allocates it
    compiled = _Compiled(scratch)
    direct_launch(compiled, 5)([4], 12)
    assert scratch.calls == [] and compiled.runner_calls == [((5, 1, 1), (4,), 12)]


def test_registry_generation_counts_regions_not_uses():
    buf = torch.zeros(4096, dtype=torch.uint8)
    g0 = pinned.registry_generation()
    register(buf)
    register(buf[:100])  # inside the region: one more use, no new region
    g1 = pinned.registry_generation()
    unregister(buf)
    assert pinned.registry_generation() == g1 == g0 + 1
    unregister(buf)
    assert pinned.registry_generation() == g0 + 2


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_direct_launch_engages_and_stays_exact(seeded):
    n, width = 4096, 512
    table = alloc_pinned(n * width * 2).view(torch.float16).view(n, width)
    table.copy_(torch.randn(n, width, generator=seeded).half())
    out = torch.empty(1024, width, dtype=torch.float16, device="cuda")
    host_ids = torch.randint(0, n, (1025,), generator=seeded)
    pinned_ids = host_ids.pin_memory()
    for ids in (host_ids[:1024].cuda(), host_ids[1:].cuda(), pinned_ids[:1024], pinned_ids[1:], host_ids[:1024]):
        for _ in range(3):  # 1st call builds the plan via Triton's launch, later ones launch directly
            out.fill_(0)
            gather(table, out, ids, check=False)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), table[ids.cpu()])
    plans = [p for p in gather_mod._PLANS.values() if p.kind == "triton"]
    assert plans and all(p.runners for p in plans), "the direct launch never engaged"
    assert plan_mod._state["fast"]


@pytest.mark.gpu
def test_gpu_torch_pinned_table_and_host_out(seeded):
    table = torch.randn(300, 96, generator=seeded).half().pin_memory()  # pinned by torch: not in the registry
    ids = torch.randint(0, 300, (77,), device="cuda")
    out = torch.zeros(77, 96, dtype=torch.float16, device="cuda")
    host_out = torch.zeros(77, 96, dtype=torch.float16).pin_memory()  # written in place over PCIe
    for _ in range(3):
        gather(table, out, ids, check=False)
        gather(out, host_out, torch.arange(77, device="cuda"), check=False)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[ids.cpu()]) and torch.equal(host_out, table[ids.cpu()])
    assert any(p.recheck_table for p in gather_mod._PLANS.values())


@pytest.mark.gpu
def test_gpu_unregistered_table_refused_after_a_cached_plan(seeded):
    table = torch.randn(64, 128, generator=seeded).half()
    register(table)
    out = torch.full((3, 128), 7.0, dtype=torch.float16, device="cuda")
    ids = torch.tensor([0, 63, 5], device="cuda")
    gather(table, out, ids)
    gather(table, out, ids)
    unregister(table)
    out.fill_(7.0)
    with pytest.raises(ValueError, match="table"):
        gather(table, out, ids)
    torch.cuda.synchronize()
    assert bool((out == 7).all())


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpu_every_schedule(monkeypatch, schedule, seeded):
    monkeypatch.setattr(gather_mod, "SCHEDULE", schedule)
    n, width = 3000, 2100  # 4,200-byte rows: two column tiles
    table = alloc_pinned(n * width * 2).view(torch.float16).view(n, width)
    table.copy_(torch.randn(n, width, generator=seeded).half())
    ids = torch.randint(0, n, (999,), device="cuda")
    out = torch.zeros(999, width, dtype=torch.float16, device="cuda")
    gather(table, out, ids, check=False)
    gather(table, out, ids, check=False)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[ids.cpu()])


def test_plan_cache_is_bounded_and_cleared():
    from kvstrata.ops._common import PlanCache

    cache = PlanCache(3)
    for i in range(3):
        cache.put((i,), f"plan{i}")
    assert len(cache) == 3 and cache.get((1,)) == "plan1" and cache.get((9,)) is None
    cache.put((3,), "plan3")  # past the limit: emptied whole, then the new plan kept
    assert len(cache) == 1 and cache.get((0,)) is None and list(cache.values()) == ["plan3"]
    cache.clear()
    assert len(cache) == 0 and cache.get((3,)) is None
