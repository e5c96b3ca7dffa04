"""Test setup shared by every test module.

Without a GPU, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``) on CPU tensors at
small shapes; this must be decided before any kernel module is imported, so it happens here.
GPU tests carry ``@pytest.mark.gpu`` and are skipped where CUDA is missing.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """With a GPU, the native copy planner (kvstrata.ops.tensor_runs) is loaded before the first test, so every GPU
    test's kept reads take it rather than whichever path was ready when the test ran (its build, the first time on a
    machine, runs in the background otherwise). Without a GPU the kept reads never take it (their tensors are CPU
    ones); test_tensor_runs and the kept-read tests that stand CPU tensors in for CUDA ones load it themselves."""
    if HAS_CUDA and os.environ.get("KVSTRATA_NATIVE") != "0":
        from kvstrata.ops import tensor_runs

        tensor_runs.native(wait=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and (not HAS_CUDA or torch.cuda.device_count() < 2):
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _sweep_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stale local-read entries are looked for at every request, not at most every 10 ms: tests count
    leases right after a change (test_local_reads checks the rate limit itself)."""
    from kvstrata.client import local_reads

    monkeypatch.setattr(local_reads, "SWEEP_S", 0.0)


@pytest.fixture(autouse=True)
def _keeper_leaves_idle_clients_alone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests count the messages calls send (test_local_reads, test_kept_reads, ...): an idle client's keeper giving
    back a stale entry's lease on its own would add one whenever a test pauses past 0.1 s. It does so only in
    test_cache_keeper, which tests it (the keeper still answers the worker's reclaim everywhere)."""
    if request.module.__name__.endswith("test_cache_keeper"):
        return
    from kvstrata.client import connection

    monkeypatch.setattr(connection, "KEEPER_IDLE_ROUNDS", 1 << 30)


@pytest.fixture
def cpu_hbm(monkeypatch):
    """Stores made from here on get an HBM tier on a CPU buffer."""
    import kvstrata.store.tiers.gpu as gpu_mod

    class CpuStandIn(gpu_mod.GpuTier):
        def __init__(self, capacity, *, device=0):
            super().__init__(capacity, device="cpu")

    monkeypatch.setattr(gpu_mod, "GpuTier", CpuStandIn)


@pytest.fixture
def seeded() -> torch.Generator:
    """A fixed-seed generator so a failing random case can be replayed."""
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


@pytest.fixture
def worker(tmp_path):
    """A real worker on a Unix socket in ``tmp_path`` (16 MiB of memory, no disk tier), stopped after the test.
    Modules that need another worker define their own ``worker`` fixture, which takes precedence."""
    from kvstrata.server.config import WorkerConfig
    from kvstrata.server.worker import Worker

    w = Worker(WorkerConfig(socket=str(tmp_path / "kv.sock"), memory=16 << 20, disk_dir="")).start()
    yield w
    w.stop()


@pytest.fixture
def make(worker, request):
    """``make(config=...)``: a device-object client on CPU of ``worker`` through its own broker link, closed after
    the test. The default config is the test module's ``CFG``."""
    from kvstrata.devobj import DeviceObjects
    from kvstrata.devobj.service import WorkerBrokerLink

    made = []

    def _make(config=None) -> DeviceObjects:
        link = WorkerBrokerLink(worker.address)
        c = DeviceObjects(link, device="cpu", config=config or request.module.CFG)
        made.append((c, link))
        return c

    yield _make
    for c, link in made:
        c.close()
        link.close()
