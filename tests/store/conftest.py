"""Fixtures for the store engine tests: small stores (a few MiB), SSD tier in a temp dir."""

from __future__ import annotations

import pytest

from kvstrata.store import ObjectStore, StoreConfig


def make_config(tmp_path=None, *, memory=4 << 20, disk=32 << 20, segment=1 << 20, **kw) -> StoreConfig:
    return StoreConfig(
        memory_bytes=memory,
        segment_bytes=segment,
        disk_dir=None if tmp_path is None else str(tmp_path / "ssd"),
        disk_bytes=0 if tmp_path is None else disk,
        numa_node=None,
        hugepages="off",
        **kw,
    )


@pytest.fixture
def store():
    s = ObjectStore(make_config())
    yield s
    s.close()


@pytest.fixture
def dstore(tmp_path):
    s = ObjectStore(make_config(tmp_path))
    yield s
    s.close()


@pytest.fixture(name="make_config")
def make_config_fixture():
    """The factory :func:`make_config`, for tests that build their own stores."""
    return make_config
