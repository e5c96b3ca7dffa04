"""``mget_h2d`` of keys whose every lease this client kept: the whole call in one pass, no stages.

A repeated read of unchanged keys (a KV-cache prefix reloaded, weights paged back in) needs no round trip: the
local-read cache (:mod:`kvstrata.client.local_reads`) holds each key's lease and location. The staged path
(:meth:`~kvstrata.client.device_calls.DeviceCallsMixin.mget_h2d`) exists to overlap the worker's answers with
the copies; with no answer to wait for, its per-stage and per-key machinery (lease objects, stage lists, a plan
and an enqueue per stage) was most of the host's work: ~4.8 us per key on the development machine, against ~0.8
for the bare loop. Host-bound on the H200 host's slow vCPUs (0.78-0.87 of the DMA ceiling for 64 x 1 MiB, see
bench/results/README.md, session 21), the call now goes through its keys once: it checks, lays out and
queues key after key, handing the copy engine a batch as soon as it holds :data:`FIRST_RUNS` runs (or 2 MiB),
then batches twice as large up to ``device.BATCH_RUNS``: the first DMA starts after two keys' host work, and the
host stays far ahead of the DMA (1 MiB is ~19 us of PCIe Gen5).

The leases are taken in three chunks as the keys are reached (the first batch's keys, the next two batches', then
the rest), not all before the first copy: the lookup of 64 keys cost ~20-40 us on the development machine, all of it
in front of the first DMA (and each lookup ~4 us on its own, so not more chunks than that). A chunk that is not all
kept ends the pass there: the keys before it are served, and the caller serves the rest another way (the placement
table's one pass, or stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.client import device as _device
from kvstrata.server import protocol as _protocol

#: runs in the first batch: the DMA starts once this many keys are laid out
FIRST_RUNS = 2
#: or once a batch's runs hold ``RUN_BYTES`` times as many bytes as it may hold runs (where runs merged)
RUN_BYTES = 1 << 20


def lookup_end(looked: int, n: int) -> int:
    """Where the next chunk of a call's leases ends, ``looked`` of its ``n`` keys' taken so far: the first batch's
    keys, then up to the third batch's, then the rest."""
    if not looked:
        return min(n, FIRST_RUNS)
    return n if looked > FIRST_RUNS else min(n, 4 * looked)


def queue(
    client: Any, backend: Any, keys: list[str], tensor_lists: Sequence[Sequence[Any]], stream: Any
) -> tuple[list[Any], Any, list[int], int] | None:
    """``mget_h2d`` of the keys whose leases this client kept, from the first, up to their copies queued (``keys``: a
    list from ``protocol.key_list``, its entries checked here part by part as the pass reaches them):
    ``(results, the copies' end event or None, the leases to release once it completed, done)``, where keys
    ``[0, done)`` are served (``results`` has a slot for every key; those from ``done`` on are left to the caller).
    None, having done nothing, where the first batch's keys are not all kept (the other paths then serve the call).

    A key whose tensors' bytes differ from its object's size gets a ValueError in its slot and no copy. A bad
    tensor raises after the copies already queued landed and the leases went back (the tensors of earlier keys
    may then hold their data), as in the staged path."""
    n = len(keys)
    _device.check_outer(n, tensor_lists)
    looked = lookup_end(0, n)  # leases taken for keys [0, looked)
    check_keys = _protocol.check_key_run  # ``keys`` is a list not checked yet: each part as it is reached
    got = backend.kept_leases(check_keys(keys[:looked]))
    if got is None:
        return None
    held, locs = got
    results: list[Any] = [None] * n
    check, plan = _device.check_key, _device.plan
    address, ensure = backend.segment_address, client._registrations.ensure
    bases: dict[int, int] = {}
    runs = _device.new_runs()
    cut = FIRST_RUNS
    pending = 0  # bytes laid out in ``runs``
    done = n
    s = device = None
    try:
        for i in range(n):
            if i == looked:  # the next chunk's leases
                hi = lookup_end(looked, n)
                more = backend.kept_leases(check_keys(keys[looked:hi], "keys", looked))
                if more is None:
                    done = i  # not all kept: the rest goes another way
                    break
                held += more[0]
                locs += more[1]
                looked = hi
            pieces, total, dev = check(tensor_lists[i], i)
            loc = locs[i]
            if total != loc.size:
                results[i] = ValueError(f"tensor_lists[{i}]: {total} bytes for {keys[i]!r}, which holds {loc.size}")
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
                _device.enqueue(runs, device, s, first=cut == FIRST_RUNS)
                runs = _device.new_runs()
                pending = 0
                if cut < _device.BATCH_RUNS:
                    cut = min(2 * cut, _device.BATCH_RUNS)
        if runs.device:
            ensure(bases, address, backend.segment_nbytes)
        _device.enqueue(runs, device, s, first=cut == FIRST_RUNS)
        event = _device.mark(s)
        if done == n:
            backend.settle()  # entries left for later and leases let go of, while the copies run
    except BaseException:
        if s is not None:
            s.synchronize()  # the leases must outlive every queued copy
        client._release_leases(held)
        raise
    return results, event, held, done
