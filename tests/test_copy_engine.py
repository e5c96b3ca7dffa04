"""Copy-engine helpers: run merging, the per-run fallback, and cudaMemcpyBatchAsync on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.errors import KvstrataError
from kvstrata.ops import copy_engine
from kvstrata.ops.copy_engine import CopyEngineError, copy_runs_torch, merge_runs


def test_merge_runs_both_sides_must_continue():
    src = np.array([0, 8, 16, 40, 48, 56])
    dst = np.array([100, 108, 200, 208, 216, 224])
    s, d, n = merge_runs(src, dst, 8)
    assert s.tolist() == [0, 16, 40] and d.tolist() == [100, 200, 208] and n.tolist() == [16, 8, 24]


def test_merge_runs_keys_split_runs():
    s, _, n = merge_runs(np.arange(4) * 4, np.arange(4) * 4 + 64, 4, keys=np.array([0, 0, 1, 1]))
    assert n.tolist() == [8, 8] and s.tolist() == [0, 8]


def test_merge_runs_edge_cases():
    assert merge_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 8)[2].size == 0
    assert merge_runs(np.array([5]), np.array([9]), 3)[2].tolist() == [3]
    # reversed order never merges
    assert merge_runs(np.array([8, 0]), np.array([8, 0]), 8)[2].tolist() == [8, 8]


def test_copy_runs_torch(seeded):
    src = torch.randint(0, 256, (64,), dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    copy_runs_torch(dst, np.array([0, 40]), src, np.array([10, 3]), np.array([5, 7]))
    assert torch.equal(dst[0:5], src[10:15]) and torch.equal(dst[40:47], src[3:10])
    assert not dst[5:40].any() and not dst[47:].any()


def test_error_type_is_kvstrata():
    assert issubclass(CopyEngineError, KvstrataError)


@pytest.mark.gpu
@pytest.mark.parametrize("on_default_stream", [True, False])
@pytest.mark.parametrize("use_batch", [None, False])
def test_gpu_memcpy_batch_scattered(seeded, on_default_stream, use_batch):
    if copy_engine._runtime() is None:
        pytest.skip("cuda-bindings missing")
    dev = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    offs = np.random.default_rng(0).permutation(256)[:100] * 4096
    srcs = dev.data_ptr() + offs
    dsts = host.data_ptr() + np.arange(100) * 4096
    stream = torch.cuda.current_stream() if on_default_stream else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        n = copy_engine.memcpy_batch(dsts, srcs, np.full(100, 4096), use_batch=use_batch)
        torch.cuda.current_stream().synchronize()
    assert n == 100
    expect = dev.view(256, 4096)[torch.from_numpy(offs // 4096).cuda()].cpu().reshape(-1)
    assert torch.equal(host[: 100 * 4096], expect) and not host[100 * 4096 :].any()


class _FailingRuntime:
    """Stands in for cuda-bindings: every call returns a CUDA error code (no real bad copy is issued)."""

    class cudaMemcpyKind:
        cudaMemcpyDefault = 4

    class cudaMemcpySrcAccessOrder:
        cudaMemcpySrcAccessOrderStream = 1

    class cudaMemcpyAttributes:
        srcAccessOrder = None

    @staticmethod
    def cudaMemcpyBatchAsync(*args):
        return (1,)

    @staticmethod
    def cudaMemcpyAsync(*args):
        return (1,)


@pytest.mark.gpu
@pytest.mark.parametrize("use_batch", [True, False])
def test_gpu_cuda_errors_become_copy_engine_errors(monkeypatch, use_batch):
    monkeypatch.setattr(copy_engine, "_runtime", lambda: _FailingRuntime)
    monkeypatch.setattr(copy_engine, "_attrs", [])
    with pytest.raises(CopyEngineError, match="cudaMemcpy"):
        copy_engine.memcpy_batch([1, 2], [3, 4], [8, 8], use_batch=use_batch)


def test_mismatched_lengths(monkeypatch):
    monkeypatch.setattr(copy_engine, "_runtime", lambda: _FailingRuntime)
    with pytest.raises(ValueError, match="lengths"):
        copy_engine.memcpy_batch([1, 2], [3], [8, 8])


@pytest.mark.parametrize("n", [1, 2, 5])
def test_memcpy_raw_turns_cuda_errors_into_copy_engine_errors(monkeypatch, n):
    """The raw path (calls looked up once) still checks every call's result; no GPU needed (stub runtime)."""
    calls = []

    def failing(*args):
        calls.append(args)
        return (1,)

    monkeypatch.setattr(copy_engine, "_raw_calls", lambda: (failing, failing, 4, ["attrs"]))
    with pytest.raises(CopyEngineError, match="cudaMemcpy"):
        copy_engine.memcpy_raw(list(range(n)), list(range(n)), [8] * n, 7)
    assert len(calls) == 1 and calls[0][-1] == 7  # on the stream given, one call for the whole batch
    with pytest.raises(ValueError, match="lengths"):
        copy_engine.memcpy_raw([1, 2], [3], [8, 8], 7)


@pytest.mark.parametrize(("answer", "idle"), [(0, True), (600, False), (1, False)])
def test_stream_idle_only_on_a_successful_query(monkeypatch, answer, idle):
    """cudaSuccess alone means idle: not ready (600) and any failure mean the caller's stream is joined."""
    asked = []
    monkeypatch.setattr(copy_engine, "_query_call", lambda: lambda handle: asked.append(handle) or (answer,))
    assert copy_engine.stream_idle(7) is idle and asked == [7]
    monkeypatch.setattr(copy_engine, "_query_call", lambda: None)  # no cuda-bindings
    assert copy_engine.stream_idle(7) is False
