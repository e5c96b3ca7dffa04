"""State shared by the device-object client's modules: same-process exports, receives in progress."""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

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


@dataclass(slots=True)
class Want:
    """A receive in progress: the caller's tensors and future."""

    key: str
    tensors: list[torch.Tensor]
    future: Future
    after: Any  # event on the caller's stream at call time (the buffers are free to write after it)
    tid: int | None = None
    transfer: dict[str, Any] | None = None
    chain: ChainLink | None = None  # broadcast: what the successor reads, kept until the broadcast ends
    chain_events: list[Any] | None = None  # broadcast: chunk-end events not yet seen complete


__all__ = ["LOCAL_EXPORTS", "Want", "settle"]
