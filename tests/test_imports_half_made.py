"""A module another thread is still importing is passed over, not called half made (a ClusterClient's first device
calls, one thread per worker, raised ``partially initialized module 'kvstrata.ops.tensor_runs' has no attribute
'loaded'``)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

from kvstrata._imports import imported
from kvstrata.client import local_reads
from kvstrata.store import placements


def half_made(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__spec__._initializing = True  # (what the import system sets until the module's code has run)
    return module


def test_a_module_being_imported_is_not_handed_out(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvstrata.ops.tensor_runs", half_made("kvstrata.ops.tensor_runs"))
    assert imported("kvstrata.ops.tensor_runs") is None
    assert local_reads._native() is None
    assert placements._native() is None


def test_a_finished_module_is(monkeypatch):
    done = types.ModuleType("kvstrata.ops.tensor_runs")
    done.loaded = lambda: "native"
    monkeypatch.setitem(sys.modules, "kvstrata.ops.tensor_runs", done)
    assert imported("kvstrata.ops.tensor_runs") is done
    assert local_reads._native() == "native" and placements._native() == "native"
    assert imported("kvstrata.no_such_module") is None
