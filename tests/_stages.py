"""Test helpers for the device calls without a GPU: a GPU call's stages (``kvstrata.client.device.stages``
cuts a call into stages only once it meets a CUDA tensor; tests patch this in to exercise the pipeline), the
one-pass paths' batches, which path served a call, and a GPU faked with CPU tensors (native planner on or off)."""

import ctypes
import types

import pytest
import torch

from kvstrata.client import batching, device, kept_reads
from kvstrata.ops import copy_engine, tensor_runs


def stages_of(n):
    """A ``stages`` replacement that cuts every call into stages of ``n`` keys."""

    def stages(n_keys, tensor_lists, start=0):
        device.check_outer(n_keys, tensor_lists)
        for lo in range(start, n_keys, n):
            checked = [device.check_key(tensor_lists[i], i) for i in range(lo, min(lo + n, n_keys))]
            yield device.Stage(lo, lo + len(checked), [c[0] for c in checked], [c[1] for c in checked], None)

    return stages


class _Landing:
    """A stage's end event whose copies are still landing when the call looks (``query()`` False)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def copies_pending(monkeypatch):
    """Each stage's copies still in flight when the call gets to sealing or committing the stage before
    it, as on a GPU: one seal/commit request per stage (CPU copies have all landed: the call sends one)."""
    monkeypatch.setattr(device, "mark", lambda stream: _Landing())


def batches_of(monkeypatch, n, key_bytes):
    """Batches of ``n`` keys in the one-pass paths (a reserved ``mset_d2h``'s keys, a kept ``mget_h2d``'s), where
    every key's tensors are CPU tensors (no device runs: a batch is then cut by its bytes) of ``key_bytes`` or a
    little more (fewer than ``n`` keys hold less than ``n * key_bytes``)."""
    monkeypatch.setattr(kept_reads, "FIRST_RUNS", n)  # the kept read's first batch
    monkeypatch.setattr(device, "FIRST_BATCH_RUNS", n)  # the write's and the placed read's
    monkeypatch.setattr(device, "BATCH_RUNS", n)
    monkeypatch.setattr(batching, "RUN_BYTES", key_bytes)


def outcomes(monkeypatch, module):
    """What each call of ``module.queue`` (a one-pass path: kvstrata.client.kept_reads, placed_reads) does from
    here on, in a list: True (it served the call), False (it left it to the staged path) or "raised"."""
    took: list[object] = []
    real = module.queue

    def queue(*args, **kwargs):
        try:
            got = real(*args, **kwargs)
        except BaseException:
            took.append("raised")
            raise
        took.append(got is not None)
        return got

    monkeypatch.setattr(module, "queue", queue)
    return took


class _Stream:
    """A copy stream without a GPU: ``device.start``'s result, as the batches see it."""

    cuda_stream, device_index = 1, 0

    def synchronize(self):
        pass


#: the one-pass calls' planners, as the tests switch them: the Python loop, native passes answering their runs (then
#: queued through cuda-bindings), native passes queuing their own copies
PLANNERS = [False, "lists", "copies"]
PLANNER_IDS = ["python", "native-lists", "native-copies"]


def batch_call_type(abi=13000):
    """The driver's cuMemcpyBatchAsync as a ctypes function type, as CUDA 13 declares it (``abi`` 13000) or 12.8
    (12080: a failure index before the stream): the ABI a native pass's copier calls."""
    size_p, u64_p = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint64)
    fail = (size_p,) if abi == 12080 else ()
    return ctypes.CFUNCTYPE(
        ctypes.c_int, u64_p, u64_p, size_p, ctypes.c_size_t, ctypes.c_void_p, size_p, ctypes.c_size_t, *fail,
        ctypes.c_void_p,
    )  # fmt: skip


BATCH_CALL = batch_call_type()


def batch_call(batches, fail_at=None):
    """A stand-in for the driver's batch call, in host memory: memmove of each run, the runs of each call appended
    to ``batches``; the call that would take the run count past ``fail_at`` fails (CUDA_ERROR_INVALID_VALUE, 1) with
    nothing copied. Keep the returned object alive while native passes may call it; its address is the entry point."""

    def call(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):
        if fail_at is not None and sum(batches) + count > fail_at:
            return 1
        batches.append(count)
        for k in range(count):
            ctypes.memmove(dsts[k], srcs[k], sizes[k])
        return 0

    fn = BATCH_CALL(call)
    return fn, ctypes.cast(fn, ctypes.c_void_p).value


def native_planner(monkeypatch, on):
    """The one-pass calls' native passes (a kept read's, a reserved write's) on (``on`` True or "copies": queuing
    their own copies where ``device.native_copies`` lets them, "lists": answering their runs), CPU tensors standing
    in for CUDA ones, or off, whatever this machine has; with them on, the list of each native pass's (first key, why
    it stopped)."""
    passes: list[tuple[int, int]] = []
    if not on:
        monkeypatch.setattr(batching, "planner", lambda: None)
        return passes
    if tensor_runs.native(wait=True) is None:
        pytest.fail("the native module did not build (see the log's warning)")

    def recorded(fn, lo_arg):
        def call(*args, **kwargs):
            got = fn(*args, **kwargs)
            passes.append((args[lo_arg], got[1]))
            return got

        return call

    names = {name: getattr(tensor_runs, name) for name in ("native", "DONE", "CUT", "PYTHON_PATH", "NO_BASE", "FULL")}
    planner = types.SimpleNamespace(
        plan=recorded(tensor_runs.plan, 3),
        plan_copy=recorded(tensor_runs.plan_copy, 3),
        lay_out=recorded(tensor_runs.lay_out, 1),
        lay_out_copy=recorded(tensor_runs.lay_out_copy, 1),
        **names,
    )
    monkeypatch.setattr(batching, "NATIVE_CUDA", False)
    monkeypatch.setattr(batching, "NATIVE_COPIES", on != "lists")
    monkeypatch.setattr(batching, "planner", lambda: planner)
    return passes


class Batches(list):
    """The runs of each batch call, in order; ``bindings``: how many went through cuda-bindings (the others were the
    native passes' own calls)."""

    bindings = 0


def fake_gpu(monkeypatch, native):
    """Without a GPU: CPU tensors taken as CUDA ones, the copy engine's batches done by memmove (through cuda-bindings'
    stand-in or the driver's, as the planner calls them), the one-pass calls' planner as :data:`PLANNERS` names it.
    Returns the batches' sizes in runs, the segments registered and the native passes."""
    real_check = device.check_key
    cuda = torch.device("cuda", 0)

    def check_key(ts, i):  # the pieces as CUDA ones (a device run per key: no two tensors continue each other)
        pieces, total, _ = real_check(ts, i)
        return [(*p[:2], True, p[3], p[0]) for p in pieces], total, cuda

    batches = Batches()

    def memcpy_raw(dsts, srcs, sizes, handle):
        batches.bindings += 1
        batches.append(len(sizes))
        for d, s, z in zip(dsts, srcs, sizes):
            ctypes.memmove(d, s, z)

    fn, address = batch_call(batches)

    def native_copies(tensor_lists, i, stream=None):
        try:
            t = tensor_lists[i][0]
        except (IndexError, KeyError, TypeError):
            return None
        if type(t) is not torch.Tensor:
            return None
        native_copies.fn = fn  # alive while the test's passes may call it
        return cuda, _Stream(), (address, 13000, _Stream.cuda_stream)

    monkeypatch.setattr(device, "check_key", check_key)
    monkeypatch.setattr(device, "start", lambda dev, stream=None: _Stream())
    monkeypatch.setattr(device, "native_copies", native_copies)
    monkeypatch.setattr(device, "mark", lambda stream: None)
    monkeypatch.setattr(copy_engine, "memcpy_raw", memcpy_raw)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    registered: list[int] = []
    monkeypatch.setattr(device, "register_segment", lambda addr, nbytes: registered.append(addr) or False)
    return batches, registered, native_planner(monkeypatch, native)


_QUERY_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_RECORD_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)


def stream_calls(log, query=0, record=0, wait=0):
    """ctypes stand-ins for cuStreamQuery, cuEventRecord and cuStreamWaitEvent that log their calls and answer the
    given errors (600: not ready); the callables, kept alive, and their addresses."""
    fns = (
        _QUERY_CALL(lambda s: log.append(("query", s)) or query),
        _RECORD_CALL(lambda e, s: log.append(("record", e, s)) or record),
        _WAIT_CALL(lambda s, e, f: log.append(("wait", s, e, f)) or wait),
    )
    return fns, tuple(ctypes.cast(f, ctypes.c_void_p).value for f in fns)
