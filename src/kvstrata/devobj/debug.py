"""Diagnostics for device objects: ``KVSTRATA_LOG`` logging, thread setup, bounded GPU waits.

``KVSTRATA_LOG=debug`` (or ``info``/``warning``) sends the ``kvstrata`` loggers to stderr with the
process id and thread name, in every process that creates a device-object client (spawned children
inherit the variable; importing the package changes no logging), so a failing multi-process GPU
run shows each side's steps interleaved.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from kvstrata import errors

_configured = False


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


def wait_event(event: Any, timeout: float, what: str, *, clock=time.monotonic, sleep=time.sleep) -> None:
    """Wait for a CUDA event with a deadline; :class:`~kvstrata.errors.Timeout` naming ``what`` past it.

    ``event.synchronize()`` cannot be bounded: a copy or a publishing stream that never finishes (a
    hung kernel, a peer gone mid-copy) would hang its thread (and the caller's future) forever.
    Spins briefly (small copies finish in microseconds), then polls with growing sleeps (at most
    1 ms), releasing the GIL in between.
    """
    if event.query():
        return
    start = clock()
    pause = 0.0
    while not event.query():
        now = clock()
        if now - start > timeout:
            raise errors.Timeout(
                f"{what}: GPU work not finished after {timeout:g} s (a source ready event that never fires, "
                "or a stuck copy)"
            )
        sleep(pause)
        pause = min(1e-3, pause * 2 if pause else 2e-5) if now - start > 1e-4 else 0.0


__all__ = ["configure_from_env", "wait_event"]
