"""Launch plans for ``gather``: what a call's table/out/ids signature decides, worked out once.

An eager ``gather`` of 1,024 rows moves 1 MiB in ~20 us of device time; the Python around it
(argument checks, registry lookups for host tables, device aliases, word views, the launch shape,
Triton's argument binding and pointer checks) used to cost several times that. A :class:`GatherPlan`
holds everything that depends only on the *signature* of a call: the data pointers, shapes, strides,
dtypes and devices of ``table`` and ``out``, the dtype, device and length of ``ids``, ``num_ctas``.
Later calls with the same signature skip the checks that signature already passed and launch the
compiled kernel straight from raw device addresses (``CompiledKernel[grid](..., stream=...)``, which
passes int pointers through Triton's launcher without its per-pointer driver queries).

A plan stays valid while it describes the memory it was built for:

* device tensors: a freed and reallocated tensor is still device memory at the address in the key;
* kvstrata-registered host memory: the registry's generation changes whenever a region is added or
  removed (freeing an ``alloc_pinned`` tensor removes its region), and a plan from another
  generation is rebuilt, so a table freed and replaced by unregistered memory at the same address is
  refused again, never read through a stale alias;
* host memory pinned by torch (not in the registry): ``is_pinned()`` is asked again on every call.

Plans hold no tensors (a cached plan never keeps a table alive), only ints and the Triton runner.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.errors import InvalidValue
from kvstrata.memory.pinned import device_alias, is_registered, registry_generation
from kvstrata.ops._common import (
    TileConfig,
    as_words,
    check_no_overlap,
    direct_launch,
    launch_config,
    pinned_copy_to,
    runs_triton,
    vec_words,
    word_bytes_for,
)

log = logging.getLogger(__name__)

MAX_PLANS = 512  # signatures kept; the cache is emptied when it grows past this (plans are cheap to rebuild)
_FLAT_GRID = (1 << 31) - 1
_raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_state = {"fast": True}  # cleared for the process if a direct launch ever fails (an incompatible Triton)


def plan_key(table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_ctas: int | None) -> tuple:
    """What a plan depends on (ids' address and values are not part of it: they change every call)."""
    return (
        table.data_ptr(),
        table.shape,
        table.stride(),
        table.dtype,
        table.device,
        out.data_ptr(),
        out.shape,
        out.stride(),
        out.dtype,
        out.device,
        ids.dtype,
        ids.device,
        ids.shape,
        ids.stride(),
        num_ctas,
    )


def _reachable(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if t.device.type == "cuda":
        return t
    try:
        return device_alias(t, device)
    except ValueError as exc:
        raise InvalidValue(f"{name}: a host tensor must be in registered or pinned memory ({exc})") from exc


def _outside_registry(t: torch.Tensor) -> bool:
    """A host tensor the GPU reaches only because torch pinned it (so the registry cannot vouch for it)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return False
    span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0) + 1) * t.element_size()
    return not is_registered(t.data_ptr(), span)


class GatherPlan:
    """One signature's launch: ``kind`` is ``"noop"``, ``"reference"`` (the CPU implementation) or ``"triton"``."""

    __slots__ = (
        "constexprs",
        "device",
        "device_index",
        "generation",
        "grid",
        "head",
        "ids_contiguous",
        "kind",
        "num_warps",
        "recheck_out",
        "recheck_table",
        "runners",
        "scalars",
        "schedule",
        "tail",
        "tile",
        "word",
    )

    def __init__(self, kind: str, tile: TileConfig, schedule: str, generation: int) -> None:
        self.kind = kind
        self.tile = tile
        self.schedule = schedule
        self.generation = generation
        self.device: torch.device | None = None
        self.device_index: int | None = None
        self.recheck_table = self.recheck_out = False
        self.ids_contiguous = True
        self.runners: dict[bool, Any] = {}  # ids pointer 16-byte aligned? -> Triton runner of that specialization

    def usable(self, table: torch.Tensor, out: torch.Tensor, tile: TileConfig, schedule: str) -> bool:
        """Still describes this call's memory and the module's current tuning."""
        return (
            self.tile is tile
            and self.schedule == schedule
            and self.generation == registry_generation()
            and (not self.recheck_table or table.is_pinned())
            and (not self.recheck_out or out.is_pinned())
        )

    # ------------------------------------------------------------------------------------ launch
    def launch(self, kernel: Any, table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor) -> None:
        """Run the kernel of a ``"triton"`` plan on this call's tensors (of the plan's signature)."""
        if not self.ids_contiguous:
            ids = ids.contiguous()
        if self.device is None:  # CPU tensors under the Triton interpreter
            self._launch_jit(kernel, table, out, ids)
            return
        if ids.device.type == "cpu" and not ids.is_pinned():
            ids = pinned_copy_to(ids, self.device)  # pageable: staged; pinned host ids are read in place
        ptr = ids.data_ptr()
        aligned = ptr % 16 == 0
        runner = self.runners.get(aligned)
        if runner is not None and _state["fast"]:
            index = self.device_index
            try:
                if torch.cuda.current_device() == index:
                    runner((*self.head, ptr, *self.tail), _raw_stream(index))
                else:
                    with torch.cuda.device(index):
                        runner((*self.head, ptr, *self.tail), _raw_stream(index))
                return
            except Exception as exc:  # any failure: fall back for good (a gather is safe to repeat)
                _state["fast"] = False
                log.warning("gather: direct kernel launch failed (%r); using Triton's launch path from now on", exc)
        self._launch_jit(kernel, table, out, ids, aligned)

    def _launch_jit(
        self, kernel: Any, table: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, aligned: bool = False
    ) -> None:
        if self.device is None:
            kernel[(self.grid,)](
                as_words(table, self.word), as_words(out, self.word), ids, *self.scalars,
                num_warps=self.num_warps, **self.constexprs,
            )  # fmt: skip
            return
        table_d = _reachable(table, "table", self.device)
        out_d = _reachable(out, "out", self.device)
        ids_d = ids if ids.device.type == "cuda" else device_alias(ids, self.device)
        with torch.cuda.device(self.device):
            compiled = kernel[(self.grid,)](
                as_words(table_d, self.word), as_words(out_d, self.word), ids_d, *self.scalars,
                num_warps=self.num_warps, **self.constexprs,
            )  # fmt: skip
            if compiled is not None and _raw_stream is not None and _state["fast"]:
                try:
                    self.runners[aligned] = direct_launch(compiled, self.grid)
                except Exception as exc:  # a Triton without the runner API
                    log.debug("gather: no direct launch (%r)", exc)


def build_plan(
    kernel: Any,
    table: torch.Tensor,
    out: torch.Tensor,
    ids: torch.Tensor,
    num_ctas: int | None,
    tile: TileConfig,
    schedule: str,
) -> GatherPlan:
    """The plan of this signature, after the checks that need addresses (registration, overlap).

    The caller has already checked shapes, dtypes and devices. Raises ValueError naming the argument.
    """
    generation = registry_generation()  # read before the lookups: a change meanwhile invalidates the plan
    if ids.shape[0] == 0 or table.shape[1] == 0:
        return GatherPlan("noop", tile, schedule, generation)
    if out.device.type == "cpu" and table.device.type == "cpu":
        check_no_overlap(table, out, "out")
        if not runs_triton(table, out, ids):
            return GatherPlan("reference", tile, schedule, generation)
        device, table_d, out_d = None, table, out
    else:
        device = out.device if out.device.type == "cuda" else table.device
        table_d = _reachable(table, "table", device)
        out_d = _reachable(out, "out", device)
        check_no_overlap(table_d, out_d, "out")
    plan = GatherPlan("triton", tile, schedule, generation)
    plan.device = device
    plan.device_index = None if device is None else device.index
    if device is not None:
        plan.recheck_table = _outside_registry(table)
        plan.recheck_out = _outside_registry(out)
    plan.ids_contiguous = ids.is_contiguous()

    elt = table.element_size()
    row_bytes = table.shape[1] * elt
    table_addr, out_addr = table_d.data_ptr(), out_d.data_ptr()
    word = word_bytes_for(row_bytes, table.stride(0) * elt, out.stride(0) * elt, table_addr, out_addr)
    row_words = row_bytes // word
    table_stride, out_stride = table.stride(0) * elt // word, out.stride(0) * elt // word
    vec = vec_words(word, row_words, table_stride, out_stride, table_addr // word, out_addr // word)
    if schedule == "flat" and num_ctas is None:
        num_ctas = _FLAT_GRID
    cfg = launch_config(ids.shape[0], row_words, word, device=out_d.device, tile=tile, num_ctas=num_ctas)
    plan.word, plan.grid, plan.num_warps = word, cfg.grid, cfg.num_warps
    plan.scalars = (ids.shape[0], table.shape[0], row_words, table_stride, out_stride)
    plan.constexprs = {
        "BLOCK_ROWS": cfg.block_rows,
        "BLOCK_WORDS": cfg.block_words,
        "VEC": vec,
        "EVEN_COLS": row_words % cfg.block_words == 0,
        "PREFETCH": schedule == "prefetch",
    }
    # A direct launch takes every kernel parameter, constexprs included, in signature order (what
    # Triton's own launch passes); ids' pointer changes per call, so it sits between head and tail.
    values = {"table_ptr": table_addr, "out_ptr": out_addr, "ids_ptr": None, **plan.constexprs}
    values.update(zip(("n_ids", "n_table_rows", "row_words", "table_stride", "out_stride"), plan.scalars, strict=True))
    names = kernel_arg_names(kernel)
    ordered = [values[name] for name in names]
    slot = names.index("ids_ptr")
    plan.head, plan.tail = tuple(ordered[:slot]), tuple(ordered[slot + 1 :])
    return plan


def kernel_arg_names(kernel: Any) -> tuple[str, ...]:
    """Parameter names of a ``triton.jit`` function (JIT or interpreted), in order."""
    fn = kernel.fn
    names = _ARG_NAMES.get(fn)
    if names is None:
        names = _ARG_NAMES[fn] = tuple(inspect.signature(fn).parameters)
    return names


_ARG_NAMES: dict[Any, tuple[str, ...]] = {}


__all__ = ["MAX_PLANS", "GatherPlan", "build_plan", "kernel_arg_names", "plan_key"]
