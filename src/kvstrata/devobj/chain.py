"""One broadcast receiver's copy loop: chunk ``c`` is copied on once the predecessor has it.

A broadcast runs along a chain (``sender -> r0 -> r1 -> ...``, planned by the broker). Every receiver
cuts the object into the same chunks (:func:`plan_chunks`) and runs :func:`pump`: it enqueues the copy
of chunk ``c`` from its predecessor's buffers as soon as the predecessor's progress counter (a
:class:`~kvstrata.devobj.progress.Progress` in shared memory) passed ``c``, and advances its own counter
as each of its chunk copies completes (a local CUDA event per chunk, polled). So all receivers copy at
once, one chunk apart, and N receivers finish in about one copy plus ``N-1`` chunks instead of N copies.

Polling: the loop spins (``sleep(0)``, which releases the GIL) while things move, and backs off to
sleeps of up to 1 ms once nothing moved for :data:`SPIN_SECONDS`, so an idle wait costs no core.
Host cost per chunk is one ``copy_`` call, one event record and a few event queries; chunks are
enqueued one per round, with completed ones published in between, so a receiver whose predecessor is
far ahead (the first one: the sender is complete at once) still tells its successor early.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
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


def plan_chunks(tensors: list[dict[str, Any]], chunk: int) -> list[tuple[int, int, int]]:
    """``(tensor index, byte offset, bytes)`` of every chunk, in chain order (an empty tensor is one 0-byte chunk)."""
    return [
        (j, off, min(chunk, int(sp["nbytes"]) - off))
        for j, sp in enumerate(tensors)
        for off in range(0, max(int(sp["nbytes"]), 1), chunk)
    ]


def pump(
    n_chunks: int,
    enqueue: Callable[[int], Any],
    *,
    available: Callable[[], int],
    publish: Callable[[int], None] | None,
    aborted: Callable[[], BaseException | None],
    recycle: Callable[[Any], None] | None = None,
    timeout: float,
    what: str,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Copy ``n_chunks`` chunks in order as the predecessor makes them available; return when all are done.

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
    while complete < n_chunks:
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
        if complete >= n_chunks:
            break
        exc = aborted()
        if exc is not None:
            raise exc
        now = clock()
        if moved:
            last_move, pause = now, 0.0
        elif now - last_move > timeout:
            if pending:
                raise errors.Timeout(
                    f"{what}: the copy of chunk {complete} of {n_chunks} did not finish within {timeout:g} s "
                    "(a stuck copy or, with GPU-side waits, a predecessor that stopped)"
                )
            raise errors.Timeout(
                f"{what}: the predecessor has {max(avail, 0)} of {n_chunks} chunks and made no progress "
                f"for {timeout:g} s"
            )
        elif now - last_move > SPIN_SECONDS:
            pause = min(MAX_PAUSE, pause * 2 if pause else 5e-5)
        sleep(pause)


__all__ = ["MAX_PAUSE", "SPIN_SECONDS", "WINDOW", "plan_chunks", "pump"]
