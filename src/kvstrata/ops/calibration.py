"""``method="auto"``: which transfer method to use, measured once per device and cached on disk.

:func:`calibrate` times every method (``copy_engine``, ``staging``, ``zero_copy``) in each direction over
chunk sizes 2 KiB..2 MiB, for bulk transfers (256 MiB of scattered blocks, 64 segments) and for one
request's blocks (one block, at most ``SMALL_BYTES``), plus a store and a load at once for the pairs of
methods that could win, and writes ``calibration-<key>.json`` under ``$KVSTRATA_CACHE_DIR`` (default
``~/.cache/kvstrata``). The key is the device name, capability, SM count, driver, torch/triton/CUDA
versions and ``FORMAT``: a new GPU, driver, library or measuring method is measured again. The first
``auto`` call on a GPU calibrates when no file exists (~7 s on an H200; ``KVSTRATA_AUTO_CALIBRATE=0`` uses the
static rule instead), never while a CUDA graph is being captured.

How it measures (why the rates agree with ``kvstrata bench transfer``): on a stream of its own; bulk
rates *streamed*, ``STREAM_CALLS`` calls back to back per sample, as an engine issues them (one call
timed alone pays the staging pipeline's fill and drain: FORMAT 2 measured staging 13% low at 2 KiB);
``SAMPLES`` samples per method, the methods interleaved, the median kept; a method below
``HOPELESS`` of the best after one call is not sampled further (copy_engine at 2 KiB chunks).

:func:`choose_method` applies :mod:`kvstrata.ops.auto_policy` (SM-frugal: ``copy_engine``, then
``staging``, and ``zero_copy`` for bulk only where it wins by far) to these rates, log-interpolated in
chunk size.

Static rule (no calibration): <= 4 MiB in all -> ``zero_copy`` (one kernel, lowest latency); chunks
>= 1 MiB -> ``copy_engine``; otherwise ``staging``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import threading
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.errors import InvalidValue, KvstrataError
from kvstrata.ops import auto_policy
from kvstrata.ops.auto_policy import PREFERENCE, SMALL_BYTES, TOLERANCE

CHUNK_SIZES = (2048, 8192, 32768, 131072, 524288, 2097152)
BULK_BYTES = 256 << 20  # eight 32 MiB staging pieces per call, as in real offload batches
NSEG = 64  # segments of the measured cache: 32 layers x K/V
PAIR_SHORTLIST = 0.7  # two-direction pairs are timed for methods within 70% of the best alone
STREAM_CALLS = 3  # calls back to back per bulk sample (see the module docstring)
SAMPLES = 3  # bulk samples per method (median); small points take SMALL_SAMPLES isolated calls
SMALL_SAMPLES = 7
HOPELESS = 0.5  # below half the best rate after one call: not sampled further
# Bumped when what is measured or how changes (3: streamed, repeated, small at <= 4 MiB; 4: staging's host issue
# ~10x cheaper, so the store+load pairs measured before, when a staging call's issue delayed the other
# direction by ~1 ms, no longer describe it).
FORMAT = 4

Points = dict[str, dict[str, dict[str, list[list[float]]]]]  # direction -> method -> regime -> [[chunk, GB/s]]


def cache_dir() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE_DIR") or Path.home() / ".cache" / "kvstrata")


def device_key(device: torch.device | None = None) -> dict[str, Any]:
    """What a calibration is valid for: the GPU, its driver and the software stack."""
    import triton

    props = torch.cuda.get_device_properties(_index(device))
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "format": FORMAT,
    }


def _driver_version() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    from kvstrata.ops import copy_engine

    rt = copy_engine._runtime()
    if rt is not None:
        return str(rt.cudaDriverGetVersion()[1])
    return "unknown"


def cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"calibration-{digest}.json"


@dataclass(frozen=True)
class Calibration:
    """Measured GB/s by direction, method, regime ("bulk"/"small") and chunk size."""

    key: dict[str, Any]
    points: Points

    def gbps(self, direction: str, method: str, chunk_bytes: int, n_chunks: int) -> float | None:
        regime = "small" if chunk_bytes * n_chunks <= SMALL_BYTES else "bulk"
        pts = sorted(self.points.get(direction, {}).get(method, {}).get(regime, []))
        if not pts:
            return None
        x = math.log2(max(chunk_bytes, 1))
        xs = [math.log2(c) for c, _ in pts]
        if x <= xs[0]:
            return pts[0][1]
        if x >= xs[-1]:
            return pts[-1][1]
        for (x0, (_, y0)), (x1, (_, y1)) in zip(zip(xs, pts), zip(xs[1:], pts[1:])):
            if x0 <= x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return None

    def rates(
        self, direction: str, chunk_bytes: int, n_chunks: int, methods: Collection[str] = PREFERENCE
    ) -> dict[str, float]:
        """``{method: GB/s}`` measured (interpolated) for this call's shape; methods never measured are left out."""
        got = {m: self.gbps(direction, m, chunk_bytes, n_chunks) for m in PREFERENCE if m in methods}
        return {m: r for m, r in got.items() if r is not None}

    def pair_rates(self, chunk_bytes: int) -> dict[tuple[str, str], float]:
        """``{(d2h method, h2d method): GB/s of both directions together}`` at this chunk size (bulk)."""
        out = {}
        for name, regimes in self.points.get("both", {}).items():
            sizes = [c for c, _ in regimes.get("bulk", [])]
            # Pairs are measured over different chunk ranges (copy_engine ones from 128 KiB only): a pair
            # not measured within a factor of 2 of this chunk is unknown here, never extrapolated (copy_engine
            # +staging at 128 KiB, 88.5 GB/s, once stood in for 32 KiB, where the pair runs at 58).
            if not sizes or not min(sizes) / 2 <= chunk_bytes <= max(sizes) * 2:
                continue
            d2h, _, h2d = name.partition("+")
            rate = self.gbps("both", name, chunk_bytes, 1 << 30)
            if rate is not None:
                out[(d2h, h2d)] = rate
        return out

    def best(
        self, direction: str, chunk_bytes: int, n_chunks: int, methods: Collection[str] = PREFERENCE
    ) -> str | None:
        """The policy's choice for one direction alone (:func:`kvstrata.ops.auto_policy.pick`); None: no data."""
        return auto_policy.pick(self.rates(direction, chunk_bytes, n_chunks, methods),
                                bulk=chunk_bytes * n_chunks > SMALL_BYTES)  # fmt: skip

    def best_pair(self, chunk_bytes: int, methods: Collection[str] = PREFERENCE) -> tuple[str, str] | None:
        """(d2h method, h2d method) for a store and a load at once (:func:`kvstrata.ops.auto_policy.pick_pair`)."""
        pairs = {p: r for p, r in self.pair_rates(chunk_bytes).items() if p[0] in methods and p[1] in methods}
        return auto_policy.pick_pair(pairs)

    def choose(
        self,
        direction: str,
        chunk_bytes: int,
        n_chunks: int,
        methods: Collection[str] = PREFERENCE,
        *,
        concurrent: bool = False,
        other: str | None = None,
    ) -> str | None:
        """The full policy for one call; None where nothing was measured for it.

        * small (<= ``SMALL_BYTES``): :meth:`best`.
        * bulk, ``other`` (the method of a transfer the other way now in flight): the method that does
          best *beside it* (two-direction points), when those were measured.
        * bulk, ``concurrent``: this direction's side of :meth:`best_pair`.
        * bulk alone: the side of :meth:`best_pair` when it is within ``TOLERANCE`` of the best alone
          (so a load that starts later finds the store on the method of the best pair, whoever
          started first), else :meth:`best`.
        """
        bulk = chunk_bytes * n_chunks > SMALL_BYTES
        rates = self.rates(direction, chunk_bytes, n_chunks, methods)
        single = auto_policy.pick(rates, bulk=bulk)
        if single is None or not bulk:
            return single
        side = 0 if direction == "d2h" else 1
        if other is not None:
            beside = {}
            for (d2h, h2d), rate in self.pair_rates(chunk_bytes).items():
                mine, theirs = (d2h, h2d) if side == 0 else (h2d, d2h)
                if theirs == other and mine in methods:
                    beside[mine] = rate
            got = auto_policy.pick(beside, bulk=True)
            if got is not None:
                return got
        pairs = {p: r for p, r in self.pair_rates(chunk_bytes).items() if p[side] in methods}
        pair = auto_policy.pick_pair(pairs)
        if pair is None:
            return single
        if concurrent:
            return pair[side]
        ok = auto_policy.eligible(rates, bulk=True)
        if pair[side] in ok and ok[pair[side]] >= TOLERANCE * max(ok.values()):
            return pair[side]
        return single


_lock = threading.RLock()
_memo: dict[int, Calibration | None] = {}  # device index -> calibration (None: use the static rule)
_choices: dict[tuple, str] = {}  # choose_method's answers (multi_layer_block_transfer has no launch plans)
MAX_CHOICES = 4096


def calibrate(
    device: torch.device | int | None = None,
    force: bool = False,
    *,
    measure: Callable[[torch.device], Points] | None = None,
    key: dict[str, Any] | None = None,
) -> Calibration:
    """Load this device's calibration from the cache, or measure and cache it (``force=True``: always measure).

    ``measure`` replaces the timing function and ``key`` the device key (tests pass fakes). Needs a CUDA device
    (``InvalidValue`` without one: on CPU, ``method="auto"`` has nothing to choose between).
    """
    if key is None and not torch.cuda.is_available():
        raise InvalidValue("calibrate: needs a CUDA device (none is available); nothing to calibrate on CPU")
    dev = torch.device("cuda", _index(device)) if key is None else torch.device("cpu")
    key = key if key is not None else device_key(dev)
    path = cache_path(key)
    with _lock:
        cal = None if force else _load(path, key)
        if cal is None:
            cal = Calibration(key, (measure or _measure)(dev))
            _save(path, cal)
        if dev.type == "cuda":
            _memo[dev.index] = cal
            _choices.clear()
        return cal


def _load(path: Path, key: dict[str, Any]) -> Calibration | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key or not isinstance(data.get("points"), dict):
        return None
    return Calibration(key, data["points"])


def _save(path: Path, cal: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
    with os.fdopen(fd, "w") as f:
        json.dump({"key": cal.key, "points": cal.points}, f, indent=1)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def static_rule(direction: str, chunk_bytes: int, n_chunks: int) -> str:
    """The documented choice without a calibration (see the module docstring)."""
    if chunk_bytes * n_chunks <= SMALL_BYTES:
        return "zero_copy"
    return "copy_engine" if chunk_bytes >= 1 << 20 else "staging"


def choose_method(
    direction: str,
    chunk_bytes: int,
    n_chunks: int,
    *,
    device: torch.device | int | None = None,
    methods: Collection[str] | None = None,
    concurrent: bool = False,
    other: str | None = None,
) -> str:
    """The method ``auto`` uses for ``n_chunks`` chunks of ``chunk_bytes`` in ``direction`` ("d2h"/"h2d").

    ``"torch"`` off CUDA. ``methods`` restricts the candidates (e.g. ``{"zero_copy", "staging"}`` for an
    op without a copy-engine path). ``concurrent=True``: a transfer in the other direction runs at the
    same time, so a bulk transfer takes its side of the pair of methods measured best *together*;
    ``other`` names that transfer's method when known (the choice is then the best beside it). The
    policy (:mod:`kvstrata.ops.auto_policy`) is SM-frugal: ``copy_engine``, then ``staging``, whenever
    within 2% of the fastest; ``zero_copy`` for one request's blocks, and for bulk only where it wins by
    far. Example: ``choose_method("h2d", 32768, 64 * 1024)``.
    """
    if direction not in ("d2h", "h2d"):
        raise InvalidValue(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    dev = torch.device(device) if isinstance(device, (str, torch.device)) else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        return "torch"
    idx = _index(device)
    memo_key = (idx, direction, chunk_bytes, n_chunks, None if methods is None else frozenset(methods),
                concurrent, other)  # fmt: skip
    got = _choices.get(memo_key)
    if got is not None:
        return got
    candidates = tuple(m for m in _available() if methods is None or m in methods)
    if not candidates:
        raise InvalidValue(f"methods: none of {PREFERENCE} in {methods!r}")
    if idx not in _memo and not torch.cuda.is_current_stream_capturing():
        _memo[idx] = _load_or_calibrate(idx)
    cal = _memo.get(idx)
    choice = None
    if cal is not None:
        choice = cal.choose(direction, chunk_bytes, n_chunks, candidates, concurrent=concurrent, other=other)
    if choice is None:
        choice = static_rule(direction, chunk_bytes, n_chunks)
        if choice not in candidates:
            choice = "staging" if "staging" in candidates else candidates[-1]
    if idx in _memo:  # a static choice made before the calibration loaded is not remembered
        if len(_choices) >= MAX_CHOICES:
            _choices.clear()
        _choices[memo_key] = choice
    return choice


def _load_or_calibrate(idx: int) -> Calibration | None:
    key = device_key(torch.device("cuda", idx))
    cal = _load(cache_path(key), key)
    if cal is None and os.environ.get("KVSTRATA_AUTO_CALIBRATE", "1") != "0":
        try:
            cal = calibrate(idx, key=None)
        except (RuntimeError, OSError, ValueError, KvstrataError) as exc:  # must not stop the transfer itself
            warnings.warn(f"kvstrata: calibration failed ({exc}); method='auto' uses the static rule", stacklevel=3)
    return cal


def _available() -> tuple[str, ...]:
    """Methods that can run here (``copy_engine`` needs cuda-bindings), in preference order."""
    from kvstrata.ops import copy_engine

    return PREFERENCE if copy_engine._runtime() is not None else tuple(m for m in PREFERENCE if m != "copy_engine")


def _index(device: torch.device | int | str | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _measure(device: torch.device) -> Points:
    """Time each method (see the module docstring) on a cache of ``NSEG`` segments, on a stream of its own.

    Bulk: ``BULK_BYTES`` of scattered device blocks <-> consecutive host blocks (block_first). Small: one
    block of ``min(NSEG, SMALL_BYTES // chunk)`` segments, isolated calls. Both directions at once:
    ``points["both"]["<d2h method>+<h2d method>"]["bulk"]``, GB/s of the two together.
    """
    from kvstrata.memory import alloc_pinned

    points: Points = {d: {m: {"bulk": [], "small": []} for m in PREFERENCE} for d in ("d2h", "h2d")}
    points["both"] = {}
    methods = _available()
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        # One set of buffers for every chunk size (views of them): a load beside a store needs two.
        dev_bytes = BULK_BYTES + BULK_BYTES // 4 + NSEG * CHUNK_SIZES[-1]
        bufs = [(torch.zeros(dev_bytes, dtype=torch.uint8, device=device), alloc_pinned(BULK_BYTES)) for _ in range(2)]
        for chunk in CHUNK_SIZES:
            nseg_small = max(1, min(NSEG, SMALL_BYTES // chunk))
            small = _setup(*bufs[0], chunk, 1, nseg_small)
            for direction in ("d2h", "h2d"):
                for method, rate in _rates(small, direction, methods, streamed=False).items():
                    points[direction][method]["small"].append([chunk, rate])
            n = max(1, BULK_BYTES // (NSEG * chunk))
            store, load = _setup(*bufs[0], chunk, n, NSEG), _setup(*bufs[1], chunk, n, NSEG)
            shortlist = {}
            for direction in ("d2h", "h2d"):
                rates = _rates(store, direction, methods, streamed=True)
                for method, rate in rates.items():
                    points[direction][method]["bulk"].append([chunk, rate])
                shortlist[direction] = [m for m, r in rates.items() if r >= PAIR_SHORTLIST * max(rates.values())]
            pairs = {
                f"{x}+{y}": lambda x=x, y=y, a=store, b=load: store_and_load(a, b, x, y)
                for x in shortlist["d2h"]
                for y in shortlist["h2d"]
            }
            for name, rate in _sampled(pairs, 2 * NSEG * n * chunk, streamed=True).items():
                points["both"].setdefault(name, {"bulk": [], "small": []})["bulk"].append([chunk, rate])
    return points


def _setup(dev_buf: torch.Tensor, host_buf: torch.Tensor, chunk: int, n: int, nseg: int) -> tuple:
    """``transfer_blocks`` arguments over views of the buffers: ``nseg`` segments of ``n + n/4`` device blocks
    (``n`` scattered ones moved, in random order, as an engine's block lists come) and ``n`` host blocks."""
    from kvstrata.ops.kv_layout import HostPool, KVLayout

    blocks = n + max(1, n // 4)
    caches = [dev_buf[i * blocks * chunk : (i + 1) * blocks * chunk].view(blocks, 1, chunk) for i in range(nseg)]
    layout = KVLayout.from_mla(caches)
    pool = HostPool(host_buf[: n * nseg * chunk], "block_first", nseg, chunk, n)
    return layout, pool, torch.randperm(blocks)[:n], torch.arange(n)


def _rates(args: tuple, direction: str, methods: Collection[str], *, streamed: bool) -> dict[str, float]:
    from kvstrata.ops.transfer_blocks import transfer_blocks

    nbytes = args[1].flat.numel()
    fns = {m: lambda m=m: transfer_blocks(*args, direction=direction, method=m, check=False) for m in methods}
    return _sampled(fns, nbytes, streamed=streamed)


def _sampled(fns: dict[str, Callable[[], None]], nbytes: int, *, streamed: bool) -> dict[str, float]:
    """GB/s of each function: one warm-up call each, one timed call each (those below ``HOPELESS`` of the
    best stop there), then samples interleaved across functions, the median kept."""
    for fn in fns.values():
        fn()  # compile, plan
    first = {name: nbytes / _sample(fn, 1) for name, fn in fns.items()}
    top = max(first.values(), default=0.0)
    samples = {name: [] for name, r in first.items() if r >= HOPELESS * top}
    for _ in range(SAMPLES if streamed else SMALL_SAMPLES):
        for name in samples:
            samples[name].append(nbytes / _sample(fns[name], STREAM_CALLS if streamed else 1))
    return {name: round((statistics.median(samples[name]) if name in samples else r) / 1e9, 2)
            for name, r in first.items()}  # fmt: skip


def _sample(fn: Callable[[], None], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls on the current stream, started on an idle device."""
    torch.cuda.current_stream().synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


_pair_streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def store_and_load(store_args: tuple, load_args: tuple, store_method: str, load_method: str) -> None:
    """A d2h ``transfer_blocks(*store_args)`` and an h2d ``transfer_blocks(*load_args)`` at once, on two
    streams forked from and joined to the current one (what calibration and the benchmark time).

    The two calls are stepped in turn (:func:`kvstrata.ops.transfer_blocks.transfer_blocks_steps`): issued one
    after the other, the load's first DMA waited for the whole store to be issued (~1.2 ms of host time for
    128 MiB at 32 KiB chunks on the H200 machine, against ~2.4 ms of copy), so the two directions overlapped
    only partly (0.65 of the two-way ceiling, tools/probe_store_load_host.py)."""
    from kvstrata.ops._common import current_stream
    from kvstrata.ops.transfer_blocks import interleave, transfer_blocks_steps

    idx = torch.cuda.current_device()
    cur = current_stream(idx)
    if idx not in _pair_streams:
        _pair_streams[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
    s1, s2 = _pair_streams[idx]
    s1.wait_stream(cur)
    s2.wait_stream(cur)
    store = transfer_blocks_steps(*store_args, direction="d2h", method=store_method, check=False, concurrent=True)
    load = transfer_blocks_steps(*load_args, direction="h2d", method=load_method, check=False, concurrent=True)
    end = object()
    with torch.cuda.stream(s1):  # each call forks from (and joins) the current stream of its first step
        store_left = next(store, end) is not end
    with torch.cuda.stream(s2):
        load_left = next(load, end) is not end
    interleave(*(g for g, left in ((store, store_left), (load, load_left)) if left))
    cur.wait_stream(s1)
    cur.wait_stream(s2)


__all__ = [
    "PREFERENCE",
    "TOLERANCE",
    "Calibration",
    "cache_dir",
    "cache_path",
    "calibrate",
    "choose_method",
    "device_key",
    "static_rule",
    "store_and_load",
]
