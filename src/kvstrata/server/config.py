"""Worker configuration: one frozen dataclass, built at the edge from flags, a YAML file and the environment.

Precedence, lowest first: defaults sized from the machine, ``--config file.yaml``, ``KVSTRATA_*``
environment variables, command-line flags. Every field can be set each way, under the same name
(``memory``/``KVSTRATA_MEMORY``/``--memory``); sizes accept ``8GiB``-style strings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.errors import InvalidValue
from kvstrata.units import parse_size

MEMORY_FRACTION = 0.25  # of physical RAM, by default
MEMORY_CAP = 64 << 30  # default memory tier never above this; set --memory for more
DISK_DEFAULT = 64 << 30
DISK_FRACTION = 0.5  # of the free space where the disk tier lives, at most


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/kvstrata/worker.sock``, else ``/tmp/kvstrata-<uid>/worker.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvstrata" if runtime and os.path.isdir(runtime) else Path(f"/tmp/kvstrata-{os.getuid()}")
    return str(base / "worker.sock")


def default_address() -> str:
    """Where clients look for the node's worker: ``KVSTRATA_WORKER`` or the default socket."""
    return os.environ.get("KVSTRATA_WORKER") or f"unix://{default_socket_path()}"


def worker_address(address: str | None) -> str:
    """A client's address for the node's worker: the default when None; a bare path (an argument or
    ``KVSTRATA_WORKER``) is the worker's Unix socket."""
    if address is None:
        address = default_address()
    return address if "://" in address else f"unix://{os.path.abspath(address)}"


def default_memory_bytes() -> int:
    import psutil

    return max(64 << 20, min(int(psutil.virtual_memory().total * MEMORY_FRACTION), MEMORY_CAP))


def default_disk_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstrata" / "disk")


def default_disk_bytes(disk_dir: str) -> int:
    import shutil

    probe = Path(disk_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return DISK_DEFAULT
    return max(64 << 20, min(DISK_DEFAULT, int(free * DISK_FRACTION)))


_SIZE_FIELDS = ("memory", "disk_size", "gpu_memory", "segment_size")
_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs. ``WorkerConfig.load(flags={"memory": "8GiB"})`` fills the rest.

    ``disk_dir=""`` turns the SSD tier off.
    """

    socket: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o600
    memory: int = field(default_factory=default_memory_bytes)
    disk_dir: str = field(default_factory=default_disk_dir)
    disk_size: int = 0  # 0: chosen from the free space at disk_dir
    gpu_memory: int = 0
    gpu_device: int | None = None
    segment_size: int = 256 << 20
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    hugepages: str = "auto"
    numa_node: int | str | None = "auto"
    disk_sync: bool = False
    log_level: str = "info"
    #: microseconds a connection's thread busy-polls for the next request before sleeping (0: never);
    #: it polls only while one client is connected and the machine has a core to spare (see Worker)
    spin_us: float = 200.0
    #: keep the table of where objects lie that lets clients start device reads before their leases come back
    #: (kvstrata.store.placements); off, a cold ``mget_h2d`` waits one round trip before its first copy
    placement_table: bool = True
    #: where to serve Prometheus metrics over HTTP (``GET /metrics``): ``"HOST:PORT"``, or a bare port for
    #: 127.0.0.1; "" (the default): no HTTP endpoint (``kvstrata status --prometheus`` still prints them)
    metrics_address: str = ""

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            object.__setattr__(self, name, parse_size(getattr(self, name), name))
        if isinstance(self.numa_node, str) and self.numa_node != "auto":  # from a flag or the environment
            node = self.numa_node.strip().lower()
            object.__setattr__(self, "numa_node", None if node in ("none", "off", "") else _int("numa_node", node))
        if not isinstance(self.socket, str) or not self.socket:
            raise InvalidValue(f"socket: must be a path or address, got {self.socket!r}")
        mode = raw_mode = self.socket_mode
        if isinstance(mode, str):  # "0600" (in YAML a bare 600 is a decimal integer: quote it, or write 0o600)
            try:
                mode = int(mode, 8)
            except ValueError:
                mode = None
            object.__setattr__(self, "socket_mode", mode)
        if type(mode) is not int or not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
            raise InvalidValue(
                'socket_mode: permission bits in octal with owner read and write, such as "0600" or "0660" '
                f"(in YAML quote them or write 0o600), got {raw_mode!r}"
                + (f" (octal {raw_mode:o})" if type(raw_mode) is int else "")
            )
        if not isinstance(self.disk_dir, str):
            raise InvalidValue(f'disk_dir: must be a folder path ("" for no SSD tier), got {self.disk_dir!r}')
        if self.memory <= 0:
            raise InvalidValue("memory: must be > 0")
        if self.log_level not in _LEVELS:
            raise InvalidValue(f"log_level: must be one of {', '.join(_LEVELS)}, got {self.log_level!r}")
        if isinstance(self.spin_us, bool) or not isinstance(self.spin_us, int | float) or not 0 <= self.spin_us <= 1e5:
            raise InvalidValue(f"spin_us: must be a number of microseconds in [0, 100000], got {self.spin_us!r}")
        if not isinstance(self.placement_table, bool):
            raise InvalidValue(f"placement_table: must be true or false, got {self.placement_table!r}")
        self.metrics_endpoint()  # raises naming the setting
        if self.disk_dir and self.disk_size == 0:
            object.__setattr__(self, "disk_size", default_disk_bytes(self.disk_dir))
        self.store_config()  # the engine validates its own fields, with their names

    @property
    def address(self) -> str:
        return self.socket if "://" in self.socket else f"unix://{self.socket}"

    def metrics_endpoint(self) -> tuple[str, int] | None:
        """``metrics_address`` as ``(host, port)``, or None when there is no HTTP endpoint."""
        raw = self.metrics_address
        if raw is None or raw == "":
            return None
        text = str(raw).strip()
        host, sep, port = text.rpartition(":")
        host = host.strip("[]") if sep else "127.0.0.1"
        if not isinstance(raw, str | int) or isinstance(raw, bool) or not port.isdigit() or int(port) > 65535:
            raise InvalidValue(
                'metrics_address: where to serve Prometheus metrics, "HOST:PORT" or a port such as 9464 '
                f'("" for none), got {raw!r}'
            )
        return host or "0.0.0.0", int(port)

    def store_config(self) -> Any:
        from kvstrata.store import StoreConfig

        return StoreConfig(
            memory_bytes=self.memory,
            disk_dir=self.disk_dir or None,
            disk_bytes=self.disk_size if self.disk_dir else 0,
            gpu_bytes=self.gpu_memory,
            gpu_device=self.gpu_device,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            hugepages=self.hugepages,
            numa_node=self.numa_node,
            segment_bytes=min(self.segment_size, self.memory),
            disk_sync=self.disk_sync,
        )

    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        *,
        config_file: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> WorkerConfig:
        """Merge defaults < YAML file < ``KVSTRATA_<FIELD>`` environment < ``flags`` (None values ignored).

        With no socket set anywhere, a ``KVSTRATA_WORKER`` (what clients use) that names a Unix socket, as
        ``unix://PATH`` or a bare path, is the socket.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        clients_look_at = environ.get("KVSTRATA_WORKER", "")
        if clients_look_at and ("://" not in clients_look_at or clients_look_at.startswith("unix://")):
            values["socket"] = worker_address(clients_look_at)  # a bare path means the same to clients
        if config_file:
            values.update(_read_yaml(config_file))
        values.update(_from_environ(environ))
        values.update({k: v for k, v in (flags or {}).items() if v is not None})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise InvalidValue(f"unknown worker setting(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return cls(**values)

    def apply_logging(self) -> None:
        logging.getLogger("kvstrata").setLevel(self.log_level.upper())


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise InvalidValue(f"config: cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise InvalidValue(f"config: {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidValue(f"config: {path} must hold a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    types = {f.name: f.type for f in dataclasses.fields(WorkerConfig)}
    out: dict[str, Any] = {}
    for name, typ in types.items():
        raw = environ.get(f"KVSTRATA_{name.upper()}")
        if raw is None:
            continue
        out[name] = _coerce(name, raw, str(typ))
    return out


def _coerce(name: str, raw: str, typ: str) -> Any:
    try:
        if typ == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise InvalidValue(raw)
            return raw.lower() in ("1", "true", "yes", "on")
        if typ == "float":
            return float(raw)
        if name == "socket_mode":
            return int(raw, 8)
        if name == "gpu_device":
            return None if raw.lower() in ("", "none") else int(raw)
    except ValueError:
        raise InvalidValue(f"KVSTRATA_{name.upper()}: cannot read {raw!r} as {typ}") from None
    return raw


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidValue(f"{name}: expected an integer, 'auto' or 'none', got {raw!r}") from None
