"""The native copy planner (kvstrata.ops.tensor_runs) against the Python reference it replaces on a device call's
hot path (kvstrata.client.device.check_key + plan): the same runs, merges, cuts and stops, over keys of one and
many tensors, views of one tensor, zero-byte tensors, size mismatches, several segments and bad tensors. CPU
tensors stand in for CUDA ones (``cuda=False``); the GPU test runs the CUDA kind."""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from _stages import batch_call_type, stream_calls
from kvstrata.client import device
from kvstrata.client._shared import Loc
from kvstrata.ops import tensor_runs
from kvstrata.ops.tensor_runs import CUT, DONE, FULL, NO_BASE, PYTHON_PATH


@pytest.fixture(scope="module")
def native():
    if os.environ.get("KVSTRATA_NATIVE") == "0":
        pytest.skip("KVSTRATA_NATIVE=0")
    module = tensor_runs.native(wait=True)
    assert module is not None, "the native module did not build (see the log's warning)"
    return module


def reference(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, to_host=False):
    """What the Python path does for keys lo..hi-1, as tensor_runs.plan answers it (every tensor taken as the
    wanted kind; a bad tensor stops the pass before its key, as the native pass leaves it to that path)."""
    runs = device.new_runs()
    mismatched, pending = [], 0
    for i in range(lo, hi):
        if locs[i] is None:  # no place yet: passed over, its tensors unchecked
            continue
        try:
            pieces, total, _ = device.check_key(tensor_lists[i], i)
        except (TypeError, ValueError):
            return i, PYTHON_PATH, runs, mismatched
        pieces = [(p[0], p[1], True, p[3], p[3].untyped_storage().data_ptr()) for p in pieces]  # as CUDA ones
        seg, offset, size = locs[i][:3]
        if total != size:
            mismatched.append(i)
            continue
        if seg not in bases:
            return i, NO_BASE, runs, mismatched
        device.plan(pieces, bases[seg] + offset, to_host, runs, seg)
        pending += total
        if len(runs.device) >= max_runs or pending >= max_bytes:
            return i + 1, CUT if i + 1 < hi else DONE, runs, mismatched
    return hi, DONE, runs, mismatched


def check_same(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, to_host=False):
    stop, why, dsts, srcs, sizes, mismatched, index = tensor_runs.plan(
        tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, to_host=to_host, cuda=False
    )
    r_stop, r_why, runs, r_mismatched = reference(tensor_lists, locs, bases, lo, hi, max_runs, max_bytes, to_host)
    assert (stop, why, mismatched) == (r_stop, r_why, r_mismatched)
    assert list(zip(dsts, srcs, sizes)) == [r[:3] for r in runs.device]
    assert index == -1  # CPU tensors name no device
    return stop, why, sizes


def _keys(n, shapes, seed, *, one_tensor=False, dtype=torch.float32):
    """n keys of tensors of ``shapes``; ``one_tensor``: views of one tensor each, back to back (they merge)."""
    g = torch.Generator().manual_seed(seed)
    lists = []
    for _ in range(n):
        if one_tensor:
            whole = torch.randn(sum(shapes), generator=g).to(dtype)
            parts, at = [], 0
            for s in shapes:
                parts.append(whole[at : at + s])
                at += s
            lists.append(parts)
        else:
            lists.append([torch.randn(s, generator=g).to(dtype) for s in shapes])
    return lists


def _locs(tensor_lists, segments=(0,), gap=0):
    """Objects laid out back to back in each segment in turn, ``gap`` bytes apart."""
    locs, heads = [], dict.fromkeys(segments, 0)
    for i, ts in enumerate(tensor_lists):
        seg = segments[i % len(segments)]
        total = sum(t.nbytes for t in ts)
        locs.append(Loc(seg, heads[seg], total))
        heads[seg] += total + gap
    return locs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("shapes", [(256,), (64, 0, 128), (7, 13, 1, 100)])
@pytest.mark.parametrize("one_tensor", [False, True])
@pytest.mark.parametrize("to_host", [False, True])
def test_native_runs_match_the_python_plan(native, dtype, shapes, one_tensor, to_host):
    lists = _keys(12, shapes, seed=len(shapes), one_tensor=one_tensor, dtype=dtype)
    for segments, gap in (((0,), 0), ((0,), 64), ((3, 5), 0)):
        locs = _locs(lists, segments, gap)
        bases = {seg: (seg + 1) << 30 for seg in segments}
        for max_runs, max_bytes in ((16, 1 << 30), (3, 1 << 30), (64, 1000), (1, 1)):
            lo = 0
            while lo < len(lists):
                stop, why, _ = check_same(lists, locs, bases, lo, len(lists), max_runs, max_bytes, to_host)
                assert why in (CUT, DONE) and stop > lo
                lo = stop


def test_views_of_one_tensor_laid_side_by_side_merge_into_one_run(native):
    whole = torch.arange(64, dtype=torch.int64)
    lists = [[whole[i * 8 : (i + 1) * 8]] for i in range(8)]
    locs = _locs(lists)
    stop, why, sizes = check_same(lists, locs, {0: 1 << 20}, 0, 8, 16, 1 << 30)
    assert (stop, why, sizes) == (8, DONE, [whole.nbytes])
    # two segments: the runs never cross from one to the other, however adjacent their addresses
    locs = [Loc(i // 4, (i % 4) * 64, 64) for i in range(8)]
    _, _, sizes = check_same(lists, locs, {0: 1 << 20, 1: (1 << 20) + 256}, 0, 8, 16, 1 << 30)
    assert sizes == [256, 256]


def test_keys_with_no_place_are_passed_over_and_placement_hints_serve_as_places(native):
    lists = _keys(8, (32, 16), seed=4)
    locs = [(*loc, 7) for loc in _locs(lists)]  # (segment, offset, size, placement), as the placement table has them
    for k in (0, 3, 4, 7):
        locs[k] = None
    lists[4] = [torch.zeros(4, 4).t()]  # not checked: its key has no place
    for max_runs in (16, 3, 1):
        lo = 0
        while lo < 8:
            stop, why, sizes = check_same(lists, locs, {0: 4096}, lo, 8, max_runs, 1 << 30)
            assert stop > lo
            lo = stop
    stop, why, _, _, sizes, mismatched, _ = tensor_runs.plan(lists, locs, {0: 4096}, 0, 8, 64, 1 << 30, cuda=False)
    assert (stop, why, mismatched, len(sizes)) == (8, DONE, [], 8)  # two runs for each of four keys


def test_a_size_mismatch_is_reported_and_planned_no_run(native):
    lists = _keys(5, (32,), seed=1)
    locs = _locs(lists)
    locs[2] = Loc(0, locs[2].offset, 999)
    stop, why, _, _, sizes, mismatched, _ = tensor_runs.plan(lists, locs, {0: 4096}, 0, 5, 16, 1 << 30, cuda=False)
    assert (stop, why, mismatched, len(sizes)) == (5, DONE, [2], 4)
    check_same(lists, locs, {0: 4096}, 0, 5, 16, 1 << 30)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: torch.zeros(4, 4).t(),  # not contiguous
        lambda: "not a tensor",
        lambda: torch.zeros(3).to_sparse(),
        lambda: torch.zeros(2, device="meta"),
    ],
)
def test_a_bad_tensor_stops_the_pass_before_its_key_for_the_python_path_to_name(native, bad):
    lists = _keys(6, (16, 16), seed=2)
    locs = _locs(lists)
    lists[3] = [lists[3][0], bad()]
    stop, why, sizes = check_same(lists, locs, {0: 4096}, 0, 6, 64, 1 << 30)
    assert (stop, why, len(sizes)) == (3, PYTHON_PATH, 6)  # keys 0-2 planned: two tensors (two storages) each
    with pytest.raises((TypeError, ValueError), match=r"tensor_lists\[3\]\[1\]"):
        device.check_key(lists[3], 3)


class _NoData(torch.Tensor):
    """A tensor subclass with no data, whose every operation raises (torch calls into Python for them)."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=torch.float32, dispatch_sizes_strides_policy="strides"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_NoData has no {func}")


def test_a_tensor_subclass_stops_the_pass_for_the_python_path_to_take(native):
    lists = _keys(4, (16,), seed=9)
    lists[2] = [_NoData((4,))]
    for _ in range(3):  # and again: no Python error left set behind the answer (its attributes are never asked)
        assert tensor_runs.plan(lists, _locs(lists), {0: 4096}, 0, 4, 16, 1 << 30, cuda=False)[:2] == (2, PYTHON_PATH)
        assert tensor_runs.lay_out(lists, 0, 4, 4096, 0, 1 << 20, 63, 16, 1 << 30, cuda=False)[:2] == (2, PYTHON_PATH)
    with pytest.raises(NotImplementedError, match="is_contiguous"):  # what the Python path then raises, as before
        device.check_key(lists[2], 2)
    lists[2] = [torch.nn.Parameter(torch.zeros(4), requires_grad=False)]  # a Parameter is a plain tensor here
    assert tensor_runs.plan(lists, _locs(lists), {0: 4096}, 0, 4, 16, 1 << 30, cuda=False)[:2] == (4, DONE)


def test_the_wrong_kind_of_tensor_and_a_non_list_stop_the_pass(native):
    lists = _keys(4, (16,), seed=3)
    locs = _locs(lists)
    # CUDA wanted, CPU met: the Python path (host runs) takes it from the first key
    assert tensor_runs.plan(lists, locs, {0: 4096}, 0, 4, 16, 1 << 30)[:2] == (0, PYTHON_PATH)
    lists[1] = lists[1][0]  # a tensor, not a list of tensors
    assert tensor_runs.plan(lists, locs, {0: 4096}, 0, 4, 16, 1 << 30, cuda=False)[:2] == (1, PYTHON_PATH)
    lists[1] = tuple(_keys(1, (16,), seed=4)[0])  # a tuple is a list of tensors too
    assert tensor_runs.plan(lists, locs, {0: 4096}, 0, 4, 16, 1 << 30, cuda=False)[:2] == (4, DONE)


def test_a_segment_without_an_address_stops_the_pass_at_its_first_key(native):
    lists = _keys(6, (16,), seed=5)
    locs = _locs(lists, segments=(0, 1))
    stop, why, *_ = check_same(lists, locs, {0: 4096}, 0, 6, 16, 1 << 30)
    assert (stop, why) == (1, NO_BASE)
    stop, why, _ = check_same(lists, locs, {0: 4096, 1: 1 << 20}, 1, 6, 16, 1 << 30)
    assert (stop, why) == (6, DONE)


def test_bad_arguments_raise_a_clear_error_and_plan_nothing(native):
    lists = _keys(2, (16,), seed=6)
    locs = _locs(lists)
    with pytest.raises(IndexError, match="out of bounds"):
        tensor_runs.plan(lists, locs, {0: 4096}, 0, 3, 16, 1 << 30, cuda=False)
    with pytest.raises(TypeError, match="bases a dict"):
        tensor_runs.plan(lists, locs, [4096], 0, 2, 16, 1 << 30, cuda=False)
    with pytest.raises(TypeError, match="list or tuple"):
        tensor_runs.plan(iter(lists), locs, {0: 4096}, 0, 2, 16, 1 << 30, cuda=False)
    with pytest.raises(TypeError):
        tensor_runs.plan(lists, [(0, "x", 64), (0, 64, 64)], {0: 4096}, 0, 2, 16, 1 << 30, cuda=False)


def test_random_calls_match_the_python_plan(native):
    rng = random.Random(7)
    for trial in range(40):
        n = rng.randint(1, 20)
        lists = [
            [torch.empty(rng.choice([0, 1, 5, 64, 300]), dtype=torch.uint8) for _ in range(rng.randint(0, 4))]
            for _ in range(n)
        ]
        locs = _locs(lists, segments=tuple(range(rng.randint(1, 3))), gap=rng.choice([0, 8]))
        for i in rng.sample(range(n), k=min(n, 2)):
            if rng.random() < 0.3:
                locs[i] = Loc(locs[i].segment, locs[i].offset, locs[i].size + 1)
        bases = {seg: (seg + 1) << 24 for seg in {loc.segment for loc in locs}}
        lo = 0
        while lo < n:
            stop, why, _ = check_same(lists, locs, bases, lo, n, rng.randint(1, 6), rng.randint(1, 2000))
            assert stop > lo or why == DONE, trial
            lo = stop


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_are_planned_and_a_second_device_or_cpu_tensor_stops_the_pass(native):
    lists = [[torch.empty(256, device="cuda"), torch.empty(8, device="cuda")] for _ in range(4)]
    locs = _locs(lists)
    stop, why, dsts, srcs, sizes, mismatched, index = tensor_runs.plan(lists, locs, {0: 1 << 30}, 0, 4, 64, 1 << 40)
    assert srcs == [(1 << 30) + sum(sizes[:k]) for k in range(len(sizes))]  # the objects back to back
    assert (stop, why, mismatched, index) == (4, DONE, [], torch.cuda.current_device())
    assert dsts == [t.data_ptr() for ts in lists for t in ts]
    assert sizes == [t.nbytes for ts in lists for t in ts]
    lists[2] = [torch.empty(256), torch.empty(8)]
    assert tensor_runs.plan(lists, locs, {0: 1 << 30}, 0, 4, 64, 1 << 40)[:2] == (2, PYTHON_PATH)
    if torch.cuda.device_count() > 1:
        lists[2] = [torch.empty(256, device="cuda:1"), torch.empty(8, device="cuda:1")]
        assert tensor_runs.plan(lists, locs, {0: 1 << 30}, 0, 4, 64, 1 << 40)[:2] == (2, PYTHON_PATH)


def reference_lay_out(tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, segment=0):
    """What mset_d2h's Python loop does for keys lo..hi-1 in its reservation, as tensor_runs.lay_out answers it."""
    runs = device.new_runs()
    totals, offsets, pending = [], [], 0
    for i in range(lo, hi):
        try:
            pieces, total, _ = device.check_key(tensor_lists[i], i)
        except (TypeError, ValueError):
            return i, PYTHON_PATH, runs, totals, offsets, head
        pieces = [(p[0], p[1], True, p[3], p[3].untyped_storage().data_ptr()) for p in pieces]
        room = (total + mask) & ~mask
        if head + room > end:
            return i, FULL, runs, totals, offsets, head
        device.plan(pieces, base + head, True, runs, segment)
        totals.append(total)
        offsets.append(head)
        head += room
        pending += total
        if len(runs.device) >= max_runs or pending >= max_bytes:
            return i + 1, CUT if i + 1 < hi else DONE, runs, totals, offsets, head
    return hi, DONE, runs, totals, offsets, head


def check_same_lay_out(tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes):
    got = tensor_runs.lay_out(tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes, cuda=False)
    stop, why, dsts, srcs, sizes, totals, offsets, index, new_head = got
    r_stop, r_why, runs, r_totals, r_offsets, r_head = reference_lay_out(
        tensor_lists, lo, hi, base, head, end, mask, max_runs, max_bytes
    )
    assert (stop, why, totals, offsets, new_head) == (r_stop, r_why, r_totals, r_offsets, r_head)
    assert list(zip(dsts, srcs, sizes)) == [r[:3] for r in runs.device]
    assert index == -1
    return stop, why, new_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
@pytest.mark.parametrize("shapes", [(256,), (64, 0, 128), (7, 13, 1, 100)])
@pytest.mark.parametrize("one_tensor", [False, True])
@pytest.mark.parametrize("mask", [0, 63, 4095])
def test_native_lay_out_matches_the_python_loop(native, dtype, shapes, one_tensor, mask):
    lists = _keys(12, shapes, seed=len(shapes) + mask, one_tensor=one_tensor, dtype=dtype)
    total = sum(t.nbytes for ts in lists for t in ts)
    for end in (1 << 30, total // 2 + 64, 0):  # room for all, for about half, for none
        for max_runs, max_bytes in ((16, 1 << 30), (3, 1 << 30), (64, 1000), (1, 1)):
            lo, head = 0, 4096
            while lo < len(lists):
                stop, why, head = check_same_lay_out(
                    lists, lo, len(lists), 1 << 32, head, end, mask, max_runs, max_bytes
                )
                if why == FULL:
                    break
                assert why in (CUT, DONE) and stop > lo
                lo = stop


def test_lay_out_stops_at_a_bad_tensor_and_refuses_a_bad_mask(native):
    lists = _keys(5, (16,), seed=8)
    lists[3] = [torch.zeros(4, 4).t()]
    stop, why, head = check_same_lay_out(lists, 0, 5, 1 << 32, 0, 1 << 20, 63, 64, 1 << 30)
    assert (stop, why, head) == (3, PYTHON_PATH, 3 * 64)
    with pytest.raises(ValueError, match="power of two"):
        tensor_runs.lay_out(lists, 0, 5, 1 << 32, 0, 1 << 20, 48, 64, 1 << 30, cuda=False)
    with pytest.raises(IndexError, match="out of bounds"):
        tensor_runs.lay_out(lists, 0, 6, 1 << 32, 0, 1 << 20, 63, 64, 1 << 30, cuda=False)


def _native_cli(tmp_path, **env):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli.main", "native"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "KVSTRATA_NATIVE_DIR": str(tmp_path / "native"), **env},
    )


@pytest.mark.slow
def test_the_native_command_builds_the_planner_or_says_why_not(tmp_path, native):
    off = _native_cli(tmp_path, KVSTRATA_NATIVE="0")
    assert off.returncode == 1 and "turned off (KVSTRATA_NATIVE=0)" in off.stderr
    broken = _native_cli(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert broken.returncode == 1 and "not built" in broken.stderr and "Python" in broken.stderr
    built = _native_cli(tmp_path)
    assert built.returncode == 0 and "ready" in built.stdout and str(tmp_path / "native") in built.stdout
    (library,) = (tmp_path / "native").glob("*/kvstrata_tensor_runs.so")
    mtime = library.stat().st_mtime_ns
    again = _native_cli(tmp_path)  # loaded from the folder this time: not built again
    assert again.returncode == 0 and str(library) in again.stdout and library.stat().st_mtime_ns == mtime


def test_a_build_killed_midway_leaves_no_lock_that_blocks_the_next_and_builders_take_turns(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("KVSTRATA_NATIVE_DIR", str(tmp_path))
    folder = tensor_runs.cache_dir()
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # what torch's builder leaves behind when its process is killed mid-build
    built, finished = [], []

    def load(name, sources, *, build_directory, **kwargs):
        built.append((Path(build_directory) / "lock").exists())
        return "the module"

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(tensor_runs, "_finish", lambda module, state, error="": finished.append((module, state)))
    monkeypatch.setattr(tensor_runs, "_load_cached", lambda: False)
    tensor_runs._build()  # (torch's own builder would wait for that lock file forever)
    assert built == [False] and finished == [("the module", "ready")]

    # A second builder waits while another process holds the build lock, then loads what that one built.
    holder = open(folder / "kvstrata-build.lock", "w")  # noqa: SIM115  (released below, mid-test)
    fcntl.flock(holder, fcntl.LOCK_EX)
    monkeypatch.setattr(tensor_runs, "_load_cached", lambda: finished.append(("cached", "ready")) or True)
    waiter = threading.Thread(target=tensor_runs._build)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and len(finished) == 1  # waiting its turn
    holder.close()  # the lock goes with its holder (as it would with a killed process)
    waiter.join(10)
    assert not waiter.is_alive() and finished[1:] == [("cached", "ready")] and built == [False]


def _driver(abi, fail_call=None):
    """A stand-in for the driver's batch call of ``abi``: each call's (dst, src, size) runs recorded and copied by
    memmove, its stream and attributes checked; call number ``fail_call`` (from 0) fails with nothing copied."""
    calls = []

    def call(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, *rest):
        stream = rest[-1]
        assert stream == 0x5EED and num_attrs == 1 and attr_idxs[0] == 0
        assert ctypes.cast(attrs, ctypes.POINTER(ctypes.c_int))[0] == 1  # in stream order
        if abi == 12080:
            rest[0][0] = 0  # the failure index, unused
        if len(calls) == fail_call:
            return 1
        calls.append([(dsts[k], srcs[k], sizes[k]) for k in range(count)])
        for k in range(count):
            ctypes.memmove(dsts[k], srcs[k], sizes[k])
        return 0

    fn = batch_call_type(abi)(call)
    return calls, fn, ctypes.cast(fn, ctypes.c_void_p).value


@pytest.mark.parametrize("abi", [13000, 12080])
@pytest.mark.parametrize("head, chunk", [(3, 64), (1, 2), (64, 64)])
def test_plan_copy_queues_the_runs_plan_answers_and_the_bytes_land(native, abi, head, chunk):
    host = torch.arange(1 << 14, dtype=torch.int32)  # the "segment": objects back to back
    lists = [[torch.zeros(s, dtype=torch.int32) for s in shapes] for shapes in [(64, 0, 128)] * 6 + [(256,)] * 6]
    locs = _locs(lists, (0, 1), gap=64)
    bases = {0: host.data_ptr(), 1: host.data_ptr() + 8192}
    calls, _alive, address = _driver(abi)
    lo = 0
    while lo < len(lists):
        planned = tensor_runs.plan(lists, locs, bases, lo, len(lists), 5, 1 << 30, cuda=False)
        del calls[:]
        got = tensor_runs.plan_copy(lists, locs, bases, lo, len(lists), 5, 1 << 30, (address, abi, 0x5EED, head, chunk),
                                    cuda=False)  # fmt: skip
        stop, why, runs, err, mismatched, index = got
        assert (stop, why, mismatched, index, err) == (*planned[:2], planned[5], planned[6], 0)
        assert [run for call in calls for run in call] == list(zip(*planned[2:5]))
        assert runs == len(planned[4]) and [len(c) for c in calls][:1] == [min(head, runs)][: bool(runs)]
        assert all(len(c) <= chunk for c in calls[1:])
        lo = stop
    for ts, loc in zip(lists, locs):  # every object's bytes landed in its tensors
        at = bases[loc.segment] + loc.offset - host.data_ptr()
        assert torch.equal(torch.cat(ts).view(torch.uint8), host.view(torch.uint8)[at : at + loc.size])


def test_lay_out_copy_queues_the_runs_lay_out_answers_and_a_driver_error_says_how_far_it_got(native):
    lists = _keys(10, (64, 0, 128), seed=5)
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    base = host.data_ptr()
    calls, _alive, address = _driver(13000)
    planned = tensor_runs.lay_out(lists, 0, 10, base, 0, 1 << 16, 63, 64, 1 << 30, cuda=False)
    stop, why, runs, err, totals, offsets, index, head = tensor_runs.lay_out_copy(
        lists, 0, 10, base, 0, 1 << 16, 63, 64, 1 << 30, (address, 13000, 0x5EED, 3, 4), cuda=False
    )
    assert (stop, why, totals, offsets, index, head, err) == (*planned[:2], *planned[5:], 0)
    assert [run for call in calls for run in call] == list(zip(*planned[2:5]))
    assert [len(c) for c in calls] == [3, 4, 4, 4, 4, 1] and runs == 20
    for ts, offset in zip(lists, offsets):
        assert bytes(host[offset : offset + sum(t.nbytes for t in ts)].numpy()) == b"".join(
            t.numpy().tobytes() for t in ts
        )
    # the driver refuses the third call: the runs of the first two were queued, and that is what the answer says
    calls, _alive, address = _driver(13000, fail_call=2)
    got = tensor_runs.lay_out_copy(lists, 0, 10, base, 0, 1 << 16, 63, 64, 1 << 30, (address, 13000, 0x5EED, 3, 4),
                                   cuda=False)  # fmt: skip
    assert got[:4] == (10, DONE, 7, 1) and [len(c) for c in calls] == [3, 4]


def test_plan_copy_refuses_a_bad_copier(native):
    lists = _keys(2, (16,), seed=2)
    locs = _locs(lists)
    _, _alive, address = _driver(13000)
    for copier, exc, match in [
        ((address, 13000, 0x5EED, 3), TypeError, "copier: must be a tuple"),
        ([address, 13000, 0x5EED, 3, 4], TypeError, "copier: must be a tuple"),
        ((0, 13000, 0x5EED, 3, 4), ValueError, "null entry point"),
        ((address, 12000, 0x5EED, 3, 4), ValueError, "abi"),
        ((address, 13000, 0x5EED, 0, 4), ValueError, "head or chunk"),
        ((address, 13000, "stream", 3, 4), TypeError, "integer"),
    ]:
        with pytest.raises(exc, match=match):
            tensor_runs.plan_copy(lists, locs, {0: 4096}, 0, 2, 16, 1 << 30, copier, cuda=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("thread", ["main", "fresh"])
def test_the_drivers_batch_call_queues_a_pass_both_ways_on_a_stream_of_ours(native, thread):
    import threading

    entry = tensor_runs.batch_entry()
    assert entry is not None and entry[1] in (12080, 13000)
    g = torch.Generator().manual_seed(11)
    host = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, generator=g).pin_memory()
    back = torch.zeros_like(host).pin_memory()
    lists = [[torch.empty(s, dtype=torch.uint8, device="cuda") for s in (4096, 0, 300)] for _ in range(50)]
    locs = _locs(lists, gap=64)
    index = torch.cuda.current_device()
    out = []

    def run():
        stream = torch.cuda.Stream()  # in a fresh thread, from torch's pool: no context made current by it
        copier = tensor_runs.copier(stream.cuda_stream, 3, 16)
        if thread == "fresh":
            # the driver refuses a batch with no context current, and the pass says so: nothing queued
            refused = tensor_runs.plan_copy(lists, locs, {0: host.data_ptr()}, 0, 50, 1000, 1 << 40, copier)
            out.append(refused[2:4])
            assert device._bind_context(index)  # what native_copies does once per thread and device
        got = tensor_runs.plan_copy(lists, locs, {0: host.data_ptr()}, 0, 50, 1000, 1 << 40, copier)
        laid = tensor_runs.lay_out_copy(lists, 0, 50, back.data_ptr(), 0, back.numel(), 63, 1000, 1 << 40, copier)
        stream.synchronize()
        out.append((got, laid))

    if thread == "main":
        run()
    else:
        t = threading.Thread(target=run)
        t.start()
        t.join()
        refused = out.pop(0)  # (torch 2.11's pool streams bind no context: refused, as the GPU machine showed)
        assert (refused[0] == 0 and refused[1] != 0) or refused == (100, 0)
    (got, laid) = out[0]
    assert got[:4] == (50, DONE, 100, 0) and laid[:4] == (50, DONE, 100, 0)
    for ts, loc, offset in zip(lists, locs, laid[5]):
        want = host[loc.offset : loc.offset + loc.size]
        assert torch.equal(torch.cat(ts).cpu(), want)  # host -> device
        assert torch.equal(back[offset : offset + loc.size], want)  # and back, laid out as the reservation's


def test_native_hints_read_the_placement_table_as_lookup_does(native):
    import types

    from kvstrata.store.placements import PlacementHints, PlacementTable
    from kvstrata.store.tiers.base import Location

    table = PlacementTable()
    try:
        hints = PlacementHints(table.segment)
        keys = [f"layer/{i}/block" for i in range(300)] + ["ünïcode/ключ", "x" * 900, "", "gone"]
        entries = [
            types.SimpleNamespace(key=k, loc=Location(i % 3, 4096 * i, 1000 + i), mutable=False, placed=i)
            for i, k in enumerate(keys[:-1])
        ]
        table.publish(entries)  # placement 0 for the first key: in the table, never usable
        python = hints.lookup(tuple(keys))  # a tuple: the Python lookup
        assert python[-1] is None and python[1] == (1, 4096, 1001, 1)
        assert tensor_runs.hints(hints._words, keys, 0, len(keys)) == python
        assert hints.lookup(keys) == python  # a list, the module loaded: the native lookup
        assert tensor_runs.hints(hints._words, keys, 10, 20) == python[10:20]
        limits = {0: 1 << 40, 1: 4096 * 150}  # segment 2 not mapped; segment 1 ends at key 149's bytes
        usable = [h if h is not None and h[3] > 0 and h[1] + h[2] <= limits.get(h[0], -1) else None for h in python]
        assert tensor_runs.hints(hints._words, keys, 0, len(keys), limits) == usable
        assert usable[0] is None and usable[2] is None and usable[3] and usable[148] and usable[151] is None
        assert tensor_runs.hints(hints._words, [b"bytes", 5, keys[3]], 0, 3) == [None, None, python[3]]
        with pytest.raises(ValueError, match="power of two"):
            tensor_runs.hints(bytearray(96), keys, 0, 1)
        with pytest.raises(IndexError, match="out of bounds"):
            tensor_runs.hints(hints._words, keys, 0, len(keys) + 1)
        with pytest.raises(TypeError, match="limits a dict or None"):
            tensor_runs.hints(hints._words, keys, 0, 1, [1])
    finally:
        table.close()


def test_current_prefix_checks_entries_against_their_counters_as_the_python_lookup_does(native):
    slots = (ctypes.c_uint64 * 8)(*range(8))
    address = ctypes.addressof(slots)
    gen = 1 << 40  # past the small ints' cache: compared by value
    entries = {
        "seen now": [1, ("loc", 1), 0, 999, gen],  # counter not looked at: seen at this generation
        "counted": [2, ("loc", 2), 3, 3, gen - 1],  # its slot still shows its count: current, seen now
        "moved on": [3, ("loc", 3), 4, 3, gen - 1],  # its slot moved: stale
        "slot out of range": [4, ("loc", 4), 8, 8, gen - 1],
    }
    args = (address, 8)
    assert tensor_runs.current_prefix(entries, ["seen now", "counted", "moved on"], gen, *args) == [
        ("loc", 1),
        ("loc", 2),
    ]
    assert entries["counted"][4] == gen and entries["moved on"][4] == gen - 1
    assert tensor_runs.current_prefix(entries, ["counted", "absent", "seen now"], gen, *args) == [("loc", 2)]
    assert tensor_runs.current_prefix(entries, ["slot out of range"], gen, *args) == []
    assert tensor_runs.current_prefix(entries, [b"seen now", "counted"], gen, *args) == []  # not a str: stops
    assert tensor_runs.current_prefix({}, ["counted"], gen, *args) == []
    assert tensor_runs.current_prefix(entries, [], gen, *args) == []
    slots[3] += 1  # a write to a key of slot 3 ... and a later generation: stale
    assert tensor_runs.current_prefix(entries, ["counted"], gen + 1, *args) == []
    assert entries["counted"][4] == gen  # left as it was
    with pytest.raises(TypeError, match="entries must be a dict"):
        tensor_runs.current_prefix(entries, ("counted",), gen, *args)
    with pytest.raises(ValueError, match="null slots"):
        tensor_runs.current_prefix(entries, ["counted"], gen, 0, 8)
    with pytest.raises(OverflowError):
        tensor_runs.current_prefix(entries, ["counted"], -1, *args)


@pytest.mark.parametrize(
    "query, record, wait, event, skip_idle, state, err, calls",
    [
        (0, 0, 0, 7, True, tensor_runs.IDLE, 0, ["query"]),  # nothing pending: no wait
        (600, 0, 0, 7, True, tensor_runs.JOINED, 0, ["query", "record", "wait"]),
        (600, 0, 0, 0, True, tensor_runs.NEEDS_EVENT, 0, ["query"]),  # no event yet: the caller makes one
        (0, 0, 0, 7, False, tensor_runs.JOINED, 0, ["record", "wait"]),  # always joins
        (700, 0, 0, 7, True, tensor_runs.IDLE, 700, ["query"]),  # the query's error, nothing queued
        (600, 400, 0, 7, True, tensor_runs.JOINED, 400, ["query", "record"]),
        (600, 0, 201, 7, True, tensor_runs.JOINED, 201, ["query", "record", "wait"]),
    ],
)
def test_join_waits_for_the_callers_stream_only_where_it_has_work_pending(
    native, query, record, wait, event, skip_idle, state, err, calls
):
    log = []
    _alive, addresses = stream_calls(log, query, record, wait)  # the stand-ins live while the addresses are used
    assert tensor_runs.join(addresses, 11, 22, event, skip_idle) == (state, err)
    assert [c[0] for c in log] == calls
    expected = {"query": ("query", 11), "record": ("record", 7, 11), "wait": ("wait", 22, 7, 0)}
    assert log == [expected[c] for c in calls]
    with pytest.raises(ValueError, match="null entry point"):
        tensor_runs.join((addresses[0], 0, addresses[2]), 11, 22, event)
    with pytest.raises(TypeError, match="calls must be a tuple"):
        tensor_runs.join(list(addresses), 11, 22, event)
