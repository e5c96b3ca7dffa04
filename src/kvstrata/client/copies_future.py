"""The Future of an async host <-> device call (``Client.async_mget_h2d``).

Such a call ends when its copies end on the device, then its completion thread settles the Future. A caller
blocked in ``result()`` on a plain Future sleeps until that settle and then pays a thread wake-up: on the 2 x
H200 host ~200-340 us after the last copy ended (``tools/probe_async_calls.py``), a sixth of a 64 MiB call.
:class:`CopiesFuture` lets that caller wait for the copies themselves instead, the way the completion thread
does: once the call's copies are queued (:meth:`CopiesFuture.copies_queued`), a waiter without a timeout waits
for their end event in the CUDA driver (GIL released, no sleep on a condition variable), then polls briefly
for the settle that follows within microseconds (:class:`~kvstrata.devobj.futures.SpinFuture`'s polling:
only on hosts with enough CPUs, as there; elsewhere this is a plain Future).
"""

from __future__ import annotations

import threading
from typing import Any

from kvstrata.devobj.futures import SpinFuture, current_result_spin


class CopiesFuture(SpinFuture):
    """A Future whose waiters wait on the device for the call's copies (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._copies: Any = None  # the copies' end event, once queued (None: none to wait for)
        # Its own flag, not the Future's condition: a plain Future's waiter takes any notify for the end.
        self._queued = threading.Event()

    def copies_queued(self, event: Any) -> None:
        """Say the call's copies are queued, ending at ``event`` (a CUDA event; None: nothing on a device)."""
        self._copies = event
        self._queued.set()

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._queued.set()

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self._queued.set()

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._queued.set()
        return cancelled

    def result(self, timeout: float | None = None) -> Any:
        if timeout is None and current_result_spin() > 0.0 and not self.done():
            self._queued.wait()  # asleep while the call is queued or starts (its copies take longer)
            event = self._copies
            if event is not None and not self.done():
                event.synchronize()
        return super().result(timeout)


__all__ = ["CopiesFuture"]
