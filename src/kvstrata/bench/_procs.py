"""Spawned GPU processes for device-object benchmarks and tests: clients, bounded waits, and a runner
that turns a crash, an error or a hang into one exception naming who failed and where.

``run_spawned([(fn, *args), ...], timeout)`` runs each ``fn(*args)`` in a process of its own (spawn:
CUDA needs it) and returns ``[(fn name, return value), ...]`` in the order they reported. On a failure
the children still running print every thread's stack to stderr (faulthandler on SIGUSR1) before the
:class:`ProcessFailure` is raised.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
import traceback
from typing import Any

#: this process's device-object clients, whose pending state a failed wait prints
CLIENTS: list = []


class ProcessFailure(RuntimeError):
    """A spawned process crashed, raised, or stayed silent past its deadline."""


def device_client(address: str, device: int, **config: Any):
    """A client of the worker at ``address`` with device objects on GPU ``device`` (``config``:
    :class:`~kvstrata.devobj.DeviceObjectConfig` fields)."""
    import torch

    import kvstrata
    from kvstrata.devobj import DeviceObjectConfig

    torch.cuda.set_device(device)
    c = kvstrata.connect(address)
    c.device_objects(device=device, config=DeviceObjectConfig(**config))
    CLIENTS.append(c)
    return c


def wait_future(f: Any, step: str, seconds: float, error: type[Exception] = RuntimeError) -> Any:
    """``f.result(seconds)``, failing with ``error`` naming the step, this process and its clients' pending state."""
    try:
        return f.result(seconds)
    except BaseException as exc:
        states = [c.device_objects().debug_state() for c in CLIENTS if c._devobj is not None]
        what = "no result" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise error(f"pid {os.getpid()} step {step!r}: {what} (within {seconds:g} s); clients: {states}") from exc


def get_queued(q: Any, step: str, seconds: float) -> Any:
    """A control-queue get with the step named when the other side sends nothing in time."""
    try:
        return q.get(timeout=seconds)
    except queue.Empty:
        what = f"the other side sent nothing within {seconds:g} s"
        raise RuntimeError(f"pid {os.getpid()} step {step!r}: {what}") from None


def _entry(fn: Any, q: Any, *args: Any) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash prints every thread's stack instead of vanishing
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks on a hang
    try:
        q.put(("ok", fn.__name__, fn(*args)))
    except BaseException:
        q.put(("err", fn.__name__, traceback.format_exc()))


def _dump_stacks(procs: list[Any]) -> None:
    """Have every child still running print all its threads' stacks to stderr."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    if alive:
        time.sleep(1.0)
        sys.stderr.flush()


def run_spawned(targets: list[tuple], timeout: float) -> list[tuple[str, Any]]:
    """Run ``(fn, *args)`` each in a spawned process; ``[(name, result), ...]`` as they report.

    Raises :class:`ProcessFailure` on a crash (exit code named), an error (its traceback) or a hang
    (nothing reported within ``timeout`` seconds), after the children still running dumped their stacks.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(t[0], q, *t[1:]), name=f"{t[0].__name__}#{i}") for i, t in enumerate(targets)
    ]
    for p in procs:
        p.start()
    out: list[tuple[str, Any]] = []
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(procs) and failure is None:
            try:
                status, name, value = q.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    failure = "crashed: " + ", ".join(f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in dead)
                elif time.monotonic() > deadline:
                    failure = f"hang: {len(procs) - len(out)} of {len(procs)} processes silent after {timeout:g} s"
                continue
            if status != "ok":
                failure = f"{name} failed:\n{value}"
            out.append((name, value))
        if failure is not None:
            _dump_stacks(procs)
            raise ProcessFailure(failure + "\n(stacks of the processes still running are on stderr)")
    finally:
        for p in procs:
            p.join(10 if failure is None else 1)
            if p.is_alive():
                p.kill()
    return out


__all__ = ["CLIENTS", "ProcessFailure", "device_client", "get_queued", "run_spawned", "wait_future"]
