"""Hybrid all-gather against torch's all_gather_into_tensor: gloo + CPU processes here, NCCL on two GPUs.

Process spawn is slow, so each test spawns one group and runs many cases inside it. Workers use
short timeouts so a bug fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64]
COUNTS = [1, 7, 1001, 20011]
# (ratio, head, cross_node): both head legs at two ratios, direct cross-node reads at two, defaults elsewhere
SPLITS = [
    (1, "auto", "relay"),
    (1, "auto", "direct"),
    (2, "p2p", "relay"),
    (2, "gather", "relay"),
    (3, "gather", "direct"),
    (3, "p2p", "relay"),
    (8, "auto", "relay"),
    ("auto", "auto", "relay"),
]


def _init(rank: int, world: int, store: str, backend: str, timeout: float = 20.0) -> None:
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast on the shared machines
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _leftovers(uid: str) -> list[str]:
    return [n for d in ("/dev/shm", "/dev/hugepages") if os.path.isdir(d) for n in os.listdir(d) if uid in n]


def _make_input(rank: int, count: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype.is_floating_point:
        x = torch.randn(count, generator=g).to(dtype)
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), (count,), generator=g).to(dtype)
    return x.to(device)


def _poison(out: torch.Tensor) -> None:
    out.view(torch.uint8).fill_(0xA5)


def _correctness(rank: int, world: int, store: str, backend: str, numa_map, bad_input: bool) -> None:
    from kvstrata.comm import hostpath, hybrid
    from kvstrata.comm.hybrid import HybridAllGather

    hostpath.CHUNK_BYTES = 4096  # many chunks even at test sizes: exercises the per-chunk pipeline
    hybrid.AUTO_MIN_BYTES = 0  # let "auto" measure even tiny tensors
    _init(rank, world, store, backend)
    device = "cuda" if backend == "nccl" else "cpu"
    ags = {
        (r, h, c): HybridAllGather(ratio=r, head=h, cross_node=c, numa_map=numa_map, timeout=10.0) for r, h, c in SPLITS
    }
    case = 0
    for dtype in DTYPES:
        for count in COUNTS:
            x = _make_input(rank, count, dtype, device, case)
            x_before = x.clone()
            ref = torch.empty(world * count, dtype=dtype, device=device)
            dist.all_gather_into_tensor(ref, x)
            for (ratio, head, cross), ag in ags.items():
                for async_op in (False, True):
                    case += 1
                    out = torch.empty(world * count, dtype=dtype, device=device)
                    _poison(out)
                    src = x
                    if device == "cuda":  # the input is written late on the current stream: copies must wait
                        torch.cuda._sleep(2_000_000)
                        src = x.clone()
                    token = ag.all_gather(out, src, async_op=async_op)
                    what = f"rank {rank} dtype {dtype} count {count} ratio {ratio} head {head} {cross} async {async_op}"
                    if async_op:
                        assert token is not None
                        if device == "cuda":  # wait on a side stream and check there, without a device sync
                            side = torch.cuda.Stream()
                            token.wait(side)
                            with torch.cuda.stream(side):
                                assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), what
                        token.wait()
                        token.wait()  # idempotent
                    else:
                        assert token is None
                    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), what
                    assert torch.equal(x.view(torch.uint8), x_before.view(torch.uint8)), what
    # Repeated calls reuse the segments: one generation per instance (sizes only shrink after the max).
    for split, ag in ags.items():
        if split[0] != "auto":
            assert ag._gen <= 2, (split, ag._gen)
            assert ag._seq > 10, (split, ag._seq)
    choices: list = [None] * world
    dist.all_gather_object(choices, ags[("auto", "auto", "relay")].auto_choices)
    assert all(c == choices[0] for c in choices) and choices[0], choices
    # Back-to-back async calls on two buffers before any wait: double buffering must keep them apart.
    ag = ags[(1, "auto", "direct")]
    xs = [_make_input(rank, 5000, torch.float32, device, 1000 + i) for i in range(4)]
    outs = [torch.full((world * 5000,), float("nan"), device=device) for _ in xs]
    tokens = [ag.all_gather(o, x, async_op=True) for o, x in zip(outs, xs)]
    for t in tokens:
        t.wait()
    for o, x in zip(outs, xs):
        ref = torch.empty_like(o)
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(o, ref)
    uid = ag._uid
    assert _leftovers(uid) == [], _leftovers(uid)  # unlinked as soon as everyone attached
    for ag in ags.values():
        ag.close()
    # The seed's names.
    from kvstrata.comm import init_oeccl, oeccl_allgather, oeccl_cleanup, wait_event_on_stream

    init_oeccl(None, False, 4, numa_map, True)
    x = _make_input(rank, 999, torch.bfloat16, device, 7)
    out = torch.empty(world * 999, dtype=torch.bfloat16, device=device)
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, x)
    wait_event_on_stream(None, oeccl_allgather(out, x))
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(out, ref)
    oeccl_cleanup()
    oeccl_cleanup()
    if world >= 3:  # a subgroup: ranks are group ranks, peers global ranks
        sub = dist.new_group([0, world - 1])
        if rank in (0, world - 1):
            ag = HybridAllGather(sub, ratio=2, timeout=10.0)
            x = _make_input(rank, 3001, torch.float16, device, 99)
            out, ref = (
                torch.empty(2 * 3001, dtype=x.dtype, device=device),
                torch.empty(2 * 3001, dtype=x.dtype, device=device),
            )
            dist.all_gather_into_tensor(ref, x, group=sub)
            ag.all_gather(out, x)
            assert torch.equal(out, ref)
            ag.close()
    if bad_input:  # same group: spawning another one costs seconds here
        _bad_input(rank, world, device)
    dist.barrier()
    dist.destroy_process_group()


def _bad_input(rank: int, world: int, device: str) -> None:
    """Bad input on one rank makes every rank raise the same clear error, and nothing breaks."""
    from kvstrata.comm.hybrid import HybridAllGather

    ag = HybridAllGather(ratio=2, timeout=10.0)
    n = 64

    def good():
        return torch.ones(n, device=device), torch.empty(world * n, device=device)

    cases = {
        "inp is not contiguous": lambda: (torch.ones(2 * n, device=device)[::2], good()[1]),
        "out has the wrong number": lambda: (good()[0], torch.empty(world * n + 1, device=device)),
        "size and dtype must match": lambda: (
            torch.ones(n + 1, device=device),
            torch.empty(world * (n + 1), device=device),
        ),
        "out.dtype differs": lambda: (torch.ones(n, dtype=torch.float64, device=device), good()[1]),
        "must match on every rank": lambda: (
            torch.ones(n, dtype=torch.float64, device=device),
            torch.empty(world * n, dtype=torch.float64, device=device),
        ),
        "out is not contiguous": lambda: (good()[0], torch.empty(2 * world * n, device=device)[::2]),
    }
    wrong_device = "cpu" if device == "cuda" else "meta"
    cases["are not on"] = lambda: (torch.ones(n, device=wrong_device), torch.empty(world * n, device=wrong_device))
    for text, make in cases.items():
        inp, out = make() if rank == world - 1 else good()
        with pytest.raises((ValueError, TypeError), match="rank") as info:
            ag.all_gather(out, inp)
        assert text in str(info.value), (text, str(info.value))
    # Ratios that differ across ranks.
    inp, out = good()
    with pytest.raises(ValueError, match="ratio: must match"):
        ag.all_gather(out, inp, ratio=3 if rank == 0 else 5)
    # The group and the instance still work.
    inp, out = good()
    ag.all_gather(out, inp)
    assert torch.equal(out, torch.ones(world * n, device=device))
    with pytest.raises(ValueError, match="ratio"):
        HybridAllGather(ratio=-1)
    with pytest.raises(ValueError, match="numa_map"):
        HybridAllGather(numa_map=[0])
    ag.close()


def _dead_peer(rank: int, world: int, store: str, result_dir: str) -> None:
    from kvstrata.comm.hybrid import HybridAllGather

    _init(rank, world, store, "gloo", timeout=6.0)
    ag = HybridAllGather(ratio=1, timeout=4.0)
    x = torch.full((3000,), float(rank))
    out = torch.empty(world * 3000)
    ag.all_gather(out, x)  # segments exist and are unlinked after this
    Path(result_dir, "uid").write_text(ag._uid)
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        ag.all_gather(out, x)
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(result_dir, f"rank{rank}").write_text(f"{time.monotonic() - t0:.2f}\n{outcome}")
    os._exit(0)  # the group is broken: skip the collective teardown


def _spawn(fn, world: int, tmp_path: Path, *args) -> None:
    store = str(tmp_path / f"store-{fn.__name__}-{world}")
    mp.spawn(_entry, args=(fn, world, store, args), nprocs=world, join=True)


def _entry(rank: int, fn, world: int, store: str, args: tuple) -> None:
    fn(rank, world, store, *args)


@pytest.mark.parametrize(("world", "numa_map"), [(2, None), (3, [0, 1, 0])])
def test_gloo_matches_all_gather_into_tensor(tmp_path: Path, world: int, numa_map) -> None:
    """Every dtype, odd counts, ratios 1/2/3/8/auto, both head legs, sync and async; world 3 spans two
    NUMA nodes (relay). World 2 also checks that bad input raises on every rank."""
    _spawn(_correctness, world, tmp_path, "gloo", numa_map, world == 2)


def test_killed_rank_fails_peers_and_leaves_nothing(tmp_path: Path) -> None:
    """A rank SIGKILLed after the segments exist: the others raise naming it, well within the timeout."""
    world = 3
    store = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    args = (str(tmp_path),)
    procs = [ctx.Process(target=_entry, args=(r, _dead_peer, world, store, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung")
    for r in range(world - 1):
        elapsed, outcome = Path(tmp_path, f"rank{r}").read_text().split("\n", 1)
        assert outcome != "no error"
        assert float(elapsed) < 5.0, (elapsed, outcome)
        assert f"rank {world - 1}" in outcome or "rank(s) [2]" in outcome, outcome
    assert _leftovers(Path(tmp_path, "uid").read_text()) == []


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_matches_all_gather_into_tensor(tmp_path: Path) -> None:
    """The CPU matrix on two GPUs, plus bad input (CPU tensors on the NCCL group among it)."""
    _spawn(_correctness, 2, tmp_path, "nccl", None, True)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_two_numa_nodes_relay(tmp_path: Path) -> None:
    """Force a two-node map on the GPU pair so the cross-node relay runs with CUDA copies."""
    _spawn(_correctness, 2, tmp_path, "nccl", [0, 1], False)


def test_bench_smoke(tmp_path: Path) -> None:
    """The benchmark end to end on two gloo processes: every method runs and gives the right result."""
    import argparse
    import json

    from kvstrata.bench import allgather

    args = argparse.Namespace(smoke=True, quick=False, sizes=None, gpus=None, iters=None, no_load=True, out=tmp_path)
    assert allgather.run(args) == 0
    record = json.loads((tmp_path / "allgather_smoke.json").read_text())
    methods = {r["method"] for r in record["rows"]}
    assert {"nccl", "host", "hybrid r=2", "hybrid r=16", "hybrid auto", "paired"} <= methods
    timed = [r for r in record["rows"] if r["method"] != "paired"]
    assert all(r["correct"] and r["busbw_gbs"] > 0 for r in timed), record["rows"]
    paired = [r for r in record["rows"] if r["method"] == "paired"]
    assert all(r["nccl_ms"] > 0 and r["auto_ms"] > 0 for r in paired), paired
    assert record["environment"]["command"]
