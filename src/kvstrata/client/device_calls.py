"""The host <-> device calls of :class:`~kvstrata.client.Client`: ``mset_d2h``, ``mget_h2d`` and their async forms.

Each call checks and plans its keys' tensors in stages (:mod:`kvstrata.client.device`), pipelines the
worker's creates, commits, seals and leases with the stages' copies, and moves the bytes as batched
copies straight from and to the worker's shared segments, registered with CUDA on first use.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import math
import threading
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

from kvstrata.client import batching as _batching
from kvstrata.client import device as _device
from kvstrata.client import device_bytes as _device_bytes
from kvstrata.client import kept_reads as _kept_reads
from kvstrata.client import placed_reads as _placed_reads
from kvstrata.client import reservation as _reservation
from kvstrata.client._shared import Loc as _Loc
from kvstrata.client.copies_future import CopiesFuture
from kvstrata.client.placed_reads import copy_from
from kvstrata.errors import KvstrataError
from kvstrata.server import protocol as P

log = logging.getLogger(__name__)

#: ``.client``: the client whose async executor runs on this thread (see :func:`on_pool_thread`)
_POOL_THREAD = threading.local()


def _mark_pool_thread(client: Any) -> None:
    _POOL_THREAD.client = client


def on_pool_thread(client: Any) -> bool:
    """Whether this thread is one of ``client``'s async executors' (a callback of its calls runs there)."""
    return getattr(_POOL_THREAD, "client", None) is client


Result = Any  # per-key: None on success, the KvstrataError instance on failure (as in kvstrata.client.client)
#: the rate (bytes per us) a device write's lingering hints assume its copies run at: a bit under PCIe Gen5's ~55
#: GB/s, so the worker polls a little longer than the bytes take rather than sleep just before the commit
LINGER_BYTES_PER_US = 40_000
LINGER_SLACK_US = 100
#: a reserved ``mset_d2h``'s first mark (and its lingering hint) comes after this many copy batches
MARK_FROM_BATCH = 3


def _linger_us(nbytes: int) -> int:
    """How long the worker should poll for a commit that follows ``nbytes`` of copies (see ``linger``)."""
    return nbytes // LINGER_BYTES_PER_US + LINGER_SLACK_US


def _finish(steps: Generator[None, None, Any]) -> Any:
    """Run a call's steps (``_mset_d2h_steps``, new or paused) to their end; the call's result."""
    try:
        while True:
            next(steps)
    except StopIteration as end:
        return end.value


def _settle(future: concurrent.futures.Future, call: Any) -> None:
    """``future`` given what ``call()`` returns, or the exception it raises."""
    try:
        result = call()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _chain_bytes(tensor_lists: Any) -> int | None:
    """The bytes a ``mset_d2h`` of ``tensor_lists`` lays out in a reservation (each key rounded), or None where
    they cannot be told (bad input: the call's own checks name it)."""
    try:
        return sum(_reservation.rounded(sum(t.nbytes for t in ts)) for ts in tensor_lists)
    except Exception:
        return None


class DeviceCallsMixin:
    """Gives :class:`~kvstrata.client.Client` its host <-> device calls.

    Uses the client's ``_b()``, ``_backend``, ``_reservation`` (its write reservation), ``_registrations``
    (segments registered with CUDA), ``_release_leases``, ``_abort_quietly``, and its background
    executors for async calls (``_issuer`` and ``_completer``, made under ``_exec_lock``; shut down by
    ``close``).
    """

    def mset_d2h(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, stream: Any = None
    ) -> list[Result]:
        """Store each key's tensors (device or CPU), concatenated, as one host object. Write-once.

        A key that already exists is left as it is and reported as KeyExists in its slot. Returns None per stored
        key. The copies run as copy-engine batches on a copy stream that waits for ``stream`` (default: current).
        Keys that fit this client's write reservation (:mod:`kvstrata.client.reservation`) are laid out in it here
        one after another, with no request, and their copies queued in batches as they fill (the first after two
        keys); once every copy is queued they are committed (made a sealed object per key) in one request, ahead
        of their copies: the worker shows those objects when this process says, in shared memory, that the bytes
        landed (:mod:`kvstrata.server.lane`), so no request follows the last copy (where the worker has not read
        this client's previous such word yet, they are committed batch by batch as their bytes land instead). Keys
        past what the reservation holds are created by the worker in stages
        (:func:`kvstrata.client.device.stages`; the next stage's create in flight while this process queues the
        current stage's copies) and sealed once their bytes landed. An error (a bad tensor, a failed copy) waits
        for the queued copies and aborts every object not shown yet (a commit ahead of its copies shows none of
        its objects); reserved bytes not committed go to the next call. A list of keys is checked once the first
        batch of copies into the reservation is queued (those create nothing): a bad key raises after they landed,
        with nothing stored. Through a worker over TCP (no shared memory) each key's tensors go over the connection as
        one value instead (:mod:`kvstrata.client.device_bytes`).
        """
        if not self._b().shm:  # (a worker over TCP: the tensors' bytes go over the connection)
            return _device_bytes.mset_d2h(self, P.check_keys(keys), tensor_lists, stream)
        return _finish(self._mset_d2h_steps(keys, tensor_lists, stream=stream))

    def _mset_d2h_steps(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, stream: Any, chain: bool = False
    ) -> Generator[None, None, list[Result]]:
        """:meth:`mset_d2h` as two steps: the generator pauses once every copy is queued (the host work that keeps
        the copy engine fed) and returns the per-key results when resumed to its end (waiting for the copies,
        committing or sealing, reading the worker's answers). Both steps may run on different threads, one after
        the other. Without a pause (no keys, or an error before the copies) the first ``next`` ends it.
        ``chain``: an async call of the client's chain (:mod:`kvstrata.client.reservation`), which may carve on
        from the previous async call's carving before that call committed."""
        # A list of keys is checked once the first copies are queued (``lay_out``): the check costs ~5-8 us for 64
        # keys (more on the H200 host's slowed vCPUs), and copies into this client's reservation create nothing. A
        # bad key then raises after those copies landed, with no object made (their bytes go to the next call).
        unchecked = type(keys) is list and len(keys) > 0
        keys = keys.copy() if unchecked else P.check_keys(keys)
        n = len(keys)
        _device.check_outer(n, tensor_lists)
        if not keys:
            return []
        backend = self._b()
        opts = {"ttl": None, "nx": True, "mode": "memory"}
        results: list[Result] = [None] * len(keys)
        created_keys: list[str] = []
        sealed: set[str] = set()
        s = None
        in_flight: collections.deque = collections.deque()  # (stage, create token): one stage ahead
        # (key indices, committed?, token): commits and seals sent, answers not read yet
        seals: collections.deque = collections.deque()
        resv = self._reservation
        held = resv.take(backend, chain_bytes=_chain_bytes(tensor_lists) if chain else None)
        known = resv.head if held and resv.end else None  # the worker's head, as last heard
        carved_from = carved_to = resv.head  # the local head before and after this call's carving
        head_lost = False  # a commit went out whose reply is never read: ``known`` cannot be trusted
        call_bytes = 0

        def take(st: Any, token: Any) -> tuple[list[int], list[Any]]:
            created, where = [], []
            for j, loc in enumerate(backend.mcreate_finish(token)):
                if isinstance(loc, BaseException):
                    results[st.lo + j] = loc  # KeyExists for a key already there, left as it is
                else:
                    created.append(st.lo + j)
                    where.append(loc)
            created_keys.extend(keys[i] for i in created)
            return created, where

        def finish_one() -> None:  # read the reply of the oldest commit or seal sent
            nonlocal known
            which, committed, token = seals.popleft()  # out first: a reply is read once, even one that raises
            if committed:
                known = None  # unknown while the reply is not read (it may raise)
                rs, known = backend.commit_finish(token)  # a refused key's piece was freed by the worker
                for i, r in zip(which, rs):
                    results[i] = r
                return
            for i, r in zip(which, backend.mseal_finish(token)):
                results[i] = r
                if r is None:
                    sealed.add(keys[i])

        # (key indices, commit items or None for created keys, event after their copies, their bytes)
        marks: list[tuple[list[int], Any, Any, int]] = []

        def lay_out() -> int:
            """Lay the call's keys out in the reservation one after another from the first, queuing their copies
            as batches fill (``device.FIRST_BATCH_RUNS`` runs, then twice as many up to ``device.BATCH_RUNS``, as
            :mod:`kvstrata.client.batching` grows them), with a mark per batch (the first three batches share
            one); no stages, no request. Planned natively where it can be (``lay_out_natively``), else by the loop.
            Ends at the first key that does not fit (the worker creates the rest). Returns how many keys were laid
            out."""
            nonlocal s, call_bytes, carved_to, unchecked
            if not resv.end:
                return 0
            check, plan, enqueue, mark = _device.check_key, _device.plan, _device.enqueue, _device.mark
            segment, head, end = resv.segment, resv.head, resv.end
            base = self._registrations.bases.get(segment) or backend.segment_address(segment)
            runs = _device.new_runs()
            which: list[int] = []
            items: list[tuple[str, int, int]] = []
            cut, pending, marked = _device.FIRST_BATCH_RUNS, 0, 0  # pending: the batch's bytes; marked: the mark's
            device = None
            laid = batches = 0

            def flush(last: bool = False, native: bool = False) -> None:
                """Queue the batch's copies (``runs``; a ``native`` pass queued its own) and mark its keys."""
                nonlocal runs, which, items, cut, pending, marked, batches
                if not native:
                    if runs.device:
                        self._registrations.ensure((segment,), backend.segment_address, backend.segment_nbytes)
                    enqueue(runs, device, s, first=not batches)
                batches += 1
                marked += pending
                runs, pending = _device.new_runs(), 0
                cut = _batching.next_cut(cut)
                if batches < MARK_FROM_BATCH and not last:
                    # The first batches' keys are marked with the third's. A mark (a CUDA event) and the lingering
                    # hint below cost the host 15-35 us on the H200 host's slowed vCPUs. After the first batch they
                    # held up the second: the copy engine, done with its 2 MiB, then idled ~70 us; after the second,
                    # ~30 us (tools/probe_call_steps.py --op mset, session 26). The third batch's 8 MiB outlast them.
                    return
                marks.append((which, items, mark(s), marked))
                if len(marks) == 1 and s is not None:
                    # The worker's thread for this client likely sleeps (nothing asked for a while) and would take
                    # ~100+ us to wake for the first commit: have it wake now and poll, while the copies run, for
                    # as long as the call's bytes take to land.
                    backend.linger(_linger_us(marked * n // laid))
                which, items, marked = [], [], 0

            def lay_out_natively() -> None:
                """Lay keys out and queue their copies as the loop below does, with a native pass per batch
                (:class:`~kvstrata.client.batching.NativePasses`), up to a key that does not fit or that the loop must
                take (a CPU or bad tensor, a second device)."""
                nonlocal laid, head, pending, s, device, unchecked
                passes = _batching.NativePasses.start(tensor_lists, laid, stream)
                if passes is None:
                    return
                if segment not in self._registrations.bases:  # registered before the passes' first copy
                    self._registrations.ensure((segment,), backend.segment_address, backend.segment_nbytes)
                native = passes.native
                while laid < n:
                    first_call = _device.FIRST_BATCH_RUNS if not batches else _batching.MAX_BATCH_RUNS
                    try:
                        stop, why, queued, totals, offsets, head = passes.lay_out(
                            laid, n, base, head, end, _reservation.ALIGNMENT - 1, segment, cut, first_call
                        )
                    finally:  # (a refused batch: the keys laid out before it are given back as the loop's are)
                        s, device = passes.stream, passes.device
                    if unchecked:  # the first batch's copies are queued: the keys' check runs while they move
                        P.check_keys(keys)
                        unchecked = False
                    items.extend(zip(keys[laid:stop], totals, offsets))
                    which.extend(range(laid, stop))
                    pending += sum(totals)
                    laid = stop
                    if why == native.CUT:
                        flush(native=True)
                        continue
                    if why == native.DONE:
                        flush(last=True, native=True)
                    elif queued:  # the loop below takes the next key (PYTHON_PATH), or none fits (FULL)
                        flush(native=True)
                    return

            try:
                lay_out_natively()
                if unchecked:
                    P.check_keys(keys)
                    unchecked = False
                while laid < n:
                    pieces, total, dev = check(tensor_lists[laid], laid)
                    room = _reservation.rounded(total)
                    if head + room > end:
                        break
                    if dev is not None and s is None:
                        device, s = dev, _device.start(dev, stream)
                    plan(pieces, base + head, True, runs, segment)
                    items.append((keys[laid], total, head))
                    which.append(laid)
                    head += room
                    pending += total
                    laid += 1
                    if len(runs.device) >= cut or pending >= cut * _batching.RUN_BYTES:
                        flush()
                if which:
                    flush(last=True)
            finally:  # laid out so far (an error after some were: ``give`` sorts it out)
                call_bytes += head - resv.head
                resv.head = carved_to = head
            return laid

        try:
            laid = lay_out() if held else 0
            if unchecked:  # no reservation: checked before the worker is asked to create anything
                P.check_keys(keys)
            # The rest of the call (keys that did not fit the reservation) is created by the worker, in stages: the
            # next stage's create in flight while this stage's copies are queued.
            for st in itertools.chain(_device.stages(n, tensor_lists, laid) if laid < n else (), [None]):
                if st is not None:
                    call_bytes += sum(map(_reservation.rounded, st.sizes))
                    in_flight.append((st, backend.mcreate_start(list(zip(keys[st.lo : st.hi], st.sizes)), opts)))
                    if len(in_flight) < 2:
                        continue  # check the next stage while the worker creates this one
                if not in_flight:
                    continue
                prev, token = in_flight.popleft()
                created, where = take(prev, token)
                if s is None and prev.device is not None:
                    s = _device.start(prev.device, stream)
                runs = self._plan(created, where, prev.pieces, prev.lo, prev.device, to_host=True)
                _device.enqueue(runs, prev.device, s, first=not marks)
                marks.append((created, None, _device.mark(s), 0))
            yield  # every copy is queued: the rest waits for them (an async call's completion thread resumes here)
            if chain and held and resv.lost and any(m[1] is not None for m in marks):
                # An earlier call of the chain failed after this one carved on: the worker's head is not where
                # this call's objects begin, so their commits would be refused one by one. Say why instead.
                if s is not None:
                    s.synchronize()  # its copies land before the reservation's rest can be handed out again
                lost = KvstrataError(
                    "not stored: an earlier async_mset_d2h of this client failed after this call's bytes were "
                    "laid out behind its own in the write reservation; write these keys again"
                )
                for m in marks:
                    if m[1] is not None:
                        for i in m[0]:
                            results[i] = lost
                marks = [m for m in marks if m[1] is None]
            # Commit or seal stage by stage as its copies land (stream order: a stage's event covers its
            # copies), each sent without waiting for the worker, whose answers are read at the end. Stages
            # whose copies have all landed by the time one is sent go in that one request (the first of
            # them waited for), so the worker answers a few requests per call, not one per stage.
            j = 0
            while j < len(marks):
                rest = marks[j:]
                # Looked at before each request: a chained async call that finds the worker has not yet read the
                # previous call's landing word commits its first batches as they land, then the rest ahead of
                # their copies as soon as the worker has read it.
                land = getattr(backend, "can_land", False)
                if land and all(m[1] is not None and m[2] is not None for m in rest):
                    # The rest waits on nothing but the copy engine: commit every remaining stage now, in one
                    # request. The worker answers at once, and its answer is read while the bytes move; the
                    # objects become visible when this process says, in shared memory, that the last stage's
                    # bytes landed (kvstrata.server.lane), so the call ends right after its last byte, with no
                    # request or answer after it. (Before, the first stages waited for their bytes and went in a
                    # plain commit of their own: the worker's two answers came 250-300 us apart on the H200 host,
                    # the second one close to the last byte; one commit per stage, each landed as its copies
                    # did, kept the worker answering a request per stage up to the end. A commit of the first
                    # stages sent while the later ones were still being queued brought the answer ~100 us
                    # earlier but no call sooner: tools/probe_commit_ahead.py at 4804a1e.)
                    token: Any = None
                    landed = False
                    try:
                        token = backend.commit_start([it for m in rest for it in m[1]], opts, landing=True)
                        seals.append(([i for m in rest for i in m[0]], True, token))
                        while seals:
                            finish_one()
                        if held and not chain:  # the next reservation asked for while the bytes move
                            resv.renew(backend, known, call_bytes)
                        rest[-1][2].synchronize()  # stream order: the last stage's event follows every copy
                        backend.land(token)
                        landed = True
                    finally:
                        # The worker refuses every held commit not landed yet: every one this connection sent,
                        # even one whose sending a KeyboardInterrupt cut short after the bytes went out (its
                        # objects would otherwise wait, their keys taken, until this client disconnects).
                        if not landed:
                            backend.land_failed()
                            # A commit cut short there may have gone out with its reply never to be read: the
                            # worker's head is then unknown here, and this client's reservation is dropped.
                            head_lost = token is None
                    break
                if marks[j][2] is not None:
                    marks[j][2].synchronize()  # the bytes must be in host memory before the objects are sealed
                k = j + 1
                while k < len(marks) and (marks[k][2] is None or marks[k][2].query()):
                    k += 1
                carved = [m for m in marks[j:k] if m[1] is not None]  # carved stages come before created ones
                if carved:
                    which = [i for m in carved for i in m[0]]
                    # another commit follows once the bytes still moving land: the worker polls until then
                    linger = _linger_us(sum(m[3] for m in marks[k:])) if k < len(marks) else 0
                    items = [it for m in carved for it in m[1]]
                    seals.append((which, True, backend.commit_start(items, opts, linger)))
                which = [i for m in marks[j:k] if m[1] is None for i in m[0]]
                if which:
                    seals.append((which, False, backend.mseal_start([keys[i] for i in which])))
                j = k
            while seals:
                finish_one()
            refused = [k for k in created_keys if k not in sealed]
            if refused:  # a seal the worker refused (its error is in the key's slot): no create left open
                self._abort_quietly(backend, refused)
        except BaseException:
            if s is not None:
                s.synchronize()  # no copy may still write into an object being aborted, or reserved bytes
            for st, token in in_flight:  # creates sent and not read yet: their objects must go too
                try:
                    take(st, token)
                except Exception as exc:  # the connection may be what failed
                    log.debug("mset_d2h: create reply lost while undoing (%s)", exc)
            for which, committed, token in seals:  # sent and not read yet: those that worked stay
                try:
                    if committed:
                        known = backend.commit_finish(token)[1]
                    else:
                        sealed.update(keys[i] for i, r in zip(which, backend.mseal_finish(token)) if r is None)
                except Exception as exc:
                    if committed:
                        known = None  # the worker's head is unknown now: this client's reservation is dropped
                    log.debug("mset_d2h: seal reply lost while undoing (%s)", exc)
            self._abort_quietly(backend, [k for k in created_keys if k not in sealed])
            raise
        finally:
            if held:
                resv.give(backend, None if head_lost else known, call_bytes, (carved_from, carved_to))
        return results

    def mget_h2d(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, timeout: float = 0, stream: Any = None
    ) -> list[Result]:
        """Fill each key's tensors (device or CPU) from its object, split in order. Returns None per key filled.

        The tensors' sizes must add up to the object's size (ValueError in that key's slot otherwise). Waits up to
        ``timeout`` seconds for missing keys (0: not at all, a miss is KeyNotFound in its slot; None: until they
        come). The copies run as copy-engine batches on a copy stream that waits for
        ``stream`` (default: current); the call returns once they have landed. Leases on the objects pin their
        bytes until then. The keys from the first that this client read before and that are unchanged since go in
        one pass with no round trip to the worker (:mod:`kvstrata.client.kept_reads`); the rest of the call (all of
        it where the first key is not such a key) goes the first of these ways that applies:

        * the worker's placement table (:mod:`kvstrata.store.placements`) places its first key (keys another
          client or this one just wrote): every placed key copied at once in one pass, and one request for every
          lease, sent once two batches are queued, confirms them while the bytes move, or the key is copied again
          from where its lease says (:mod:`kvstrata.client.placed_reads`);
        * else (or with a ``timeout``) pipelined in stages (:func:`kvstrata.client.device.stages`): the first
          stage's leases and the next keys' (up to 4x as many) asked for at the start, every key left in one
          request once the first stage's copies are queued, answered while earlier bytes move, and a stage's
          placed keys copied before their leases come back.

        A bad tensor raises when it is reached, after the copies already queued landed (the tensors of earlier keys
        may then hold their data); a key that fails (missing, wrong size) may have had its tensors written.
        Through a worker over TCP (no shared memory) the values come over the connection instead
        (:mod:`kvstrata.client.device_bytes`).
        """
        if not self._b().shm:
            return _device_bytes.mget_h2d(self, P.check_keys(keys), tensor_lists, P.check_timeout(timeout), stream)
        results, event, held = self._mget_h2d_queue(keys, tensor_lists, timeout=timeout, stream=stream)
        try:
            if event is not None:
                event.synchronize()  # the leases pin the source bytes until the copies are done
        finally:
            if held:
                self._release_leases(held)
        return results

    def _mget_h2d_queue(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, timeout: float, stream: Any
    ) -> tuple[list[Result], Any, list[int]]:
        """:meth:`mget_h2d` up to its copies queued: ``(results, the copies' end event or None, the leases to
        release once it completed)``. On an error the queued copies are waited for and the leases released here."""
        timeout = P.check_timeout(timeout)
        backend = self._b()
        kept = None
        if type(keys) is list and 0 < len(keys) <= P.MAX_BATCH:
            # Unchecked keys: the kept path checks them where it needs to, before any copy (kept_reads.queue).
            kept = _kept_reads.queue(self, backend, keys, tensor_lists, stream)
        if kept is None:
            keys = P.check_keys(keys)
            if not keys:
                _device.check_outer(0, tensor_lists)
                return [], None, []
            return self._mget_h2d_cold(backend, keys, tensor_lists, timeout, stream, 0)
        results, event, held, done = kept
        if done == len(keys):
            return results, event, held  # every lease kept by this client
        try:  # the keys from ``done`` on were not all kept
            rest, later, more = self._mget_h2d_cold(backend, keys, tensor_lists, timeout, stream, done)
        except BaseException:
            if event is not None:
                event.synchronize()  # the kept leases must outlive their copies
            self._release_leases(held)
            raise
        rest[:done] = results[:done]
        return rest, _device.both(event, later), held + more

    def _mget_h2d_cold(
        self, backend: Any, keys: list[str], tensor_lists: Any, timeout: float, stream: Any, start: int
    ) -> tuple[list[Result], Any, list[int]]:
        """Keys ``start`` on of :meth:`_mget_h2d_queue` (those before went another way; their slots of the results
        are left None), whose leases are not all kept: in one pass where the worker's placement table places the
        first of them (:mod:`kvstrata.client.placed_reads`), else in stages. Its copies from placement hints may
        read a segment the worker retires meanwhile: the segment stays registered until this returned
        (:class:`~kvstrata.client.device.Registrations`)."""
        registrations = self._registrations
        epoch = registrations.enter()
        try:
            return self._mget_h2d_hinted(backend, keys, tensor_lists, timeout, stream, start)
        finally:
            registrations.exit(epoch)

    def _mget_h2d_hinted(
        self, backend: Any, keys: list[str], tensor_lists: Any, timeout: float, stream: Any, start: int
    ) -> tuple[list[Result], Any, list[int]]:
        """:meth:`_mget_h2d_cold` within its bracket."""
        placed = _placed_reads.queue(self, backend, keys, tensor_lists, stream, timeout, start)
        if placed is not None:
            return placed
        n = len(keys)
        results: list[Result] = [None] * n
        leases: list[Any] = [None] * n  # each key's lease (or its error), as the acquires come back
        # Early copies (queued before the key's lease came back), per key index: the placement table's
        # ``(segment, offset, size, placement)`` they read from. ``placed``: each lease's placement, as the worker
        # says; ``advice``: the table's, per key, as looked up.
        early: dict[int, Any] = {}
        hinted = backend.placement_hints([]) is not None  # the worker keeps a placement table
        placed: list[int] = [0] * n if hinted else []
        advice: list[Any] = [None] * n if hinted else []
        advised = start  # keys [start, advised) were looked up in the table
        kept: list[Any] = [None] * n if hinted else []  # the leases the local-read cache served (no early copy)
        early_stages: set[int] = set()  # the ``lo`` of stages with early copies
        held: list[int] = []
        waits = timeout is None or timeout > 0  # None (or FOREVER_S and more, made None): until the keys exist
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        s = None
        first = True
        asked: collections.deque = collections.deque()  # (lo, hi, acquire token), in key order, answers not read
        ready: collections.deque = collections.deque()  # checked stages whose copies are not queued yet
        confirm: list[Any] = []  # checked stages with early copies: their leases are read at the end
        covered = start  # keys [start, covered) have their leases asked for
        upfront = 0  # stages of keys < upfront wait for their answers at once (asked for at the start)

        def ask(lo: int, hi: int, *, send: bool = True, local: bool = True) -> None:
            nonlocal covered
            if lo < hi:
                left = None if timeout is None else max(0.0, deadline - time.monotonic()) if waits else 0
                # Lease releases due (e.g. stale local-read entries) go with the final release, not ahead.
                token = backend.acquire_start(
                    keys[lo:hi], left, cache="fit", carry=False, placements=hinted, send=send, local=local
                )
                asked.append((lo, hi, token))
                covered = hi
                if hinted:
                    kept[lo:hi] = backend.acquire_local(token)

        def send_asked() -> None:  # send the requests that ask(send=False) made ready
            for j, (lo, hi, token) in enumerate(asked):
                asked[j] = (lo, hi, backend.acquire_send(token))

        def answered(hi: int) -> bool:  # the leases of keys < hi need no worker answer still
            return all(backend.acquire_ready(tok) for lo, _, tok in asked if lo < hi)

        def collect(hi: int) -> None:  # read the acquires covering keys < hi
            while asked and asked[0][0] < hi:
                lo, top, tok = asked.popleft()  # out first: a reply is read once, even one that raises
                leases[lo:top] = backend.acquire_finish(tok)
                got = backend.acquire_placements(tok)
                if got is not None:
                    placed[lo:top] = got

        def advise(st: Any) -> list[int]:
            """The keys of ``st`` whose bytes' place the placement table advises, usable as it says (the sizes
            agree, the place is in a segment this client maps)."""
            nonlocal advised
            lo, hi = st.lo, st.hi
            if advised < hi:
                advice[advised:hi] = backend.placement_hints(keys[advised:hi])
                advised = hi
            sizes, maps = st.sizes, backend.maps
            out = []
            for i in range(lo, hi):
                got = advice[i]
                if got is not None and got[2] == sizes[i - lo] and got[3] > 0 and maps(*got[:3]):
                    out.append(i)
            return out

        def copy_early(st: Any) -> None:
            """Queue now the copies of the keys of ``st`` that :func:`advise` places and the local-read cache did not
            serve (checked against their leases once those come back)."""
            nonlocal s, first
            lo = st.lo
            which = [i for i in advise(st) if kept[i] is None]
            locs = []
            for i in which:
                got = early[i] = advice[i]
                locs.append(_Loc(*got[:3]))
            if which:
                early_stages.add(lo)
                if s is None and st.device is not None:
                    s = _device.start(st.device, stream)
                runs = self._plan(which, locs, st.pieces, lo, st.device, to_host=False)
                _device.enqueue(runs, st.device, s, first=first)
                first = False

        def due(prev: Any) -> bool:  # whether the oldest stage waiting is checked and its copies queued now
            if st is None or answered(prev.hi):
                return True
            return len(ready) > 1 or prev.hi <= upfront

        try:
            for st in itertools.chain(_device.stages(n, tensor_lists, start), [None]):
                if st is not None:
                    if covered < st.hi:
                        # The first stage's request is only made ready here (what the local-read cache serves is
                        # known then) and sent after its early copies: nothing goes in front of its first bytes.
                        ask(covered, st.hi, send=not (hinted and st.lo == start))
                    cold = not answered(st.hi)  # the worker must be asked for some of this stage's leases
                    if cold and hinted:
                        copy_early(st)  # before any further request: nothing in front of these bytes
                    if hinted and st.lo == start:
                        send_asked()
                    if st.lo == start and cold and not waits and covered < n:
                        # The worker is asked (keys not read before, or changed). This thread would only wait for
                        # the first answer: it asks now for the next keys too, up to 4x the first stage's (the
                        # worker reads that request right after its first reply, with no wake-up), and sets the
                        # copy stream to follow the caller's. Once the first stage's copies are queued, the second
                        # stage's leases are in and its copies go at once. (Asking for all of them at the start
                        # put ~100 us of requests before the first copies; asking for the rest after the first
                        # stage's copies put it between the first and second stage's.) Where the local-read cache
                        # served the first stage, each stage asks as it comes (the cache likely serves it too, at
                        # no cost); so does a call that waits for missing keys, whose every request must carry
                        # what is left of its one timeout.
                        ask(st.hi, min(n, start + max(8, 4 * (st.hi - start))))
                        if s is None and st.device is not None:
                            s = _device.start(st.device, stream)
                        upfront = covered  # their answers come first: nothing to do before them but wait
                    elif st.lo > start and upfront and covered < n:
                        # The up-front requests are in flight or read: every key left in one more request, sent
                        # once this stage's copies (early ones) are queued and answered while bytes move (one
                        # request instead of one per stage: each costs this thread ~30-40 us to send and read, on
                        # a path the host bounds).
                        ask(covered, n)
                    # A stage with early copies waits for the end, out of the way of later stages that wait for their
                    # leases: its leases only confirm copies that run already.
                    (confirm if st.lo in early_stages else ready).append(st)
                else:
                    ready.extend(confirm)
                # Queue a stage's copies once its leases are in, checking (and asking for) the next stage while the
                # worker answers; a stage served by the local-read cache alone goes at once, and one whose leases
                # were asked for at the start waits for them at once (they come first).
                while ready and due(ready[0]):
                    prev = ready.popleft()
                    collect(prev.hi)
                    filled, locs = [], []
                    for j in range(prev.hi - prev.lo):
                        i = prev.lo + j
                        lease, leases[i] = leases[i], None  # counted in ``held`` or ``results`` from here on
                        # an early copy stands, or the key is copied (again, after it on the stream) from its lease
                        loc = copy_from(i, keys, lease, early.get(i), placed[i] if placed else 0, prev.sizes[j],
                                        results, held)  # fmt: skip
                        if loc is not None:
                            filled.append(i)
                            locs.append(loc)
                    if filled:
                        if s is None and prev.device is not None:
                            s = _device.start(prev.device, stream)
                        runs = self._plan(filled, locs, prev.pieces, prev.lo, prev.device, to_host=False)
                        _device.enqueue(runs, prev.device, s, first=first)
                        first = False
            event = _device.mark(s)
            backend.settle()  # the local-read entries of this call's leases are made while its copies run
        except BaseException:
            if s is not None:
                s.synchronize()  # the leases below must outlive every queued copy
            # Leases read but not yet counted as held, and leases requested and not read yet, go back too.
            held.extend(x.lease_id for x in leases if x is not None and not isinstance(x, BaseException))
            while asked:
                _, _, tok = asked.popleft()
                try:
                    held.extend(x.lease_id for x in backend.acquire_finish(tok) if not isinstance(x, BaseException))
                except Exception as exc:
                    log.debug("mget_h2d: lease reply lost while undoing (%s)", exc)
            if held:
                self._release_leases(held)
            raise
        return results, event, held

    def _plan(
        self, which: list[int], locs: list[Any], pieces: list[Any], lo: int, device: Any, *, to_host: bool
    ) -> Any:
        """The copies between keys ``which`` (their objects at ``locs``) and their tensors (key ``i``'s pieces
        at ``pieces[i - lo]``), as address runs. Segments the device copies touch are registered with CUDA
        first (once per client)."""
        backend = self._backend
        runs = _device.new_runs()
        bases: dict[int, int] = {}
        for i, loc in zip(which, locs):
            if not loc.size:
                continue
            base = bases.get(loc.segment)
            if base is None:
                base = bases[loc.segment] = backend.segment_address(loc.segment)
            _device.plan(pieces[i - lo], base + loc.offset, to_host, runs, loc.segment)
        if runs.device:
            self._registrations.ensure(bases, backend.segment_address, backend.segment_nbytes)
        return runs

    def async_mset_d2h(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, stream: Any = None
    ) -> concurrent.futures.Future:
        """:meth:`mset_d2h` in the background; the Future's result is its per-key list.

        As :meth:`async_mget_h2d`: the client's issuing thread queues the calls' copies in call order and goes on
        to the next call at once; its completion thread waits for each call's copies, commits its objects and
        settles its Future, in the same order. Calls issued back to back keep the copy engine busy, and carve
        their objects one after another from the client's write reservation while earlier calls' commits are
        still to come (:mod:`kvstrata.client.reservation`). (Session 18 on the H200 host: two pool threads, each
        running whole calls on the one connection, waited up to 430 us for each other's replies and left the
        copy engine idle up to 640 us between calls: 0.65-0.78 of the DMA ceiling with 4 calls in flight.)
        Don't change the tensors before the Future is done."""
        stream = self._caller_stream(stream, tensor_lists)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def queue() -> None:
            if not future.set_running_or_notify_cancel():
                return
            # (_backend, not _b(): a call queued before close() is settled by the call itself, which raises
            # ClosedError into the Future; a ClosedError here escaped it and left the Future running for good)
            if not self._backend.shm:  # (a worker over TCP: the whole call here, in order with the others)
                _settle(future, lambda: self.mset_d2h(keys, tensor_lists, stream=stream))
                return
            steps = self._mset_d2h_steps(keys, tensor_lists, stream=stream, chain=True)
            try:
                next(steps)
            except StopIteration as end:  # nothing to wait for (no keys)
                future.set_result(end.value)
                return
            except BaseException as exc:
                future.set_exception(exc)
                return
            try:
                self._single("_completer", "kvstrata-complete").submit(self._complete_steps, future, steps)
            except RuntimeError:  # the interpreter is shutting down (no new threads): complete it here
                self._complete_steps(future, steps)

        self._b()
        self._single("_issuer", "kvstrata-issue").submit(queue)
        return future

    @staticmethod
    def _complete_steps(future: concurrent.futures.Future, steps: Generator[None, None, Any]) -> None:
        """The end of an async :meth:`mset_d2h` (on the completion thread): its result or error into ``future``."""
        try:
            result = _finish(steps)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def async_mget_h2d(
        self, keys: Sequence[str], tensor_lists: Sequence[Sequence[Any]], *, timeout: float = 0, stream: Any = None
    ) -> concurrent.futures.Future:
        """:meth:`mget_h2d` in the background; don't read the tensors before the Future is done.

        One thread per client queues the calls' copies, in call order, and goes on to the next call at once; one
        completion thread waits for them, releases their leases and settles the Futures. So calls issued back to
        back keep the copy engine busy: the next call's copies are queued while this one's run. (On the H200
        host, two pool threads that also waited for their copies left the copy engine idle while they started
        their next calls, and queued their copies slower than the copy engine ran them: each took the GIL from
        the other between two batches.) A call that waits for missing keys (``timeout``) holds up the calls
        after it, as a worker client's waiting request holds up its connection anyway. The Future is a
        :class:`~kvstrata.client.copies_future.CopiesFuture`: ``result()`` waits for the copies on the device. Its
        done-callbacks run on the completion thread: one must not wait there for another async call's result."""
        stream = self._caller_stream(stream, tensor_lists)
        future = CopiesFuture()

        def queue() -> None:
            if not future.set_running_or_notify_cancel():
                return
            if not self._backend.shm:  # (a worker over TCP: the whole call here, copies done when it returns)
                future.copies_queued(None)
                _settle(future, lambda: self.mget_h2d(keys, tensor_lists, timeout=timeout, stream=stream))
                return
            try:
                results, event, held = self._mget_h2d_queue(keys, tensor_lists, timeout=timeout, stream=stream)
            except BaseException as exc:
                future.set_exception(exc)
                return
            future.copies_queued(event)
            try:
                self._single("_completer", "kvstrata-complete").submit(self._complete, future, results, event, held)
            except RuntimeError:  # the interpreter is shutting down (no new threads): complete it here
                self._complete(future, results, event, held)

        self._b()
        self._single("_issuer", "kvstrata-issue").submit(queue)
        return future

    def _complete(self, future: concurrent.futures.Future, results: list[Result], event: Any, held: list[int]) -> None:
        """The end of an async :meth:`mget_h2d` (on the completion thread): wait for its copies, release its
        leases, settle its Future, whatever fails (a failed copy, or a release on a connection just lost, is the
        Future's exception, as :meth:`mget_h2d` would raise it)."""
        error: BaseException | None = None
        try:
            if event is not None:
                event.synchronize()
        except BaseException as exc:
            error = exc
        try:
            if held:
                self._release_leases(held)
        except BaseException as exc:
            error = error or exc
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(results)

    def _single(self, attr: str, name: str) -> concurrent.futures.ThreadPoolExecutor:
        """The client's one-thread executor kept at ``attr`` (``_issuer``, ``_completer``), made on first use."""
        with self._exec_lock:
            pool = getattr(self, attr)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=name, initializer=_mark_pool_thread, initargs=(self,)
                )
                setattr(self, attr, pool)
            return pool

    @staticmethod
    def _caller_stream(stream: Any, tensor_lists: Any) -> Any:
        # The current stream is per thread: the copies must follow the caller's, not the pool thread's.
        if stream is not None:
            return stream
        import torch

        # Malformed lists are passed over, not iterated into a bare TypeError ("'int' object is not iterable"): the
        # call's own checks name what is wrong, in its Future.
        if isinstance(tensor_lists, str | bytes | Mapping) or not isinstance(tensor_lists, Iterable):
            return None
        for ts in tensor_lists:
            if not isinstance(ts, list | tuple):
                continue
            for t in ts:
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    return torch.cuda.current_stream(t.device)
        return None
