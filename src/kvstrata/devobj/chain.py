"""A broadcast leader's copy loop: pull chunk ``c`` once the predecessor has it, fan it out to the group.

A broadcast runs one copying process per GPU (planned by the broker, see
:mod:`kvstrata.devobj.broker`): receivers are grouped by GPU; each group's *leader* pulls the object
chunk by chunk from its predecessor (the sender, or the previous GPU's leader) with its own GPU's copy
engine and copies every chunk on to the other receivers of its group, its *members*, which issue no
copies at all. (Several processes copying on one GPU at once get time slices of it, not its speed:
on the H200 pair each got about half.) Every receiver cuts the object into the same chunks
(:func:`plan_chunks`, :func:`chunk_size`).

:func:`pump` is the leader's loop: it enqueues the pull of chunk ``c`` as soon as the predecessor's
progress counter (a :class:`~kvstrata.devobj.progress.Progress` in shared memory) passed ``c``, and
advances its own counter as each pull completes (a local CUDA event per chunk, polled).
:class:`FanOut` rides on it: members attach whenever their buffers arrive (catching up on what was
pulled before in one copy per tensor), every later chunk goes to all of them behind its pull's
event, and a member's own counter advances only once the copies into it completed. A member's loop
is :func:`pump` too, with nothing to enqueue: it waits for its counter to reach the chunk count.

Polling: the loop spins (``sleep(0)``, which releases the GIL) while things move, and backs off to
sleeps of up to 1 ms once nothing moved for :data:`SPIN_SECONDS`, so an idle wait costs no core.
Host cost per chunk is one copy call and one event record for the pull, one stream wait, one copy
per member and one event for the fan-out, and a few event queries.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata import errors
from kvstrata.devobj.debug import trace

#: keep spinning this long after the last progress before backing off to sleeps
SPIN_SECONDS = 2e-3
#: longest sleep between polls once backed off
MAX_PAUSE = 1e-3
#: chunk copies queued ahead of the last one seen complete: enough to keep the copy engine busy
#: between polls, few enough that progress is still published a chunk or so after it happens
WINDOW = 4
#: big objects are cut into about this many chunks (fewer host calls per byte) ...
TARGET_CHUNKS = 32
#: ... of at most this size, so a chain still pipelines (128 MiB is ~0.33 ms over NVLink)
MAX_AUTO_CHUNK = 128 << 20


def chunk_size(tensors: list[dict[str, Any]], requested: int) -> int:
    """The chunk every receiver of a broadcast uses: ``requested`` at least, larger for big objects
    (about :data:`TARGET_CHUNKS` chunks, a power of two, up to :data:`MAX_AUTO_CHUNK`).

    A function of the record alone, so all receivers agree. The host spends tens of microseconds per
    chunk and member; 32 MiB chunks of 8 GiB were 256 rounds of that for each process.
    """
    total = sum(int(sp["nbytes"]) for sp in tensors)
    want = 1 << max(0, (total // TARGET_CHUNKS) - 1).bit_length()
    return max(requested, min(want, MAX_AUTO_CHUNK))


def plan_chunks(tensors: list[dict[str, Any]], chunk: int) -> list[tuple[int, int, int]]:
    """``(tensor index, byte offset, bytes)`` of every chunk, in chain order (an empty tensor is one 0-byte chunk)."""
    return [
        (j, off, min(chunk, int(sp["nbytes"]) - off))
        for j, sp in enumerate(tensors)
        for off in range(0, max(int(sp["nbytes"]), 1), chunk)
    ]


def spans(plan: list[tuple[int, int, int]], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Chunks ``[start, stop)`` of ``plan`` merged into one ``(tensor, offset, bytes)`` range per tensor."""
    out: list[tuple[int, int, int]] = []
    for j, off, n in plan[start:stop]:
        if out and out[-1][0] == j and out[-1][1] + out[-1][2] == off:
            out[-1] = (j, out[-1][1], out[-1][2] + n)
        elif n:
            out.append((j, off, n))
    return out


@dataclass(eq=False)
class Member:
    """A group member as its leader sees it: where its bytes go and how it hears that they landed.

    ``target`` is whatever the leader's copy function needs (its buffers); ``publish(k)`` tells the
    member that its first ``k`` chunks are complete; ``fail()`` that the leader stopped writing.
    """

    position: int
    target: Any
    publish: Callable[[int], None]
    fail: Callable[[], None]
    close: Callable[[], None] = lambda: None
    queued: int = 0  # leading chunks whose copies into this member are queued
    landed: int = 0  # leading chunks published to it


class FanOut:
    """The leader's copies of each pulled chunk on to its group's members (see the module doc).

    ``attach()`` returns members that arrived since the last call (it may raise: the broadcast fails).
    ``copy(members, start, stop, after)`` queues chunks ``[start, stop)`` of the leader's buffers into
    each member's, behind ``after`` (the event of the last of those chunks' pulls; None when they are
    complete) and returns an event marking their end (None: done already, on the CPU).
    """

    def __init__(
        self,
        expected: int,
        *,
        attach: Callable[[], list[Member]],
        copy: Callable[[list[Member], int, int, Any], Any],
        recycle: Callable[[Any], None] | None = None,
    ) -> None:
        self.expected = expected
        self.members: list[Member] = []
        self._attach = attach
        self._copy = copy
        self._recycle = recycle
        self.pending: deque[tuple[Any, list[tuple[Member, int]]]] = deque()

    def feed(self, queued: int, after: Any) -> bool:
        """Attach arrivals; queue, for every member, the chunks of the first ``queued`` pulled it lacks."""
        moved = False
        if len(self.members) < self.expected:
            for m in self._attach():
                self.members.append(m)
                trace(f"member at position {m.position} attached after {queued} chunks")
                moved = True
        by_start: dict[int, list[Member]] = {}
        for m in self.members:
            if m.queued < queued:
                by_start.setdefault(m.queued, []).append(m)
        for start, group in by_start.items():
            ev = self._copy(group, start, queued, after)
            for m in group:
                m.queued = queued
            self.pending.append((ev, [(m, queued) for m in group]))
            moved = True
        return moved

    def reap(self) -> bool:
        """Tell members of their copies that completed (in queue order); True when any did."""
        moved = False
        while self.pending and (self.pending[0][0] is None or self.pending[0][0].query()):
            ev, marks = self.pending.popleft()
            if ev is not None and self._recycle is not None:
                self._recycle(ev)
            for m, k in marks:
                if k > m.landed:
                    m.landed = k
                    m.publish(k)  # after the copies' end event: the member finds chunks < k in its buffers
            moved = True
        return moved

    def finished(self, n_chunks: int) -> bool:
        return len(self.members) >= self.expected and all(m.landed >= n_chunks for m in self.members)

    def events(self) -> list[Any]:
        """End events handed out and not yet seen complete, oldest first."""
        return [ev for ev, _ in self.pending if ev is not None]

    def stop(self) -> None:
        """The leader gave up, its queued copies drained: tell every attached member to stop waiting."""
        for m in self.members:
            m.fail()

    def close(self) -> None:
        for m in self.members:
            m.close()


def pump(
    n_chunks: int,
    enqueue: Callable[[int], Any],
    *,
    available: Callable[[], int],
    publish: Callable[[int], None] | None,
    aborted: Callable[[], BaseException | None],
    recycle: Callable[[Any], None] | None = None,
    fanout: FanOut | None = None,
    timeout: float,
    what: str,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Copy ``n_chunks`` chunks in order as the predecessor makes them available; return when all are
    done (and, with ``fanout``, every member attached and has every chunk).

    ``enqueue(c)`` starts chunk ``c`` and returns an object with ``query() -> bool`` (a CUDA event)
    or ``None`` when the copy is already complete (CPU). ``available()`` is how many leading chunks
    the predecessor has complete (negative: it failed). ``publish(k)`` is called with each new count
    of complete leading chunks of this receiver (never before the copy of those chunks finished).
    ``aborted()`` returns the error that ends the broadcast early (the broker aborted it), if any.
    ``recycle(event)`` takes back each completed event. Raises :class:`~kvstrata.errors.Timeout`
    when nothing moves for ``timeout`` seconds, naming ``what`` and where the chain stopped.
    """
    pending: deque[Any] = deque()
    enqueued = complete = 0
    last_move = clock()
    pause = 0.0
    while True:
        moved = False
        avail = available()
        if avail < 0:
            raise errors.ServerError(f"{what}: the predecessor's copy failed (broadcast aborted)")
        while enqueued < min(avail, n_chunks, complete + WINDOW):
            if enqueued in (0, n_chunks - 1):
                trace(f"{what}: chunk {enqueued} of {n_chunks} queued")
            pending.append(enqueue(enqueued))
            enqueued += 1
            moved = True
        if fanout is not None:
            # Behind the newest pull still running (None: every queued pull is complete).
            last = next((ev for ev in reversed(pending) if ev is not None), None)
            moved |= fanout.feed(enqueued, last)
        k = complete
        while pending and (pending[0] is None or pending[0].query()):
            ev = pending.popleft()
            if ev is not None and recycle is not None:
                recycle(ev)
            k += 1
        if k != complete:
            complete = k
            moved = True
            if publish is not None:
                # After the events completed: a reader that sees k finds chunks < k in our buffers.
                publish(complete)
            if complete in (1, n_chunks):
                trace(f"{what}: {complete} of {n_chunks} chunks complete")
        if fanout is not None:
            moved |= fanout.reap()
        if complete >= n_chunks and (fanout is None or fanout.finished(n_chunks)):
            break
        exc = aborted()
        if exc is not None:
            raise exc
        now = clock()
        if moved:
            last_move, pause = now, 0.0
        elif now - last_move > timeout:
            raise _stalled(what, n_chunks, complete, avail, bool(pending), fanout, timeout)
        elif now - last_move > SPIN_SECONDS:
            pause = min(MAX_PAUSE, pause * 2 if pause else 5e-5)
        sleep(pause)


def _stalled(
    what: str, n: int, complete: int, avail: int, copying: bool, fanout: FanOut | None, timeout: float
) -> errors.Timeout:
    if copying:
        return errors.Timeout(
            f"{what}: the copy of chunk {complete} of {n} did not finish within {timeout:g} s "
            "(a stuck copy or, with GPU-side waits, a predecessor that stopped)"
        )
    if complete < n:
        return errors.Timeout(
            f"{what}: the predecessor has {max(avail, 0)} of {n} chunks and made no progress for {timeout:g} s"
        )
    if fanout is not None and fanout.pending:
        return errors.Timeout(f"{what}: the copies to the group's members did not finish within {timeout:g} s")
    missing = fanout.expected - len(fanout.members) if fanout is not None else 0
    return errors.Timeout(f"{what}: {missing} group member(s) did not send their buffers within {timeout:g} s")


__all__ = [
    "MAX_AUTO_CHUNK",
    "MAX_PAUSE",
    "SPIN_SECONDS",
    "TARGET_CHUNKS",
    "WINDOW",
    "FanOut",
    "Member",
    "chunk_size",
    "plan_chunks",
    "pump",
    "spans",
]
