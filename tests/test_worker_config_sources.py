"""Where the worker's settings come from, and how bad ones are named: the audit of `kvstrata worker`'s configuration.

Each test failed before its fix (the item of the audit is in its name's docstring).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import namedtuple

import pytest

from kvstrata.cli.main import build_parser, main
from kvstrata.server import config as C
from kvstrata.server.config import WorkerConfig, worker_address

BASE = {"disk_dir": "", "numa_node": "none"}


# 1. the default SSD tier size -----------------------------------------------------------------------------------------
_Usage = namedtuple("_Usage", "total used free")


def _fake_file_system(monkeypatch, size: int, folder) -> None:
    """``shutil.disk_usage`` of a file system of ``size`` bytes holding only the files in ``folder``."""

    def usage(path):
        held = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
        return _Usage(size, held, size - held)

    monkeypatch.setattr(shutil, "disk_usage", usage)


def test_default_disk_size_counts_the_tiers_own_files(tmp_path, monkeypatch):
    """Item 1: half of the *free* space, measured at each start, shrank a full tier below its data on restart."""
    disk = tmp_path / "disk"
    _fake_file_system(monkeypatch, 400 << 20, disk)
    first = C.default_disk_bytes(str(disk))
    assert first == 200 << 20
    disk.mkdir()
    for i in range(190):  # the tier filled (its files: 190 MiB)
        (disk / f"{i}.kvs").write_bytes(b"")
        os.truncate(disk / f"{i}.kvs", 1 << 20)
    assert C.default_disk_bytes(str(disk)) == first  # free 210 MiB + its own 190 MiB: the same room


def test_default_disk_size_is_recorded_at_first_start_and_kept(tmp_path, monkeypatch):
    """Item 1: the size chosen at the first start is recorded in the folder and reused, whatever the room later."""
    from kvstrata.server import Worker

    disk = tmp_path / "disk"
    _fake_file_system(monkeypatch, 400 << 20, disk)
    settings = {"socket": str(tmp_path / "w.sock"), "memory": "16MiB", "disk_dir": str(disk), "numa_node": "none"}
    config = WorkerConfig.load(settings, environ={})
    assert config.disk_size == 200 << 20 and config.disk_size_is_default
    with Worker(config).start():
        pass
    assert C.recorded_disk_bytes(str(disk)) == 200 << 20
    assert (disk / C.DISK_SIZE_FILE).exists()
    _fake_file_system(monkeypatch, 40 << 20, tmp_path / "elsewhere")  # other files took the room meanwhile
    again = WorkerConfig.load(settings, environ={})
    assert again.disk_size == 200 << 20
    assert WorkerConfig.load({**settings, "disk_size": "64MiB"}, environ={}).disk_size == 64 << 20  # a size given wins
    with Worker(WorkerConfig.load({**settings, "disk_size": "64MiB"}, environ={})).start():
        pass
    assert C.recorded_disk_bytes(str(disk)) == 200 << 20  # and is not recorded as the default


def test_disk_size_zero_turns_the_ssd_tier_off():
    """Item 15: --disk-size 0 with a disk folder silently meant "chosen from the free space"."""
    config = WorkerConfig.load({"disk_dir": "/tmp/some-ssd", "disk_size": "0", "numa_node": "none"}, environ={})
    assert config.disk_dir == "" and config.disk_size == 0 and config.store_config().disk_dir is None


# 6. KVSTRATA_WORKER ---------------------------------------------------------------------------------------------------
def test_kvstrata_worker_of_any_scheme_is_the_socket_ranked_as_the_environment(tmp_path):
    """Item 6: a tcp:// KVSTRATA_WORKER was ignored, and a YAML socket beat KVSTRATA_WORKER."""
    env = {"KVSTRATA_WORKER": "tcp://127.0.0.1:7000"}
    assert WorkerConfig.load(BASE, environ=env).address == "tcp://127.0.0.1:7000"
    cfg = tmp_path / "w.yaml"
    cfg.write_text(f"socket: {tmp_path}/yaml.sock\n")
    env = {"KVSTRATA_WORKER": f"{tmp_path}/env.sock"}
    assert WorkerConfig.load(BASE, config_file=str(cfg), environ=env).address == f"unix://{tmp_path}/env.sock"
    env["KVSTRATA_SOCKET"] = f"{tmp_path}/socket.sock"  # the worker's own setting beats where clients look
    assert WorkerConfig.load(BASE, config_file=str(cfg), environ=env).address == f"unix://{tmp_path}/socket.sock"
    flags = {**BASE, "socket": f"{tmp_path}/flag.sock"}
    assert WorkerConfig.load(flags, config_file=str(cfg), environ=env).address == f"unix://{tmp_path}/flag.sock"


def test_a_worker_listens_on_a_tcp_kvstrata_worker():
    """Item 6, end to end: the worker listened on the default Unix socket instead."""
    from kvstrata.server import Worker

    config = WorkerConfig.load({**BASE, "memory": "16MiB"}, environ={"KVSTRATA_WORKER": "tcp://127.0.0.1:0"})
    with Worker(config).start() as worker:
        assert worker.address.startswith("tcp://127.0.0.1:") and not worker.address.endswith(":0")


# 7. every flag, each way ----------------------------------------------------------------------------------------------
def test_negative_flags_work_in_the_environment_and_the_file(tmp_path):
    """Item 7: KVSTRATA_NO_PLACEMENT_TABLE was ignored and YAML no_placement_table refused."""
    assert WorkerConfig.load(BASE, environ={"KVSTRATA_NO_PLACEMENT_TABLE": "1"}).placement_table is False
    assert WorkerConfig.load(BASE, environ={"KVSTRATA_NO_DISK_SYNC": "yes"}).disk_sync is False
    cfg = tmp_path / "w.yaml"
    cfg.write_text("no_placement_table: true\nno-disk-sync: false\n")
    config = WorkerConfig.load(BASE, config_file=str(cfg), environ={})
    assert config.placement_table is False and config.disk_sync is True
    with pytest.raises(ValueError, match="disagree"):
        WorkerConfig.load(BASE, environ={"KVSTRATA_PLACEMENT_TABLE": "1", "KVSTRATA_NO_PLACEMENT_TABLE": "1"})
    cfg.write_text("no_placement_table: sometimes\n")
    with pytest.raises(ValueError, match="no_placement_table"):
        WorkerConfig.load(BASE, config_file=str(cfg), environ={})


def test_kvstrata_config_names_the_file(tmp_path):
    """Item 7: KVSTRATA_CONFIG was not read."""
    cfg = tmp_path / "w.yaml"
    cfg.write_text("memory: 48MiB\nlog_level: debug\n")
    config = WorkerConfig.load(BASE, environ={"KVSTRATA_CONFIG": str(cfg)})
    assert config.memory == 48 << 20 and config.log_level == "debug"
    other = tmp_path / "other.yaml"
    other.write_text("memory: 32MiB\n")  # --config beats the variable
    assert WorkerConfig.load(BASE, config_file=str(other), environ={"KVSTRATA_CONFIG": str(cfg)}).memory == 32 << 20


def test_unknown_kvstrata_variables_are_warned_about(caplog):
    """Item 7: a misspelt KVSTRATA_* variable was silently ignored."""
    env = {
        "KVSTRATA_MEMROY": "1GiB",  # a typo
        "KVSTRATA_MEMORY": "32MiB",
        "KVSTRATA_NO_PLACEMENT_TABLE": "1",
        "KVSTRATA_WORKER": "/tmp/x.sock",
        "KVSTRATA_CONFIG": "",
        "KVSTRATA_DEVOBJ_SPIN_US": "5",  # read by others: not warned about
        "KVSTRATA_NATIVE": "0",
        "KVSTRATA_LOG": "info",
        "KVSTRATA_CACHE_DIR": "/tmp",
    }
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        WorkerConfig.load(BASE, environ=env)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "KVSTRATA_MEMROY" in warned[0] and "KVSTRATA_MEMORY" in warned[0], warned


def test_every_variable_the_sources_read_is_known():
    """Item 7: the list of variables read elsewhere covers those the package reads (no warning for them)."""
    import re
    from pathlib import Path

    import kvstrata

    root = Path(kvstrata.__file__).parent
    names = set()
    for path in root.rglob("*.py"):
        names |= {n for n in re.findall(r"KVSTRATA_[A-Z0-9_]+", path.read_text()) if not n.endswith("_")}
    fields = {f"KVSTRATA_{f.upper()}" for f in C._FIELD_NAMES} | {f"KVSTRATA_NO_{f.upper()}" for f in C._BOOL_FIELDS}
    unknown = {n for n in names - fields - C.OTHER_VARIABLES if not n.startswith(C.OTHER_PREFIXES)}
    assert not unknown


# 11. memory and cgroups -----------------------------------------------------------------------------------------------
def _cgroup_tree(tmp_path, proc_lines: str, files: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text(proc_lines)
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"root": str(tmp_path / "fs"), "proc_cgroup": str(tmp_path / "cgroup")}


def test_cgroup_memory_limits_are_read(tmp_path):
    """Item 11: cgroup v2 memory.max (the lowest on the way up) and v1 memory.limit_in_bytes."""
    v2 = _cgroup_tree(
        tmp_path / "v2",
        "0::/a/b\n",
        {"a/memory.max": "1073741824\n", "a/b/memory.max": "max\n", "memory.max": "4294967296\n"},
    )
    assert C.cgroup_memory_limit(**v2) == 1 << 30
    v1 = _cgroup_tree(
        tmp_path / "v1", "4:memory:/docker/x\n1:cpu:/\n0::/\n", {"memory/memory.limit_in_bytes": "536870912"}
    )
    assert C.cgroup_memory_limit(**v1) == 512 << 20  # the container's own cgroup mounted at the top
    none = _cgroup_tree(tmp_path / "none", "4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert C.cgroup_memory_limit(**none) is None
    assert C.cgroup_memory_limit(proc_cgroup=str(tmp_path / "missing")) is None


def test_default_memory_is_capped_by_the_cgroup(monkeypatch):
    """Item 11: the default took a quarter of physical RAM, ignoring the container's limit."""
    monkeypatch.setattr(C, "physical_memory_bytes", lambda: 256 << 30)
    monkeypatch.setattr(C, "cgroup_memory_limit", lambda: 2 << 30)
    assert C.default_memory_bytes() == 512 << 20
    monkeypatch.setattr(C, "cgroup_memory_limit", lambda: None)
    assert C.default_memory_bytes() == C.MEMORY_CAP


# 12, 15. bad values, named by their flags -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["--memory", "8"], "memory (--memory): must be at least 1.0 MiB, got 8 bytes"),
        (["--memory", "64MiB", "--segment-size", "32"], "segment_size (--segment-size): must be at least 1.0 MiB"),
        (["--memory", "64MiB", "--segment-size", "0"], "segment_size (--segment-size): must be at least"),
        (["--memory", "64MiB", "--high-watermark", "0.7"], "lower --low-watermark too"),
    ],
)
def test_bad_sizes_and_watermarks_name_the_flag(args, says, capsys, tmp_path):
    """Items 12 and 15: "nbytes: must be a positive int, got 0", "segment_bytes", "low_watermark ... 0.8"."""
    rc = main(["worker", "--socket", str(tmp_path / "w.sock"), "--disk-dir", "", *args])
    assert rc == 2 and says in capsys.readouterr().err


def test_numa_node_words_in_any_case():
    """Item 15: --numa-node Auto was refused."""
    assert WorkerConfig.load({**BASE, "numa_node": "Auto"}, environ={}).numa_node == "auto"
    assert WorkerConfig.load({**BASE, "numa_node": "NONE"}, environ={}).numa_node is None
    assert WorkerConfig.load({"disk_dir": ""}, environ={"KVSTRATA_NUMA_NODE": "AUTO"}).numa_node == "auto"


def test_no_disk_sync_flag():
    """Item 15: --disk-sync had no --no-disk-sync form (to override a file's or the environment's)."""
    parser = build_parser("worker")
    assert parser.parse_args(["worker", "--no-disk-sync"]).disk_sync is False
    assert parser.parse_args(["worker", "--disk-sync"]).disk_sync is True
    assert parser.parse_args(["worker"]).disk_sync is None  # not given: the file's or the environment's


# 13. ~ in paths -------------------------------------------------------------------------------------------------------
def test_home_in_paths_is_expanded(tmp_path, monkeypatch):
    """Item 13: '~' in YAML/environment paths was taken literally."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = tmp_path / "w.yaml"
    cfg.write_text("socket: ~/kv.sock\ndisk_dir: ~/ssd\ndisk_size: 64MiB\n")
    config = WorkerConfig.load({"numa_node": "none"}, config_file=str(cfg), environ={})
    assert config.socket == f"{tmp_path}/kv.sock" and config.disk_dir == f"{tmp_path}/ssd"
    config = WorkerConfig.load(BASE, environ={"KVSTRATA_WORKER": "~/env.sock"})
    assert config.address == f"unix://{tmp_path}/env.sock"
    assert worker_address("~/c.sock") == f"unix://{tmp_path}/c.sock"
    assert worker_address("unix://~/c.sock") == f"unix://{tmp_path}/c.sock"
    assert WorkerConfig.load(BASE, environ={"KVSTRATA_CONFIG": "~/w.yaml"}).socket == f"{tmp_path}/kv.sock"


# 15. an empty address -------------------------------------------------------------------------------------------------
def test_an_empty_address_is_an_invalid_value_at_once():
    """Item 15: connect("") retried a connect to the current folder until its timeout."""
    import time

    import kvstrata

    t0 = time.monotonic()
    with pytest.raises(kvstrata.InvalidValue, match="address"):
        kvstrata.connect("", timeout=5)
    with pytest.raises(kvstrata.InvalidValue, match="address"):
        worker_address("  ")
    assert time.monotonic() - t0 < 1
