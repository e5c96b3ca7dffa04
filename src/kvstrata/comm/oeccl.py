"""The seed's (openEuler oeccl) function names as thin wrappers over :class:`HybridAllGather`.

One module-level instance, as in the seed::

    init_oeccl(None, is_huge=False, ratio=8, numa_map=None, is_async=True)
    token = oeccl_allgather(out, inp)
    wait_event_on_stream(torch.cuda.current_stream(), token)
    oeccl_cleanup()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from kvstrata.comm.hybrid import HybridAllGather, Token

_state: dict[str, object] = {}


def init_oeccl(
    comm: dist.ProcessGroup | None = None,
    is_huge: bool | str = "auto",
    ratio: int | str | None = 8,
    numa_map: Sequence[int] | Mapping[int, int] | None = None,
    is_async: bool = False,
) -> HybridAllGather:
    """Create the module's all-gather on group ``comm`` (replacing an earlier one) and return it."""
    oeccl_cleanup()
    _state["ag"] = HybridAllGather(comm, ratio=ratio, hugepages=is_huge, numa_map=numa_map)
    _state["async"] = bool(is_async)
    return _state["ag"]  # type: ignore[return-value]


def oeccl_allgather(out: torch.Tensor, inp: torch.Tensor) -> Token | None:
    """All-gather ``inp`` into ``out``; a :class:`Token` when ``init_oeccl(..., is_async=True)``."""
    ag = _state.get("ag")
    if ag is None:
        raise RuntimeError("oeccl_allgather: call init_oeccl first")
    return ag.all_gather(out, inp, async_op=bool(_state["async"]))  # type: ignore[union-attr]


def wait_event_on_stream(stream: torch.cuda.Stream | None, event: Token | torch.cuda.Event | None) -> None:
    """Make ``stream`` wait for ``event`` (a :class:`Token` from oeccl_allgather, or a CUDA event)."""
    if event is None:
        return
    if isinstance(event, Token):
        event.wait(stream)
    else:
        (stream or torch.cuda.current_stream()).wait_event(event)


def oeccl_cleanup() -> None:
    """Close the module's all-gather (segments, helper thread); safe to call twice."""
    ag = _state.pop("ag", None)
    if ag is not None:
        ag.close()  # type: ignore[union-attr]


__all__ = ["init_oeccl", "oeccl_allgather", "oeccl_cleanup", "wait_event_on_stream"]
