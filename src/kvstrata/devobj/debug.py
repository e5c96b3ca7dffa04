"""Diagnostics for device objects: ``KVSTRATA_LOG`` logging, thread setup, bounded GPU waits.

``KVSTRATA_LOG=debug`` (or ``info``/``warning``) sends the ``kvstrata`` loggers to stderr with the
process id and thread name, in every process that creates a device-object client (spawned children
inherit the variable; importing the package changes no logging), so a failing multi-process GPU
run shows each side's steps interleaved.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import statistics
import sys
import threading
import time
from typing import Any

from kvstrata import errors

_configured = False

# ``KVSTRATA_DEVOBJ_TRACE=1``: the client's steps stamped with the monotonic clock in a bounded ring, so
# a benchmark can print where one call's time went (which thread, which step) without a profiler.
TRACING = os.environ.get("KVSTRATA_DEVOBJ_TRACE", "") not in ("", "0")
_trace: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=4096)


def trace(step: str) -> None:
    """Stamp ``step`` (no-op unless tracing); cheap enough for the data path."""
    if TRACING:
        _trace.append((time.perf_counter(), threading.current_thread().name, step))


def trace_take() -> list[tuple[float, str, str]]:
    """The stamps since the last take, oldest first, and forget them."""
    out = list(_trace)
    _trace.clear()
    return out


def trace_format(stamps: list[tuple[float, str, str]]) -> str:
    """One line per stamp: microseconds since the first, since the previous, thread, step."""
    if not stamps:
        return "(no trace: set KVSTRATA_DEVOBJ_TRACE=1)"
    t0 = prev = stamps[0][0]
    lines = []
    for t, thread, step in stamps:
        lines.append(f"{(t - t0) * 1e6:9.1f} us {(t - prev) * 1e6:+8.1f}  {thread[-18:]:>18}  {step}")
        prev = t
    return "\n".join(lines)


def trace_medians(rounds: list[list[tuple[float, str, str]]]) -> str:
    """Per step of many rounds' stamps, in order: the median microseconds since the round's first stamp
    (quoted keys in a step's text are folded, so the same step of every round counts as one)."""
    at: dict[tuple[str, str], list[float]] = {}
    for stamps in rounds:
        stamps = sorted(stamps)
        for t, th, step in stamps:
            at.setdefault((th, re.sub(r"'[^']*'", "'k'", step)), []).append((t - stamps[0][0]) * 1e6)
    order = sorted(at, key=lambda k: statistics.median(at[k]))
    return "\n".join(
        f"{statistics.median(at[k]):9.1f} us  {k[0][-22:]:>22}  {k[1]}  ({len(at[k])} rounds)" for k in order
    )


def configure_from_env() -> None:
    """Honour ``KVSTRATA_LOG`` once per process (no-op when unset)."""
    global _configured
    level = os.environ.get("KVSTRATA_LOG", "").strip().upper()
    if _configured or not level:
        return
    _configured = True
    logger = logging.getLogger("kvstrata")
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(asctime)s.%(msecs)03d pid %(process)d %(threadName)s %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level, logging.DEBUG))
    logger.propagate = False  # one line per record even where the root logger has a handler too


#: longest sleep between polls of a CUDA event: a copy that ends mid-sleep is noticed this late at most
MAX_POLL_SLEEP = 50e-6


class CopyRates:
    """The fastest rate seen so far per copy path, to guess how long the next copy on it takes.

    A fixed guess is wrong both ways: a guess below the link's rate makes :func:`wait_event` sleep past
    the copy's end (a 300 GB/s guess capped 2 GiB NVLink copies at ~330 GB/s, a third below the
    link's 393), one above it wastes the sleep. So the guess is what this process has seen: nothing
    (poll only) until a first copy on the path ended, then ``bytes / fastest`` scaled by ``margin``.
    """

    def __init__(self, margin: float = 0.8) -> None:
        self._best: dict[Any, float] = {}
        self._margin = margin
        self._lock = threading.Lock()

    def expected(self, path: Any, nbytes: int) -> float:
        """Seconds a copy of ``nbytes`` on ``path`` should at least take (0.0 while nothing is known)."""
        best = self._best.get(path)
        return nbytes / best * self._margin if best else 0.0

    def observe(self, path: Any, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` on ``path`` ended ``seconds`` after it was queued (an upper bound of its time)."""
        if seconds <= 0 or nbytes < (1 << 20):  # small copies measure latency, not the link
            return
        rate = nbytes / seconds
        with self._lock:
            if rate > self._best.get(path, 0.0):
                self._best[path] = rate


def wait_event(
    event: Any, timeout: float, what: str, *, expected: float = 0.0, clock=time.monotonic, sleep=time.sleep
) -> None:
    """Wait for a CUDA event with a deadline; :class:`~kvstrata.errors.Timeout` naming ``what`` past it.

    ``event.synchronize()`` cannot be bounded: a copy or a publishing stream that never finishes (a
    hung kernel, a peer gone mid-copy) would hang its thread (and the caller's future) forever.
    ``expected``: seconds the work should take (e.g. bytes / link bandwidth): most of it is slept
    in one go, then the event is polled with short sleeps (at most ``MAX_POLL_SLEEP``), releasing
    the GIL in between, so the end of a long copy is noticed within ~50 us, not a millisecond.
    """
    if event.query():
        return
    start = clock()
    if expected > 2e-4:
        sleep(expected * 0.9)
    pause = 0.0
    while not event.query():
        now = clock()
        if now - start > timeout:
            raise errors.Timeout(
                f"{what}: GPU work not finished after {timeout:g} s (a source ready event that never fires, "
                "or a stuck copy)"
            )
        sleep(pause)
        pause = min(MAX_POLL_SLEEP, pause * 2 if pause else 5e-6) if now - start > 2e-5 else 0.0


def brief(d: dict[str, Any]) -> dict[str, Any]:
    """An event or result without its bulky parts (records, exported handles), for debug logs."""
    out = {k: v for k, v in d.items() if k not in ("transfer", "pred", "uid")}
    t = d.get("transfer")
    if t:
        out["transfer"] = {k: t.get(k) for k in ("tid", "kind", "path", "src", "dst", "position")}
    return out


__all__ = ["CopyRates", "brief", "configure_from_env", "trace", "trace_format", "trace_take", "wait_event"]
