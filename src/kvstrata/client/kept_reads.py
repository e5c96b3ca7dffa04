"""``mget_h2d`` of keys whose leases this client kept: in one pass, no stages.

A repeated read of unchanged keys (a KV-cache prefix reloaded, weights paged back in) needs no round trip: the
local-read cache (:mod:`kvstrata.client.local_reads`) holds each key's lease and location. The staged path
(:meth:`~kvstrata.client.device_calls.DeviceCallsMixin.mget_h2d`) exists to overlap the worker's answers with
the copies; with no answer to wait for, its per-stage and per-key machinery (lease objects, stage lists, a plan
and an enqueue per stage) was most of the host's work: ~4.8 us per key on the development machine, against ~0.8
for the bare loop. Host-bound on the H200 host's slow vCPUs (0.78-0.87 of the DMA ceiling for 64 x 1 MiB, see
bench/results/README.md, session 21), the call now goes through its keys once: it checks, lays out and
queues key after key, handing the copy engine a batch as soon as it holds :data:`FIRST_RUNS` runs (or 3 MiB),
then batches twice as large (:mod:`kvstrata.client.batching`) up to ``device.BATCH_RUNS``: the first DMA starts
after three keys' host work, and the host stays ahead of the DMA (1 MiB is ~19 us of PCIe Gen5).

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
runs and queues them with the driver's batch call (:func:`_native_pass`,
:class:`~kvstrata.client.batching.NativePasses`); the Python loop below takes the keys it cannot (a CPU or bad tensor,
a second device). The lookup's test of the leases is one native call too
(:meth:`~kvstrata.client.local_reads.LocalReads.locations_prefix`), and so is the copy stream's wait for the caller's
(:func:`kvstrata.client.device.start`): on the H200 host (session 30, ``tools/probe_native_planner.py``, switched call
by call) the first batch of 64 x 1 MiB went 13-29 us sooner, 68-76 us into the call on slowed vCPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.client import batching as _batching
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
        passes = _batching.NativePasses.start(tensor_lists, 0, stream)
        if passes is not None:
            first, cut = _native_pass(passes, keys, tensor_lists, locs, done, results, client._registrations, backend)
            s, device = passes.stream, passes.device
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
            if len(runs.device) >= cut or pending >= cut * _batching.RUN_BYTES:
                ensure(bases, address, backend.segment_nbytes)  # registered with CUDA before their first copy
                _device.enqueue(runs, device, s, head=FIRST_RUNS if cut == FIRST_RUNS else None)
                runs = _device.new_runs()
                pending = 0
                cut = _batching.next_cut(cut)
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


def _native_pass(
    passes: Any,
    keys: list[str],
    tensor_lists: Sequence[Sequence[Any]],
    locs: list[Any],
    done: int,
    results: list[Any],
    registrations: Any,
    backend: Any,
) -> tuple[int, int]:
    """Lay out and queue keys ``[0, done)`` as :func:`queue`'s loop does, with a native pass per batch
    (:class:`~kvstrata.client.batching.NativePasses`: ~0.1 us a tensor, against 1-2 us warm in Python and several
    times that cold): ``(the first key left to the Python loop, its next batch's runs)``. Stops at a key the Python
    loop must take (a CPU or bad tensor, a second device), every key before it queued. ``registrations.bases`` has
    the addresses of the segments registered with CUDA: a pass stops at a key in another (``NO_BASE``), which is
    registered before the pass goes on from it."""
    no_base, batch_full = passes.native.NO_BASE, passes.native.CUT
    cut, i = FIRST_RUNS, 0
    bases = registrations.bases
    try:
        while i < done:
            head = FIRST_RUNS if cut == FIRST_RUNS else _batching.MAX_BATCH_RUNS
            stop, why, queued, mismatched = passes.plan(locs, bases, i, done, cut, head)
            for k in mismatched:
                total = sum(t.nbytes for t in tensor_lists[k])
                results[k] = InvalidValue(
                    f"tensor_lists[{k}]: {total} bytes for {keys[k]!r}, which holds {locs[k].size}"
                )
            i = stop
            if queued:
                cut = _batching.next_cut(cut)
            if why == no_base:  # a segment not registered yet: registered, then on from this key
                registrations.ensure((locs[stop].segment,), backend.segment_address, backend.segment_nbytes)
                continue
            if why != batch_full:
                break
    except BaseException:
        if passes.stream is not None:
            passes.stream.synchronize()  # the caller gives the leases back: every queued copy must have landed
        raise
    return i, cut
