"""WorkerConfig precedence, human sizes, Prometheus rendering, and the demo command."""

from __future__ import annotations

import os

import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.server import WorkerConfig, to_prometheus
from kvstrata.units import format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [("8GiB", 8 << 30), ("8G", 8 << 30), ("512MB", 512_000_000), ("1.5 KiB", 1536), (" 42 ", 42), (7, 7), ("0", 0)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "8 parsecs", "-1", True, None, 1.5, -3])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="memory"):
        parse_size(bad, "memory")


def test_format_size():
    assert format_size(100) == "100 B" and format_size(1536) == "1.5 KiB" and format_size(3 << 30) == "3.0 GiB"


def test_precedence_file_env_flags(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(
        "memory: 1GiB\ndisk-dir: ''\nsocket: /tmp/from-file.sock\nlog_level: debug\n"
        "high_watermark: 0.7\nlow_watermark: 0.6\n"
    )
    env = {"KVSTRATA_MEMORY": "2GiB", "KVSTRATA_SOCKET": "/tmp/from-env.sock", "KVSTRATA_DISK_SYNC": "yes"}
    c = WorkerConfig.load({"socket": "/tmp/from-flag.sock", "memory": None}, config_file=str(cfg), environ=env)
    assert c.memory == 2 << 30  # env beats file; a None flag is "not given"
    assert c.socket == "/tmp/from-flag.sock" and c.address == "unix:///tmp/from-flag.sock"
    assert c.log_level == "debug" and c.high_watermark == 0.7 and c.disk_sync is True and c.disk_dir == ""
    sc = c.store_config()
    assert sc.memory_bytes == 2 << 30 and sc.disk_dir is None and sc.high_watermark == 0.7


def test_defaults_come_from_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    c = WorkerConfig.load(environ={})
    assert 64 << 20 <= c.memory <= 64 << 30
    assert c.disk_dir == str(tmp_path / ".cache" / "kvstrata" / "disk") and c.disk_size > 0
    assert c.socket.endswith("worker.sock")


@pytest.mark.parametrize(
    "values, match",
    [
        ({"memory": "lots"}, "memory"),
        ({"log_level": "chatty"}, "log_level"),
        ({"high_watermark": 2.0}, "high_watermark"),
        ({"numa_node": "near"}, "numa_node"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_settings_name_the_field(values, match):
    with pytest.raises(ValueError, match=match):
        WorkerConfig.load({"disk_dir": "", **values}, environ={})


def test_bad_environment_and_file(tmp_path):
    with pytest.raises(ValueError, match="KVSTRATA_DISK_SYNC"):
        WorkerConfig.load({"disk_dir": ""}, environ={"KVSTRATA_DISK_SYNC": "maybe"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- list\n")
    with pytest.raises(ValueError, match="mapping"):
        WorkerConfig.load(config_file=str(bad), environ={})


def test_prometheus_text():
    stats = {
        "tiers": {"memory": {"used": 10, "capacity": 100, "hugepages": "off"}, "disk": {"used": 5, "capacity": 50}},
        "objects": 3,
        "hits": 7,
        "misses": 1,
        "clients": 2,
        "uptime_seconds": 1.5,
    }
    text = to_prometheus(stats)
    lines = text.splitlines()
    assert 'kvstrata_tier_used_bytes{tier="memory"} 10' in lines
    assert 'kvstrata_tier_capacity_bytes{tier="disk"} 50' in lines
    assert "# TYPE kvstrata_hits_total counter" in lines and "kvstrata_hits_total 7" in lines
    assert "# TYPE kvstrata_objects gauge" in lines and "kvstrata_uptime_seconds 1.5" in lines
    assert "hugepages" not in text  # non-numeric leaves are skipped
    # every sample line belongs to a declared metric
    declared = {ln.split()[2] for ln in lines if ln.startswith("# TYPE")}
    assert all(ln.split("{")[0].split()[0] in declared for ln in lines if not ln.startswith("#"))
    # and each has its HELP line, just before its TYPE line
    helped = [ln.split()[2] for ln in lines if ln.startswith("# HELP")]
    assert sorted(helped) == sorted(declared)
    assert "# HELP kvstrata_hits_total reads of keys found, the clients' own from shared memory included" in lines
    text = to_prometheus({"tiers": {"disk": {"reserved": 4}}})
    assert 'kvstrata_tier_reserved_bytes{tier="disk"} 4' in text.splitlines()


@pytest.mark.parametrize(
    "setting, value, says",
    [
        ("socket_mode", 600, "octal"),  # YAML's bare 600 is decimal: 0o1130
        ("socket_mode", "rw", "octal"),
        ("socket_mode", "0400", "owner read and write"),
        ("disk_dir", 5, "folder path"),
        ("metrics_address", "localhost:http", "HOST:PORT"),
        ("metrics_address", "127.0.0.1:70000", "HOST:PORT"),
        ("metrics_address", True, "HOST:PORT"),
    ],
)
def test_bad_socket_modes_and_folders_are_named(setting, value, says):
    with pytest.raises(ValueError, match=f"{setting}.*{says}"):
        WorkerConfig.load({setting: value, "socket": "/tmp/x.sock"}, environ={})


def test_socket_mode_from_yaml_in_octal(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("socket_mode: '0660'\ndisk_dir: ''\n")
    assert WorkerConfig.load(config_file=str(cfg), environ={}).socket_mode == 0o660


def test_demo_runs_and_checks_its_data(capsys):
    import re

    from kvstrata.cli.main import main

    assert main(["demo", "--sessions", "6", "--memory", "2MiB", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "every reused block matched bit for bit" in out
    spills, promotions = map(int, re.search(r"(\d+) spills to SSD, (\d+) promotions", out).groups())
    assert spills > 0 and promotions > 0  # the host tier was too small: the SSD tier was used both ways
    assert int(re.search(r"reused from kvstrata\s+(\d+)", out).group(1)) > 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--sessions", "0"], "--sessions: must be a finite number > 0"),
        (["--layers", "-2"], "--layers: must be a finite number > 0"),
        (["--memory", "1KiB"], "must hold at least"),
        (["--memory", "lots"], "--memory: memory: expected a size"),
        (["--device", "bogus"], "--device 'bogus'"),
    ],
)
def test_demo_refuses_bad_arguments_by_name(args, says, capsys):
    """They ended in tracebacks (ZeroDivisionError, CapacityError) or ran with nothing to show."""
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *args])
    assert says in f"{exit_.value.code} {capsys.readouterr().err}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")
def test_demo_on_a_cuda_device_there_is_not():
    with pytest.raises(SystemExit, match="no CUDA device here"):
        main(["demo", "--device", "cuda"])


def test_worker_socket_follows_kvstrata_worker():
    env = {"KVSTRATA_WORKER": "unix:///tmp/shared-name.sock"}
    assert WorkerConfig.load({"disk_dir": ""}, environ=env).address == "unix:///tmp/shared-name.sock"
    env["KVSTRATA_SOCKET"] = "/tmp/explicit.sock"  # an explicit socket setting wins
    assert WorkerConfig.load({"disk_dir": ""}, environ=env).socket == "/tmp/explicit.sock"
    # a bare path is a Unix socket to clients: to the worker too (it listened on the default socket instead)
    env = {"KVSTRATA_WORKER": "/tmp/bare-name.sock"}
    assert WorkerConfig.load({"disk_dir": ""}, environ=env).address == "unix:///tmp/bare-name.sock"
    relative = {"KVSTRATA_WORKER": "rel.sock"}  # where a client in this folder looks: os.path.abspath
    assert WorkerConfig.load({"disk_dir": ""}, environ=relative).address == f"unix://{os.path.abspath('rel.sock')}"
    env = {"KVSTRATA_WORKER": "tcp://127.0.0.1:7000"}  # any scheme: clients look there, so the worker listens there
    assert WorkerConfig.load({"disk_dir": ""}, environ=env).address == "tcp://127.0.0.1:7000"


def test_spin_us(tmp_path):
    base = {"socket": str(tmp_path / "s.sock"), "memory": "16MiB", "disk_dir": ""}
    assert WorkerConfig.load(base, environ={}).spin_us == 200.0
    assert WorkerConfig.load(base, environ={"KVSTRATA_SPIN_US": "0"}).spin_us == 0.0
    assert WorkerConfig.load({**base, "spin_us": 50}, environ={}).spin_us == 50
    for bad in (-1, 1e6, "fast", True):
        with pytest.raises(ValueError, match="spin_us"):
            WorkerConfig.load({**base, "spin_us": bad}, environ={})


def test_placement_table_setting_and_a_worker_without_it(tmp_path):
    import torch

    import kvstrata
    from kvstrata.server import Worker

    base = {"socket": str(tmp_path / "s.sock"), "memory": "16MiB", "disk_dir": "", "numa_node": "none"}
    assert WorkerConfig.load(base, environ={}).placement_table is True
    off = WorkerConfig.load(base, environ={"KVSTRATA_PLACEMENT_TABLE": "0"})
    assert off.placement_table is False
    with pytest.raises(ValueError, match="placement_table"):
        WorkerConfig.load({**base, "placement_table": "sometimes"}, environ={})
    with Worker(off).start() as w, kvstrata.connect(w.address, timeout=5) as kv:
        assert kv._backend.placement_hints(["a"]) is None  # no table sent: device reads wait for their leases
        src = [[torch.arange(100, dtype=torch.uint8)], [torch.arange(7, dtype=torch.uint8)]]
        assert kv.mset_d2h(["a", "b"], src) == [None, None]
        dst = [[torch.zeros_like(t[0])] for t in src]
        assert kv.mget_h2d(["a", "b"], dst) == [None, None]
        assert all(torch.equal(x[0], y[0]) for x, y in zip(src, dst))


@pytest.mark.parametrize(
    "value, endpoint",
    [
        ("", None),
        (9464, ("127.0.0.1", 9464)),
        ("9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        (":9464", ("0.0.0.0", 9464)),
        ("[::1]:9464", ("::1", 9464)),
    ],
)
def test_metrics_address_forms(value, endpoint):
    config = WorkerConfig.load({"metrics_address": value, "disk_dir": ""}, environ={})
    assert config.metrics_endpoint() == endpoint
