"""State shared by the device-object client's modules: same-process exports, receives in progress, the
specs of published and requested tensors."""

from __future__ import annotations

import os
import select
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstrata._proc import pid_alive
from kvstrata.devobj.ipc import spec

if TYPE_CHECKING:
    from kvstrata.devobj.broadcast import ChainLink

# Same-process exports (a peer in this process cannot open its own IPC handles): token -> (tensors, events).
LOCAL_EXPORTS: dict[str, tuple[list[torch.Tensor], list[Any]]] = {}


def settle(f: Future, exc: BaseException | None = None) -> None:
    """Complete ``f`` with None or ``exc``, unless something settled it first."""
    try:
        if exc is None:
            f.set_result(None)
        else:
            f.set_exception(exc)
    except InvalidStateError:  # already settled (e.g. the owner went away first)
        pass


class PidWatch:
    """Whether peer processes still live, checked after every copy from them: one ``poll`` of a pidfd
    kept per pid (~1 us) instead of ``kill(0)`` and a read of ``/proc/<pid>/stat`` (~25 us). A pidfd
    names the process, not the number: it turns readable once that process exited (a zombie too),
    even if its pid is reused. Where pidfds are missing (Linux < 5.3), :func:`pid_alive` answers.
    """

    def __init__(self, max_pids: int = 64) -> None:
        self._polls: OrderedDict[int, tuple[int, Any]] = OrderedDict()
        self._max = max_pids
        self._lock = threading.Lock()
        self._pidfd = hasattr(os, "pidfd_open")

    def alive(self, pid: int) -> bool:
        with self._lock:
            entry = self._polls.get(pid)
        if entry is None:
            if not self._pidfd:
                return pid_alive(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except OSError:  # not supported here, or out of descriptors
                return pid_alive(pid)
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            entry = (fd, poll)
            with self._lock:
                old = self._polls.pop(pid, None)
                # A new peer (rare): forget the ones that exited, whose keys vanished with them (one fd each)
                dead = [p for p, (_, pl) in self._polls.items() if pl.poll(0)]
                evicted = [self._polls.pop(p) for p in dead]
                self._polls[pid] = entry
                evicted += [self._polls.popitem(last=False)[1] for _ in range(len(self._polls) - self._max)]
            for e in ([old] if old else []) + evicted:
                os.close(e[0])
        with self._lock:  # a poll object takes one poll() at a time (RuntimeError otherwise)
            ready = entry[1].poll(0)
        if not ready:
            return True
        if ready[0][1] & select.POLLNVAL:  # closed under us (evicted, or close()): ask the slow way
            return pid_alive(pid)
        with self._lock:  # gone: forget it (a later process with this pid gets a pidfd of its own)
            if self._polls.get(pid) is entry:
                del self._polls[pid]
                os.close(entry[0])
        return False

    def close(self) -> None:
        with self._lock:
            entries, self._polls = list(self._polls.values()), OrderedDict()
        for fd, _ in entries:
            os.close(fd)


@dataclass(slots=True)
class Want:
    """A receive in progress: the caller's tensors and future."""

    key: str
    tensors: list[torch.Tensor]
    future: Future
    after: Any  # event on the caller's stream at call time (the buffers are free to write after it)
    tid: int | None = None
    running: bool = False  # the future was set running (by this module; a future not yet handed out)
    transfer: dict[str, Any] | None = None
    chain: ChainLink | None = None  # broadcast: what the successor reads, kept until the broadcast ends
    chain_events: list[Any] | None = None  # broadcast: chunk-end events not yet seen complete
    offer: Any = None  # (record, queued copies, end event) of a publisher's offer copied ahead of the match


_SPECS: dict[tuple[torch.Size, torch.dtype], list[dict[str, Any]]] = {}


def specs_of(tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The specs of a key's tensors; for one tensor, one list per (shape, dtype) kept for reuse (built once,
    never changed: a many-key call allocates nothing here)."""
    if len(tensors) != 1:
        return [spec(t) for t in tensors]
    t = tensors[0]
    sig = (t.shape, t.dtype)
    got = _SPECS.get(sig)
    if got is None:
        if len(_SPECS) >= 4096:  # many shapes: start over rather than grow without bound
            _SPECS.clear()
        got = _SPECS[sig] = [spec(t)]
    return got


__all__ = ["LOCAL_EXPORTS", "PidWatch", "Want", "settle", "specs_of"]
