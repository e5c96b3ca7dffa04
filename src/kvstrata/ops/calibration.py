"""``method="auto"``: which transfer method to use, measured once per device and cached on disk.

:func:`calibrate` times every method (``copy_engine``, ``staging``, ``zero_copy``) in each direction over
chunk sizes 2 KiB..2 MiB, for bulk transfers (~256 MiB) and for one request's blocks (64 chunks), and
writes ``calibration-<key>.json`` under ``$KVSTRATA_CACHE_DIR`` (default ``~/.cache/kvstrata``). The key
is the device name, capability, SM count, driver and torch/triton/CUDA versions: a new GPU, driver or
library version is measured again. The first ``auto`` call on a GPU calibrates when no file exists
(a few seconds; set ``KVSTRATA_AUTO_CALIBRATE=0`` to use the static rule instead), never while a CUDA
graph is being captured.

:func:`choose_method` picks the fastest method at that chunk size (log-interpolated), preferring the
one that takes fewest SMs from the model (``copy_engine``, then ``staging``, then ``zero_copy``) when
it is within ``TOLERANCE`` of the fastest.

Static rule (no calibration): <= 4 MiB in all -> ``zero_copy`` (one kernel, lowest latency); chunks
>= 1 MiB -> ``copy_engine``; otherwise ``staging``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.errors import KvstrataError

CHUNK_SIZES = (2048, 8192, 32768, 131072, 524288, 2097152)
PREFERENCE = ("copy_engine", "staging", "zero_copy")  # fewest SMs taken first
TOLERANCE = 0.08  # an SM-free method within 8% of the fastest wins: the model keeps its SMs
SMALL_BYTES = 4 << 20  # at most this much in one call: the latency regime ("small")
BULK_BYTES = 256 << 20  # several staging pieces, as in real offload batches
PAIR_SHORTLIST = 0.7  # two-direction pairs are timed for methods within 70% of the best alone
FORMAT = 2  # bumped when the measured points change shape (2: "both" pairs); older files are re-measured

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

    def best_pair(self, chunk_bytes: int, methods: Collection[str] = PREFERENCE) -> tuple[str, str] | None:
        """(d2h method, h2d method) with the highest two-direction rate at this chunk size, preferring the
        pair that takes fewer SMs when it is within ``TOLERANCE`` of the best; None when not measured."""
        rates = {}
        for name in self.points.get("both", {}):
            d2h, _, h2d = name.partition("+")
            if d2h in methods and h2d in methods:
                rate = self.gbps("both", name, chunk_bytes, 1 << 30)
                if rate is not None:
                    rates[(d2h, h2d)] = rate
        if not rates:
            return None
        top = max(rates.values())
        ok = [p for p, r in rates.items() if r >= (1 - TOLERANCE) * top]
        return min(ok, key=lambda p: (PREFERENCE.index(p[0]) + PREFERENCE.index(p[1]), -rates[p]))

    def best(
        self, direction: str, chunk_bytes: int, n_chunks: int, methods: Collection[str] = PREFERENCE
    ) -> str | None:
        rates = {m: self.gbps(direction, m, chunk_bytes, n_chunks) for m in PREFERENCE if m in methods}
        rates = {m: r for m, r in rates.items() if r is not None}
        if not rates:
            return None
        top = max(rates.values())
        return next(m for m in PREFERENCE if m in rates and rates[m] >= (1 - TOLERANCE) * top)


_lock = threading.RLock()
_memo: dict[int, Calibration | None] = {}  # device index -> calibration (None: use the static rule)


def calibrate(
    device: torch.device | int | None = None,
    force: bool = False,
    *,
    measure: Callable[[torch.device], Points] | None = None,
    key: dict[str, Any] | None = None,
) -> Calibration:
    """Load this device's calibration from the cache, or measure and cache it (``force=True``: always measure).

    ``measure`` replaces the timing function and ``key`` the device key (tests pass fakes).
    """
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
) -> str:
    """The method ``auto`` uses for ``n_chunks`` chunks of ``chunk_bytes`` in ``direction`` ("d2h"/"h2d").

    ``"torch"`` off CUDA. ``methods`` restricts the candidates (e.g. ``{"zero_copy", "staging"}`` for an
    op without a copy-engine path). ``concurrent=True``: a transfer in the other direction runs at the
    same time, so a bulk transfer takes its side of the pair of methods measured fastest *together*
    (the copy engines of the two directions are independent, but SM kernels reading or writing host
    memory share the PCIe link and the host's issue time with them). Example:
    ``choose_method("h2d", 32768, 64 * 1024)``.
    """
    if direction not in ("d2h", "h2d"):
        raise ValueError(f"direction must be 'd2h' or 'h2d', got {direction!r}")
    dev = torch.device(device) if isinstance(device, (str, torch.device)) else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        return "torch"
    candidates = tuple(m for m in _available() if methods is None or m in methods)
    if not candidates:
        raise ValueError(f"methods: none of {PREFERENCE} in {methods!r}")
    idx = _index(device)
    if idx not in _memo and not torch.cuda.is_current_stream_capturing():
        _memo[idx] = _load_or_calibrate(idx)
    cal = _memo.get(idx)
    choice = None
    if cal is not None and concurrent and chunk_bytes * n_chunks > SMALL_BYTES:
        pair = cal.best_pair(chunk_bytes, candidates)
        choice = None if pair is None else pair[0 if direction == "d2h" else 1]
    if cal is not None and choice is None:
        choice = cal.best(direction, chunk_bytes, n_chunks, candidates)
    if choice is None:
        choice = static_rule(direction, chunk_bytes, n_chunks)
        if choice not in candidates:
            choice = candidates[-1] if "staging" not in candidates else "staging"
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
    """Time each method on a 32-layer (64-segment) cache; scattered device blocks, consecutive host blocks.

    For bulk transfers also a store and a load at once (two streams) for each pair of shortlisted
    methods: ``points["both"]["<d2h method>+<h2d method>"]["bulk"]``, GB/s of both directions together.
    """
    from kvstrata.ops.kv_layout import HostPool, KVLayout
    from kvstrata.ops.transfer_blocks import transfer_blocks

    nseg = 64
    points: Points = {d: {m: {"bulk": [], "small": []} for m in PREFERENCE} for d in ("d2h", "h2d")}
    points["both"] = {}

    def setup(n: int):
        caches = [torch.zeros(2 * n, 1, chunk, dtype=torch.uint8, device=device) for _ in range(nseg)]
        layout = KVLayout.from_mla(caches)
        return layout, HostPool.allocate(layout, n), torch.randperm(2 * n)[:n].sort().values, torch.arange(n)

    with torch.cuda.device(device):
        for chunk in CHUNK_SIZES:
            for regime, n in (("small", 1), ("bulk", max(1, BULK_BYTES // (nseg * chunk)))):
                args = setup(n)
                for direction in ("d2h", "h2d"):
                    for method in _available():
                        t = _time(
                            lambda a=args, d=direction, m=method: transfer_blocks(
                                *a, direction=d, method=m, check=False
                            )
                        )
                        points[direction][method][regime].append([chunk, round(nseg * n * chunk / t / 1e9, 2)])
            other = setup(n)  # bulk: a second cache and pool for the load beside the store
            shortlist = {}
            for direction in ("d2h", "h2d"):
                rates = {m: points[direction][m]["bulk"][-1][1] for m in _available()}
                shortlist[direction] = [m for m, r in rates.items() if r >= PAIR_SHORTLIST * max(rates.values())]
            for d2h in shortlist["d2h"]:
                for h2d in shortlist["h2d"]:
                    t = _time(lambda a=args, b=other, x=d2h, y=h2d: store_and_load(a, b, x, y))
                    rate = round(2 * nseg * n * chunk / t / 1e9, 2)
                    points["both"].setdefault(f"{d2h}+{h2d}", {"bulk": [], "small": []})["bulk"].append([chunk, rate])
            del args, other
    return points


_pair_streams: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def store_and_load(store_args: tuple, load_args: tuple, store_method: str, load_method: str) -> None:
    """A d2h ``transfer_blocks(*store_args)`` and an h2d ``transfer_blocks(*load_args)`` at once, on two
    streams forked from and joined to the current one (what calibration and the benchmark time)."""
    from kvstrata.ops.transfer_blocks import transfer_blocks

    cur = torch.cuda.current_stream()
    idx = cur.device.index
    if idx not in _pair_streams:
        _pair_streams[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
    s1, s2 = _pair_streams[idx]
    s1.wait_stream(cur)
    s2.wait_stream(cur)
    with torch.cuda.stream(s1):
        transfer_blocks(*store_args, direction="d2h", method=store_method, check=False, concurrent=True)
    with torch.cuda.stream(s2):
        transfer_blocks(*load_args, direction="h2d", method=load_method, check=False, concurrent=True)
    cur.wait_stream(s1)
    cur.wait_stream(s2)


def _time(fn: Callable[[], None], iters: int = 3) -> float:
    """Median seconds of ``fn`` on the current stream (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


__all__ = [
    "Calibration",
    "cache_dir",
    "cache_path",
    "calibrate",
    "choose_method",
    "device_key",
    "static_rule",
    "store_and_load",
]
