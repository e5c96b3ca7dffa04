"""What every kvstrata op shares: where it runs, argument checks, dtype tables, launch shapes.

Copies move bytes, so every kernel works on integer *words*: a tensor of any supported dtype is
reinterpreted as the widest integer type (up to 4 bytes) its row size and addresses allow, and a
thread moves ``vec`` consecutive words, which Triton turns into one 16-byte access when aligned.
Tile shapes live in :class:`TileConfig` so they can be tuned on a GPU without touching kernels.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.errors import InvalidType, InvalidValue

# Element types the ops accept; every copy treats them as raw bytes of their width.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(
    d
    for d in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.int8,
        torch.uint8,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )
    if d is not None
)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
WORD_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
MAX_WORD_BYTES = 4
VECTOR_BYTES = 16  # widest single load/store a thread issues


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_triton(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on these tensors: all on CUDA, or all on CPU when interpreting."""
    if not tensors or not have_triton():
        return False
    if all(t.device.type == "cuda" for t in tensors):
        return True
    return interpreting() and all(t.device.type == "cpu" for t in tensors)


# ------------------------------------------------------------------------------------- validators
def check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidType(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_dtype(t: torch.Tensor, name: str, allowed: Iterable[torch.dtype] = SUPPORTED_DTYPES) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise InvalidType(f"{name}: dtype {t.dtype} is not supported (supported: {names})")


def check_ndim(t: torch.Tensor, name: str, ndim: int) -> None:
    if t.dim() != ndim:
        raise InvalidValue(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise InvalidValue(f"{name}: must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def check_choice(value: object, name: str, choices: Iterable[object]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise InvalidValue(f"{name}: expected one of {choices}, got {value!r}")


def check_optional_positive_int(value: object, name: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidValue(f"{name}: expected a positive int or None, got {value!r}")


def check_no_overlap(a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    """ValueError when the byte ranges of ``a`` and ``b`` intersect (same device)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return
    a0, a1 = a.data_ptr(), a.data_ptr() + _span_bytes(a)
    b0, b1 = b.data_ptr(), b.data_ptr() + _span_bytes(b)
    if a0 < b1 and b0 < a1:
        raise InvalidValue(f"{names}: source and destination memory overlap")


def _span_bytes(t: torch.Tensor) -> int:
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


# ------------------------------------------------------------------------------------------ words
def _pow2_factor(n: int) -> int:
    return n & -n if n else 1 << 62


def word_bytes_for(*sizes_and_addresses: int, limit: int = MAX_WORD_BYTES) -> int:
    """The widest power-of-two word (<= ``limit`` bytes) dividing every given byte size/address."""
    g = min(_pow2_factor(int(x)) for x in sizes_and_addresses) if sizes_and_addresses else limit
    return min(g, limit)


def vec_words(word_bytes: int, *word_counts_and_offsets: int) -> int:
    """Words per thread access: up to 16 bytes, a power of two dividing every row size and offset (in words)."""
    g = min((_pow2_factor(int(x)) for x in word_counts_and_offsets), default=VECTOR_BYTES)
    return max(1, min(g, VECTOR_BYTES // word_bytes))


def as_words(t: torch.Tensor, word_bytes: int) -> torch.Tensor:
    """Reinterpret ``t`` (last dimension contiguous) as ``word_bytes``-wide integers; last dim shrinks."""
    if t.dim() == 0:
        t = t.reshape(1)
    u8 = t.view(torch.uint8) if t.element_size() != 1 or t.dtype != torch.uint8 else t
    return u8 if word_bytes == 1 else u8.view(WORD_DTYPES[word_bytes])


# ----------------------------------------------------------------------------------------- launch
@dataclass(frozen=True)
class TileConfig:
    """Tile shape of the copy kernels (tune on the GPU; see ``kvstrata bench gather --tile-bytes``).

    ``tile_bytes``: bytes one program moves per step (rows x words); ``num_warps``: warps per program;
    ``ctas_per_sm``: default grid = SMs x this (host-memory reads need many bytes in flight).
    """

    tile_bytes: int = 16384
    max_row_bytes: int = 4096
    num_warps: int = 4
    ctas_per_sm: int = 4

    def __post_init__(self) -> None:
        for name in ("tile_bytes", "max_row_bytes", "num_warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise InvalidValue(f"{name}: expected a positive power of two, got {value!r}")
        if not isinstance(self.ctas_per_sm, int) or self.ctas_per_sm <= 0:
            raise InvalidValue(f"ctas_per_sm: expected a positive int, got {self.ctas_per_sm!r}")


@dataclass(frozen=True)
class LaunchConfig:
    block_rows: int
    block_words: int
    num_warps: int
    grid: int
    tiles: int


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def launch_config(
    n_rows: int,
    row_words: int,
    word_bytes: int,
    *,
    device: torch.device,
    tile: TileConfig,
    num_ctas: int | None = None,
) -> LaunchConfig:
    """2-D tiles of ``block_rows`` x ``block_words`` words; a persistent grid capped by ``num_ctas``.

    Rows wider than ``tile.max_row_bytes`` are cut into column tiles (no limit on row size).
    """
    block_words = min(next_pow2(max(row_words, 1)), max(1, tile.max_row_bytes // word_bytes))
    block_rows = max(1, tile.tile_bytes // (block_words * word_bytes))
    block_rows = min(block_rows, next_pow2(max(n_rows, 1)))
    tiles = math.ceil(n_rows / block_rows) * math.ceil(max(row_words, 1) / block_words)
    if num_ctas is None:
        if device.type == "cuda":
            num_ctas = sm_count(device.index if device.index is not None else torch.cuda.current_device())
            num_ctas *= tile.ctas_per_sm
        else:
            num_ctas = 4  # the interpreter: a few programs exercise the persistent loop
    grid = max(1, min(tiles, num_ctas))
    return LaunchConfig(block_rows, block_words, tile.num_warps, grid, tiles)


def pinned_copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without blocking the host.

    Pinned (or registered) sources go straight; pageable ones through torch's pinned host cache,
    which keeps the staging buffer alive until the copy on the current stream has run.
    """
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw handle) -> torch's object for it


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)``, looked up by the raw handle (0.2 us on the H200 machine, where
    building the object cost 5.5 us per call). A raw handle names one stream for as long as it is
    cached: torch's pooled streams are never destroyed, and an external stream's object is its handle."""
    if _raw_stream is None:
        return torch.cuda.current_stream(index)
    key = (index, _raw_stream(index))
    got = _streams.get(key)
    if got is None:
        if len(_streams) >= 256:
            _streams.clear()
        got = _streams[key] = torch.cuda.current_stream(index)
    return got


class PlanCache:
    """Launch plans by call signature, bounded: emptied whole past ``limit`` entries (plans are cheap to rebuild
    and a server's signatures are few). A lookup is one dict read, no lock; stores take the lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._plans: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.get = self._plans.get  # the hot path: a bound dict method, no Python frame

    def put(self, key: tuple, plan: Any) -> None:
        with self._lock:
            if len(self._plans) >= self.limit:
                self._plans.clear()
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def values(self) -> Any:
        return self._plans.values()

    def __len__(self) -> int:
        return len(self._plans)


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is set: not None and, for a ``HookChain``, holding a call."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_launch(compiled: Any, nprog: int) -> Any:
    """``fire(args, stream)`` launching ``compiled`` on ``nprog`` programs with every kernel argument ``args``
    (in signature order) on the raw stream handle ``stream``.

    Triton's runner (``compiled[grid](*args, stream=...)``) passes through two Python frames that rebuild
    the same launch each time (scratch allocation, hooks); where this Triton's launcher has the known
    3.6 layout, needs no scratch memory and no launch hook is set, the C launch is called directly
    (~3 us less per call). Anything else uses the runner. Triton 3.6 keeps its hooks in always-present
    ``HookChain`` objects: an empty chain counts as no hook."""
    runner = compiled[(nprog, 1, 1)]
    try:
        import inspect

        from triton import knobs

        launcher = compiled.run
        params = list(inspect.signature(type(launcher).__call__).parameters)
        known = params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
        plain = (
            known
            and launcher.global_scratch_size == 0
            and launcher.profile_scratch_size == 0
            and not _hooked(knobs.runtime.launch_enter_hook)
            and not _hooked(knobs.runtime.launch_exit_hook)
        )
    except Exception:  # another Triton: its runner
        plain = False
    if not plain:
        return lambda args, stream: runner(*args, stream=stream)
    launch, function, meta = launcher.launch, compiled.function, compiled.packed_metadata
    coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl

    def fire(args: list[Any], stream: int) -> None:
        if _hooked(knobs.runtime.launch_enter_hook):  # a profiler set a hook since: Triton's own path
            runner(*args, stream=stream)
            return
        launch(nprog, 1, 1, stream, function, coop, pdl, None, None, meta, None, None, None, *args)

    return fire


__all__ = [
    "INDEX_DTYPES",
    "SUPPORTED_DTYPES",
    "LaunchConfig",
    "PlanCache",
    "TileConfig",
    "as_words",
    "check_choice",
    "check_contiguous",
    "check_dtype",
    "check_ndim",
    "check_no_overlap",
    "check_optional_positive_int",
    "check_tensor",
    "direct_launch",
    "interpreting",
    "launch_config",
    "next_pow2",
    "pinned_copy_to",
    "runs_triton",
    "vec_words",
    "word_bytes_for",
]
