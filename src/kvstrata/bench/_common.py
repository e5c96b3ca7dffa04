"""What every benchmark shares: timing on the device and the host, and the result record.

A result file is JSON holding the figures plus what is needed to trust them: the exact command,
device, library versions and date. Ratios to a ceiling or baseline are computed from figures
measured in the same run, never from numbers copied from elsewhere.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def device_time(
    fn: Callable[[], object], *, warmup: int = 3, iters: int = 10, calls: int = 1, prime: bool | None = None
) -> float:
    """Median seconds per call of ``fn`` on the current CUDA stream (CUDA events, after warm-up).

    ``calls`` > 1 times that many back-to-back calls per sample and divides: the streamed rate an
    engine issuing transfers continuously sees, where one call's host work overlaps the previous
    call's device work. So that this holds for the first timed call too, one untimed call is queued
    before the start event (``prime``, the default with ``calls`` > 1): otherwise the GPU would sit
    idle through the first call's host work inside the timed span (~3 us per call of a 4-call sample
    of a 25 us gather). ``calls=1`` is the latency of an isolated call, host work included.
    """
    import torch

    if prime is None:
        prime = calls > 1
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if prime:
            fn()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def host_time(fn: Callable[[], object], *, warmup: int = 2, iters: int = 10) -> float:
    """Median wall seconds of ``fn`` (for CPU paths, or GPU paths that synchronize themselves)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def python_loop_us(runs: int = 20) -> float:
    """Median microseconds of a plain-Python loop of 1,000 additions: how fast the CPU this thread runs on goes
    right now. Rows bound by host work move with it: on the H200 host's guest the same loop took 31-33 us on
    some vCPUs and 54-62 on others at the same moment, each vCPU changing within seconds
    (``tools/probe_smt.py``, session 21), and the store's device rows fell from ~0.92 to ~0.81 of the ceiling
    with it."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        total = 0
        for i in range(1000):
            total += i
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes per second in GB/s (10^9), rounded for tables."""
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


def environment() -> dict[str, Any]:
    """Device, versions, code, host and date: the context a figure needs to be trusted."""
    import kvstrata

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "kvstrata": kvstrata.__version__,
        **git_state(),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["device"] = props.name
            info["device_count"] = torch.cuda.device_count()
            info["sm_count"] = props.multi_processor_count
            info["driver"] = _nvidia_smi("driver_version")
            info["pcie"] = _nvidia_smi("pcie.link.gen.current,pcie.link.width.current")
        else:
            info["device"] = "cpu"
    except ImportError:
        info["device"] = "cpu"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def git_state(folder: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{"git_commit": HEAD's hash, "git_dirty": whether the files under ``folder`` differ from it}`` for the
    checkout holding ``folder`` (default: the kvstrata package's own folder, so "dirty" means the code that ran is
    not the commit's: changed, added or deleted files there, untracked ones included). Both None where git is
    missing or the folder is not in a checkout (an installed wheel)."""
    import subprocess

    if folder is None:
        import kvstrata

        folder = Path(kvstrata.__file__).resolve().parent
    unknown = {"git_commit": None, "git_dirty": None}
    try:
        git = ["git", "-C", str(folder)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return unknown
        status = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return unknown
    return {
        "git_commit": head.stdout.strip() or None,
        "git_dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
    }


def _nvidia_smi(query: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def results_folder(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where results go (``out_dir``, else ``$KVSTRATA_BENCH_OUT``, else ``bench/results``), made and checked
    writable: called before a benchmark runs, so that a bad ``--out`` fails at once, not after the run."""
    folder = Path(out_dir or os.environ.get("KVSTRATA_BENCH_OUT") or "bench/results")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"--out: cannot make the folder {str(folder)!r}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SystemExit(f"--out: cannot write into {str(folder)!r}")
    return folder


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse ``type`` for a number > 0 of ``kind`` (int or float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def size_list(text: str) -> list[int]:
    """An argparse ``type`` for comma-separated sizes, each > 0 (``4KiB,1MiB``, ``4K``, ``1000``: what
    :func:`kvstrata.units.parse_size` reads)."""
    from kvstrata.units import parse_size

    sizes = []
    for part in text.split(","):
        try:
            size = parse_size(part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if size <= 0:
            raise argparse.ArgumentTypeError(f"sizes must be > 0, got {part.strip()!r}")
        sizes.append(size)
    return sizes


def positive_ints(text: str) -> list[int]:
    """An argparse ``type`` for comma-separated integers > 0 (``1,8``)."""
    values = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected integers > 0 separated by commas, got {part.strip()!r}"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"every value must be > 0, got {value}")
        values.append(value)
    return values


def write_result(name: str, result: dict[str, Any], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write ``{"environment": ..., **result}`` to ``<out_dir>/<name>.json`` and return the path.

    ``out_dir`` defaults to ``$KVSTRATA_BENCH_OUT``, else ``bench/results`` under the current folder.
    """
    path = results_folder(out_dir) / f"{name}.json"
    record = {"environment": environment(), **result}
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
    """Print rows as an aligned text table (the last thing a benchmark prints)."""
    if not rows:
        print("(no rows)")
        return
    columns = columns or list(rows[0])
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    sys.stdout.flush()


__all__ = [
    "device_time",
    "environment",
    "gbps",
    "git_state",
    "host_time",
    "positive",
    "positive_ints",
    "print_table",
    "size_list",
    "write_result",
]
