"""Process liveness, shared by layers that must tell a live peer from a dead one by its pid."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, counts as gone).

    Example::

        >>> pid_alive(os.getpid())
        True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0).
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


def sweep_dead_owner_files(directory: Path, pattern: re.Pattern[str]) -> int:
    """Unlink the files of ``directory`` whose whole name matches ``pattern`` and whose creator, the pid
    in the pattern's first group, is gone (it died before unlinking them); returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(Path(directory) / name)
            removed += 1
    return removed


__all__ = ["pid_alive", "sweep_dead_owner_files"]
