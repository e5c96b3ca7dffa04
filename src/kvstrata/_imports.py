"""A module another thread may be importing right now, looked at without importing it."""

from __future__ import annotations

import sys
from types import ModuleType


def imported(name: str) -> ModuleType | None:
    """Module ``name`` where an import of it has finished, else None (never imports it).

    ``sys.modules`` lists a module from the start of its import: a thread that looks while another imports it sees
    it half made, its later names missing (a ClusterClient's calls, one thread per worker, hit this on a first
    device call: ``partially initialized module 'kvstrata.ops.tensor_runs' has no attribute 'loaded'``).
    """
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module
