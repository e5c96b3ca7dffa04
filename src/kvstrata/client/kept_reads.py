"""``mget_h2d`` of keys whose leases this client kept: in one pass, no stages.

A repeated read of unchanged keys (a KV-cache prefix reloaded, weights paged back in) needs no round trip: the
local-read cache (:mod:`kvstrata.client.local_reads`) holds each key's lease and location. The staged path
(:meth:`~kvstrata.client.device_calls.DeviceCallsMixin.mget_h2d`) exists to overlap the worker's answers with
the copies; with no answer to wait for, its per-stage and per-key machinery (lease objects, stage lists, a plan
and an enqueue per stage) was most of the host's work: ~4.8 us per key on the development machine, against ~0.8
for the bare loop. Host-bound on the H200 host's slow vCPUs (0.78-0.87 of the DMA ceiling for 64 x 1 MiB, see
bench/results/README.md, session 21), the call now goes through its keys once: it checks, lays out and
queues key after key, handing the copy engine a batch as soon as it holds :data:`FIRST_RUNS` runs (or 3 MiB),
then batches twice as large (:func:`next_cut`) up to ``device.BATCH_RUNS``: the first DMA starts after three keys'
host work, and the host stays ahead of the DMA (1 MiB is ~19 us of PCIe Gen5).

The leases are taken in one lookup before the first copy, for the longest run of keys from the first that the
cache keeps current: those keys are served here and the caller serves the rest another way (the placement table's
one pass, or stages), so one key rewritten late in a call costs the keys after it, not the whole call. (Taking the
leases chunk by chunk as the keys are reached, to start the first copy ~30 us sooner, gained nothing: on the H200
host's slowed vCPUs, where the host bounds the call, the copy engine then waited as long for the later batches.
``tools/probe_kept_ab.py`` at commit 0d17281, session 23.)

What comes before the first copy is only what the copies need: the lookup pins every lease this client holds with one
count for the call (not a hold per key, given back per key after the last byte), and leaves the cache's recency
bookkeeping for :meth:`~kvstrata.client.remote.RemoteBackend.settle`, which runs while the copies move. On the H200
host (``tools/probe_call_steps.py``, session 26) that took the first batch from 85-119 us into the call to 59-83.

Where :mod:`kvstrata.ops.tensor_runs` is loaded, each batch is one native call that checks the tensors, lays out the
runs and queues them with the driver's batch call (:func:`_native_pass`); the Python loop below takes the keys it
cannot (a CPU or bad tensor, a second device).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

from kvstrata.client import device as _device
from kvstrata.errors import InvalidValue
from kvstrata.server import protocol as P

#: runs in the first batch: the DMA starts once this many keys are laid out. Three, not two as the write and the
#: placed read have (``device.FIRST_BATCH_RUNS``): switched call by call on the H200 host (``tools/probe_batch_growth.py
#: --first``, session 27, eight runs of 100-150 calls each), a first batch of 3 (then 6, 12, 16...) made a kept 64 x 1
#: MiB read 16-30 us faster than one of 2 in every run, slowed vCPUs or not (4: as 2). Its 57 us of DMA cover the host's
#: work for the second batch, which the 38 us of two keys did not on a slowed vCPU. For ``mset_d2h`` 3 was no faster.
#: The first enqueue hands the driver these runs first (more, where a key has several tensors, go in a second call).
FIRST_RUNS = 3
#: A batch of a cut of ``cut`` ends once its bytes reach ``cut * RUN_BYTES`` (keys of 1 MiB: ``cut`` keys) or its runs
#: ``cut``. The native pass (``_native_pass``) lets a batch hold ``RUNS_PER_CUT * cut`` runs instead, up to
#: ``MAX_BATCH_RUNS``, each batch in one driver call: a driver call costs the host a fixed part besides ~0.7 us a
#: run, which 16 runs of 64 KiB (~19 us of DMA) do not cover. Measured call by call on the H200 host
#: (``tools/probe_native_planner.py``, session 28, six runs), natively planned kept reads of 256 x 64 KiB went from
#: 0.31-0.44 of one 16 MiB copy to 0.33-0.52 this way, 256 x 256 KiB from 0.87-0.88 to 0.88-0.89 on full-speed vCPUs
#: (from 0.80-0.85 to 0.78-0.84 on slowed ones), ``mset_d2h`` of 256 x 256 KiB from 0.41-0.50 to 0.46-0.56; 64 x 1 MiB
#: alike (cut by bytes). The Python loop keeps ``cut`` runs: its ~2-9 us a key before a larger first batch cost more
#: than the fewer driver calls saved (256 x 256 KiB: 0.67-0.70 against 0.71-0.74).
RUN_BYTES = 1 << 20
RUNS_PER_CUT = 4
MAX_BATCH_RUNS = 64


def batch_runs(cut: int) -> int:
    """The most runs a native pass's batch of a cut of ``cut`` holds (see :data:`RUNS_PER_CUT`)."""
    return min(RUNS_PER_CUT * cut, MAX_BATCH_RUNS)


def next_cut(cut: int) -> int:
    """Runs in the batch after one of ``cut``: twice as many (2, 4, 8, 16 or 3, 6, 12, 16), up to
    ``device.BATCH_RUNS``.

    Each batch costs the host a fixed part (the driver's batch call, the Python around it) besides its keys' own
    work, and must be ready before the copy engine ends the batches queued before it. Growing by half (2, 3, 5, 8,
    12, 16), which a simple model of a slowed vCPU favoured, or by a third, measured no faster call by call on the
    H200 host, slowed or not (``tools/probe_batch_growth.py``, session 23): doubling stays."""
    return min(2 * cut, _device.BATCH_RUNS)


def queue(
    client: Any, backend: Any, keys: list[str], tensor_lists: Sequence[Sequence[Any]], stream: Any
) -> tuple[list[Any], Any, list[int], int] | None:
    """``mget_h2d`` of the keys whose leases this client kept, from the first, up to their copies queued:
    ``(results, the copies' end event or None, the leases to release once it completed, done)``, where keys
    ``[0, done)`` are served (``results`` has a slot for every key; those from ``done`` on are left to the caller).
    None, having done nothing, where the first key's lease is not kept (the other paths then serve the call).

    The keys may not be checked yet: they are here where some are not kept (a bad one raises before any copy),
    and need not be where all are (the local-read cache keeps only checked keys). A key whose tensors' bytes differ
    from its object's size gets a ValueError in its slot and no copy. A bad tensor raises after the copies already
    queued landed and the leases went back (the tensors of earlier keys may then hold their data), as in the staged
    path."""
    n = len(keys)
    _device.check_outer(n, tensor_lists)
    try:
        got = backend.kept_leases(keys)
    except TypeError:  # an unhashable key: the caller's check of the keys names it
        return None
    if got is None:
        return None
    held, locs = got
    done = len(locs)  # keys [0, done) kept
    if done < n:
        # The rest go another way, which needs them checked: here, so that a bad one raises before anything is
        # copied. Where every key is kept none needs it: the cache keeps only keys that were checked (this saves
        # the check's ~4 us before the first copy, ~8 on the H200 host's slowed vCPUs, for 64 keys).
        try:
            P.check_keys(keys)
        except BaseException:
            client._release_leases(held)
            raise
    results: list[Any] = [None] * n
    check, plan = _device.check_key, _device.plan
    address, ensure = backend.segment_address, client._registrations.ensure
    bases: dict[int, int] = {}
    runs = _device.new_runs()
    cut = FIRST_RUNS
    pending = 0  # bytes laid out in ``runs``
    s = device = None
    first = 0  # the first key the Python loop below lays out: those before it went the native pass
    try:
        planner = _planner()
        if planner is not None and planner.native() is not None:
            first, cut, s, device = _native_pass(
                planner, keys, tensor_lists, locs, done, results, client._registrations, address, backend, stream
            )
        for i in range(first, done):
            pieces, total, dev = check(tensor_lists[i], i)
            loc = locs[i]
            if total != loc.size:
                results[i] = InvalidValue(f"tensor_lists[{i}]: {total} bytes for {keys[i]!r}, which holds {loc.size}")
                continue
            if dev is not None and s is None:
                device, s = dev, _device.start(dev, stream)
            seg = loc.segment
            base = bases.get(seg)
            if base is None:
                base = bases[seg] = address(seg)
            plan(pieces, base + loc.offset, False, runs, seg)
            pending += total
            # Runs that continue each other merge (views of one tensor, objects side by side): the bytes count too.
            if len(runs.device) >= cut or pending >= cut * RUN_BYTES:
                ensure(bases, address, backend.segment_nbytes)  # registered with CUDA before their first copy
                _device.enqueue(runs, device, s, head=FIRST_RUNS if cut == FIRST_RUNS else None)
                runs = _device.new_runs()
                pending = 0
                cut = next_cut(cut)
        if runs.device:
            ensure(bases, address, backend.segment_nbytes)
        if first < done:
            _device.enqueue(runs, device, s, head=FIRST_RUNS if cut == FIRST_RUNS else None)
        event = _device.mark(s)
        if done == n:
            backend.settle()  # entries left for later and leases let go of, while the copies run
    except BaseException:
        if s is not None:
            s.synchronize()  # the leases must outlive every queued copy
        client._release_leases(held)
        raise
    return results, event, held, done


#: the kind of tensor the native pass takes: CUDA (tests without a GPU set False, so CPU tensors stand in)
NATIVE_CUDA = True


def _native_pass(
    planner: Any,
    keys: list[str],
    tensor_lists: Sequence[Sequence[Any]],
    locs: list[Any],
    done: int,
    results: list[Any],
    registrations: Any,
    address: Any,
    backend: Any,
    stream: Any,
) -> tuple[int, int, Any, Any]:
    """Lay out and queue keys ``[0, done)`` as :func:`queue`'s loop does, with a native pass per batch
    (:mod:`kvstrata.ops.tensor_runs`: ~0.1 us a tensor, against 1-2 us warm in Python and several times that cold):
    ``(the first key left to the Python loop, its next batch's runs, the copy stream, its device)``. Stops at a key
    the Python loop must take (a CPU or bad tensor, a second device), every key before it queued.

    Each pass queues its own copies (:func:`~kvstrata.ops.tensor_runs.plan_copy`: the driver's batch call from C++,
    no lists of addresses built and read back through cuda-bindings) where :func:`~kvstrata.client.device.native_copies`
    could start the copy stream ahead (the first key's first tensor names the device), else it answers the runs and
    :func:`~kvstrata.client.device.copy_lists` queues them. ``registrations.bases`` has the addresses of the segments
    registered with CUDA: a pass stops at a key in another (``NO_BASE``), which is registered before the pass goes
    on from it."""
    plan, plan_copy, no_base, batch_full = planner.plan, planner.plan_copy, planner.NO_BASE, planner.CUT
    cut, i, index = FIRST_RUNS, 0, -1
    s = device = copier = None
    if NATIVE_COPIES:
        got = _device.native_copies(tensor_lists, 0, stream)
        if got is not None:
            device, s, copier = got
            index = device.index
    bases = registrations.bases
    try:
        while i < done:
            head = FIRST_RUNS if cut == FIRST_RUNS else MAX_BATCH_RUNS
            if copier is not None:
                stop, why, queued, err, mismatched, index = plan_copy(
                    tensor_lists,
                    locs,
                    bases,
                    i,
                    done,
                    batch_runs(cut),
                    cut * RUN_BYTES,
                    (*copier, head, MAX_BATCH_RUNS),
                    device_index=index,
                    cuda=NATIVE_CUDA,
                )
                if err:
                    raise _device.copy_error("cuMemcpyBatchAsync", err, queued)
            else:
                stop, why, dsts, srcs, sizes, mismatched, index = plan(
                    tensor_lists, locs, bases, i, done, batch_runs(cut), cut * RUN_BYTES, device_index=index,
                    cuda=NATIVE_CUDA,
                )  # fmt: skip
                queued = len(sizes)
                if queued:
                    if s is None:
                        device, s = _device.start_index(index, stream)
                    _device.copy_lists(dsts, srcs, sizes, s, head, MAX_BATCH_RUNS)
            for k in mismatched:
                total = sum(t.nbytes for t in tensor_lists[k])
                results[k] = InvalidValue(
                    f"tensor_lists[{k}]: {total} bytes for {keys[k]!r}, which holds {locs[k].size}"
                )
            i = stop
            if queued:
                cut = next_cut(cut)
            if why == no_base:  # a segment not registered yet: registered, then on from this key
                registrations.ensure((locs[stop].segment,), address, backend.segment_nbytes)
                continue
            if why != batch_full:
                break
    except BaseException:
        if s is not None:
            s.synchronize()  # the caller gives the leases back: every queued copy must have landed
        raise
    return i, cut, s, device


#: a native pass queues its own copies (``plan_copy``) where it can; ``KVSTRATA_NATIVE_COPIES=0`` has cuda-bindings
#: queue the runs it answers instead (``tools/probe_native_planner.py`` switches it call by call)
NATIVE_COPIES = os.environ.get("KVSTRATA_NATIVE_COPIES", "1") != "0"


@functools.cache
def _planner() -> Any:
    """:mod:`kvstrata.ops.tensor_runs` where a GPU is there and the copy engine's raw calls to take its runs, else
    None (the Python loop's runs then go to torch's copies; a machine without a GPU never builds the module).
    Imported at the first kept read or reserved write: a client without device calls never loads torch."""
    import torch

    from kvstrata.ops import copy_engine, tensor_runs

    return tensor_runs if copy_engine._runtime() is not None and torch.cuda.is_available() else None
