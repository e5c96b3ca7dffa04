"""``mget_h2d`` of keys this client did not keep, in one pass, where the worker's placement table places them.

The worker keeps a table, in shared memory, of where each key's bytes lie now (:mod:`kvstrata.store.placements`):
advice, read with no round trip, that a lease later confirms (or not). A cold read (a decode engine reading the KV
blocks prefill just wrote, a key read right after it was rewritten) whose first key the table places copies every
placed key at once as it goes through the keys, batch after batch as :mod:`kvstrata.client.batching` cuts them, and
asks the worker for every lease in one request, sent once two batches are queued (a request costs this thread ~40
us on the H200 host; two batches are ~110 us of DMA) and answered while the bytes move. The answer confirms each
early copy (its lease pins the very placement the copy read) or the key is copied again from where its lease says,
after the first copy on the stream; keys the table did not place are copied then too. The table is looked up
chunk by chunk as the keys are reached (2 keys, then 2, 4, 8 ...): a lookup of all 64 keys of a call before its
first copy cost ~30 us there (session 22's first version of this path, on branch ``placed-reads-experiment``).

The early copies go through the native passes of :mod:`kvstrata.ops.tensor_runs` where it is loaded (the hints as the
keys' places, a key with no usable hint passed over): one call per batch checks the tensors, lays out the runs and
queues them, as in a kept read (session 29, four runs on the H200 host switched call by call: a cold read of 256 x
256 KiB at 0.55-0.80 of one 64 MiB pinned copy against 0.33-0.50 planned in Python, of 64 x 1 MiB at 0.865-0.937
against 0.837-0.935; what is left for many keys is the lease request's answer and the per-key confirmation after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import eq, not_
from typing import Any

from kvstrata.client import batching as _batching
from kvstrata.client import device as _device
from kvstrata.errors import InvalidValue

#: the acquire request goes once this many batches are queued
SEND_AFTER_BATCHES = 2


def queue(
    client: Any,
    backend: Any,
    keys: list[str],
    tensor_lists: Sequence[Sequence[Any]],
    stream: Any,
    timeout: float,
    start: int = 0,
) -> Any:
    """``mget_h2d`` of keys ``start`` on (those before went another way: their slots of the results are left
    None) up to its copies queued, as ``DeviceCallsMixin._mget_h2d_queue`` returns it, where the worker's
    placement table places the first of them (and it does not wait for missing keys: a waiting call asks stage
    by stage within its timeout); else None, having done nothing (the staged path then serves the call).

    As the staged path: a key missing or whose tensors' bytes differ from its object's size gets its error in its
    slot (its tensors may have been written by an early copy); a bad tensor raises after the copies already queued
    landed and every lease taken went back."""
    n = len(keys)
    if timeout is None or timeout > 0 or start >= n:  # a waiting call (None: until the keys exist) goes staged
        return None
    _device.check_outer(n, tensor_lists)
    lookup = backend.placement_hints
    hints = lookup(keys[start : start + _device.FIRST_BATCH_RUNS])
    if hints is None or hints[0] is None or hints[0][3] <= 0:
        return None  # likely none placed (no table, or keys not in memory): the staged path asks ahead
    hints[:0] = [None] * start  # indexed by key
    advised = len(hints)
    # Every key asked for, none looked up in the local-read cache (the keys likely changed: their stale entries are
    # replaced when the new leases are entered, off this path); sent once two batches are queued.
    asked = keys[start:] if start else keys
    token = backend.acquire_start(asked, 0, cache="fit", carry=False, placements=True, send=False, local=False)
    unread = False  # the request went and its answer was not read yet
    results: list[Any] = [None] * n
    held: list[int] = []
    checked: list[Any] = [None] * n
    early: dict[int, Any] = {}  # key index -> the advice its early copy read
    check, plan, maps = _device.check_key, _device.plan, backend.maps
    address, ensure = backend.segment_address, client._registrations.ensure
    bases: dict[int, int] = {}
    runs = _device.new_runs()
    cut = _device.FIRST_BATCH_RUNS  # then doubling (batching.next_cut)
    run_bytes = _batching.RUN_BYTES
    pending = 0  # bytes laid out in ``runs``
    batches = 0
    s = device = None
    leases: list[Any] | None = None

    def hand_over() -> None:
        nonlocal runs, pending, cut, batches
        if runs.device:
            ensure(bases, address, backend.segment_nbytes)  # registered with CUDA before their first copy
        _device.enqueue(runs, device, s, first=not batches)
        runs, pending, batches = _device.new_runs(), 0, batches + 1
        cut = _batching.next_cut(cut)

    def lay_out(pieces: list[tuple], seg: int, offset: int, total: int) -> None:
        nonlocal pending
        base = bases.get(seg)
        if base is None:
            base = bases[seg] = address(seg)
        plan(pieces, base + offset, False, runs, seg)
        pending += total
        # Runs that continue each other merge (views of one tensor, objects side by side): the bytes count too.
        if len(runs.device) >= cut or pending >= cut * run_bytes:
            hand_over()

    def early_natively() -> int:
        """The early copies of keys from ``start`` on as the loop below makes them, with a native pass per batch
        (:class:`~kvstrata.client.batching.NativePasses` over the hints), up to a key the loop must take (a CPU or
        bad tensor, a second device). A key with no usable hint is passed over unchecked, as is a key whose tensors'
        bytes differ from its hint's (its lease says what it is). Returns the first key the loop takes."""
        nonlocal s, device, cut, batches, token, unread, hints, advised
        passes = _batching.NativePasses.start(tensor_lists, start, stream)
        if passes is None:
            return start
        s, device = passes.stream, passes.device
        native = passes.native
        limits = backend.segment_limits  # where a copy from a hint may read (maps(), as one dict)

        def usable(got: list[Any]) -> list[Any]:
            """The hints an early copy may read (a placement in memory this process maps), the others None."""
            return [h if h is not None and h[3] > 0 and h[1] + h[2] <= limits.get(h[0], -1) else None for h in got]

        hints[start:advised] = usable(hints[start:advised])
        registered = client._registrations.bases  # the segments' addresses, as the passes find them
        i = start
        while i < n:
            want = min(n, i + _batching.batch_runs(cut))  # hints for as many keys as the batch may hold
            if want > advised:
                hints += usable(lookup(keys[advised:want]))
                advised = len(hints)
            head = _device.FIRST_BATCH_RUNS if not batches else _batching.MAX_BATCH_RUNS
            try:
                stop, why, queued, mismatched = passes.plan(hints, registered, i, advised, cut, head)
            finally:
                s, device = passes.stream, passes.device
            skip = set(mismatched)
            for k in range(i, stop):  # the keys copied early: their hints, which their leases confirm or not
                if hints[k] is not None and k not in skip:
                    early[k] = hints[k]
            i = stop
            if queued:
                batches += 1
                cut = _batching.next_cut(cut)
                if batches == SEND_AFTER_BATCHES and not unread:
                    token, unread = backend.acquire_send(token), True
            if why == native.NO_BASE:  # a segment not registered yet: registered, then on from this key
                client._registrations.ensure((hints[stop][0],), address, backend.segment_nbytes)
                if hints[stop][0] not in registered:  # a segment the worker retired since: the hint is stale
                    hints[stop] = None
                continue
            if why == native.CUT or (why == native.DONE and i < n):
                continue
            break  # every key passed, or the loop takes key i
        return i

    try:
        for i in range(early_natively(), n):
            if i == advised:
                hints += lookup(keys[advised : 2 * advised - start])
                advised = len(hints)
            pieces, total, dev = checked[i] = check(tensor_lists[i], i)
            if dev is not None and s is None:
                device, s = dev, _device.start(dev, stream)
            hint = hints[i]
            if hint is not None and hint[2] == total and hint[3] > 0 and maps(hint[0], hint[1], total):
                early[i] = hint
                lay_out(pieces, hint[0], hint[1], total)
                if batches == SEND_AFTER_BATCHES and not unread:
                    token, unread = backend.acquire_send(token), True
        if pending or runs.host:
            hand_over()
        unread = False  # out first: an answer is read once, even one that raises (the connection then ends)
        # The leases as the reply's columns (acquire_columns: every key was asked, with placements), no lease object
        # per key: every granted one counted in ``held`` at once; ``leases`` keeps only the refused keys' errors.
        leases = backend.acquire_finish(token, leases=False)  # sent here where nothing did; indexed by key - start
        ids, places = backend.acquire_columns(token)
        held += compress(ids, ids)  # (a refused key's id is 0)
        # A key copied early whose lease names the very placement and place its copy read is done: all of them found
        # at once, in C (each lease's place against the hint its copy read), ~0.1 us a key where a loop over lease
        # objects took ~0.6 (256 keys, the development machine). The loop takes the others: refused keys, keys not
        # copied early, or copied from a placement gone since, which are copied again from where their lease says.
        stands = list(map(eq, map(early.get, range(start, n)), places))
        for i in [start + j for j in compress(range(n - start), map(not_, stands))] if not all(stands) else ():
            refused = leases[i - start]
            if refused is not None:  # (missing, or on SSD and not brought back)
                results[i] = refused
                continue
            segment, offset, size, _ = places[i - start]
            went = early.get(i)
            got = checked[i]
            if got is None:  # passed natively: an early copy's bytes are its hint's; any other key is checked now
                got = checked[i] = (None, went[2], None) if went is not None else check(tensor_lists[i], i)
            pieces, total, _ = got
            if total != size:
                results[i] = InvalidValue(f"tensor_lists[{i}]: {total} bytes for {keys[i]!r}, which holds {size}")
                continue
            if pieces is None:  # a key the native passes went by: checked now, as the loop above would have
                pieces, _, dev = check(tensor_lists[i], i)
                if dev is not None and s is None:
                    device, s = dev, _device.start(dev, stream)
            lay_out(pieces, segment, offset, total)
        if pending or runs.host:
            hand_over()
        event = _device.mark(s)
        backend.settle()  # the local-read entries of these leases are made while the copies run
    except BaseException:
        if s is not None:
            s.synchronize()  # the leases must outlive every queued copy
        if unread:
            try:  # asked for, not read yet: read, to give them back
                leases = backend.acquire_finish(token)
            except Exception:  # the connection may be what failed (the worker then releases them itself)
                leases = None
        if leases is not None:
            held.extend(x.lease_id for x in leases if x is not None and not isinstance(x, BaseException))
        if held:
            client._release_leases(held)
        raise
    return results, event, held


def copy_from(
    i: int, keys: list[str], lease: Any, went: Any, placed: int, nbytes: int, results: list[Any], held: list[int]
) -> Any:
    """Where key ``i`` must be copied from now that its lease (or error) came back: the lease's location, or None
    where its early copy stands (the lease pins the very placement the copy read, ``went``: see
    :mod:`kvstrata.store.placements`) or its slot of ``results`` now holds its error (missing; ``nbytes`` of
    tensors for an object of another size). A lease goes in ``held``. (The staged path's, key by key as its stages'
    leases come back; this module's path checks its keys all at once.)"""
    if isinstance(lease, BaseException):
        results[i] = lease
        return None
    held.append(lease.lease_id)
    loc = lease.location
    if went is not None and went == (*loc, placed):
        return None
    if nbytes != loc.size:
        results[i] = InvalidValue(f"tensor_lists[{i}]: {nbytes} bytes for {keys[i]!r}, which holds {loc.size}")
        return None
    return loc
