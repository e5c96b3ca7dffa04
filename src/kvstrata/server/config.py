"""Worker configuration: one frozen dataclass, built at the edge from flags, a YAML file and the environment.

Precedence, lowest first: defaults sized from the machine, ``--config file.yaml`` (or ``KVSTRATA_CONFIG``),
``KVSTRATA_*`` environment variables, command-line flags. Every field can be set each way, under the same name
(``memory``/``KVSTRATA_MEMORY``/``--memory``); sizes accept ``8GiB``-style strings. A true/false setting also
takes its flag's negative name (``no_placement_table: true``, ``KVSTRATA_NO_DISK_SYNC=1``). ``KVSTRATA_WORKER``
(where clients look) is the socket when ``KVSTRATA_SOCKET`` is not set, ranked as the environment. Paths may
start with ``~``. An unknown ``KVSTRATA_*`` variable is warned about (a typo would otherwise go unnoticed).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.errors import InvalidValue
from kvstrata.units import format_size, parse_size

log = logging.getLogger("kvstrata.worker")

MEMORY_FRACTION = 0.25  # of physical RAM (or the cgroup's limit, when lower), by default
MEMORY_CAP = 64 << 30  # default memory tier never above this; set --memory for more
MEMORY_MIN = 1 << 20  # the smallest memory tier, and memory tier segment, a worker takes
DISK_DEFAULT = 64 << 30
DISK_FRACTION = 0.5  # of the room where the disk tier lives (free space plus its own files), at most
#: in the disk tier's folder: the size chosen for it at its first start with no --disk-size, reused by later starts
#: (measured again, the room would leave out what other files took since, and shrink the tier below its data)
DISK_SIZE_FILE = "kvstrata-disk-size"
#: cgroup memory limits at or above this mean "no limit" (cgroup v1 writes 2**63 rounded down to a page)
_CGROUP_NO_LIMIT = 1 << 60


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
    ``KVSTRATA_WORKER``) is the worker's Unix socket; ``~`` in a path is the home folder. An empty address is
    an InvalidValue (not a connect to the current folder, retried until the timeout)."""
    if address is None:
        address = default_address()
    if isinstance(address, str) and not address.strip():
        raise InvalidValue("address: empty; give a socket path or an address such as 'unix:///run/kv.sock'")
    if isinstance(address, str) and address.startswith("unix://~"):
        return "unix://" + os.path.expanduser(address.removeprefix("unix://"))
    return address if "://" in address else f"unix://{os.path.abspath(os.path.expanduser(address))}"


def default_memory_bytes() -> int:
    """A quarter of RAM, or of the cgroup's memory limit where that is lower; at least 64 MiB, at most 64 GiB."""
    return max(64 << 20, min(int(memory_available() * MEMORY_FRACTION), MEMORY_CAP))


def physical_memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def memory_available() -> int:
    """What this process may use: physical RAM, or the cgroup's memory limit where that is lower."""
    total = physical_memory_bytes()
    limit = cgroup_memory_limit()
    return total if limit is None else min(total, limit)


def cgroup_memory_limit(*, root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The lowest memory limit of this process's cgroup and its ancestors, or None where there is none.

    cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``): ``/proc/self/cgroup`` says where the process
    is; a container whose cgroup is mounted as the root sees its own limit at the top, which the walk up reaches.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            base, name = Path(root), "memory.max"  # v2, the unified hierarchy
        elif "memory" in controllers.split(","):
            base, name = Path(root) / "memory", "memory.limit_in_bytes"  # v1
        else:
            continue
        rel = Path(path.lstrip("/"))
        for folder in (rel, *rel.parents):
            try:
                text = (base / folder / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit() and 0 < int(text) < _CGROUP_NO_LIMIT:
                limits.append(int(text))
    return min(limits) if limits else None


def default_disk_dir() -> str:
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstrata" / "disk")


def default_disk_bytes(disk_dir: str) -> int:
    """The SSD tier's size when none is given: the one recorded at its first start (:data:`DISK_SIZE_FILE`), else
    half the room where it lives (the file system's free space plus the files already in ``disk_dir``: the tier's
    own data must not shrink it), at least 64 MiB, at most 64 GiB."""
    import shutil

    recorded = recorded_disk_bytes(disk_dir)
    if recorded is not None:
        return recorded
    probe = Path(disk_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return DISK_DEFAULT
    return max(64 << 20, min(DISK_DEFAULT, int((free + _bytes_in(disk_dir)) * DISK_FRACTION)))


def recorded_disk_bytes(disk_dir: str) -> int | None:
    """The size recorded in ``disk_dir`` at the SSD tier's first start, or None (none, or not readable)."""
    try:
        text = (Path(disk_dir) / DISK_SIZE_FILE).read_text().split("#", 1)[0].strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) <= 0:
        log.warning("ignoring %s: not a size in bytes (%r)", Path(disk_dir) / DISK_SIZE_FILE, text[:40])
        return None
    return int(text)


def record_disk_bytes(disk_dir: str, nbytes: int) -> bool:
    """Write ``nbytes`` to ``disk_dir``'s :data:`DISK_SIZE_FILE` (atomically); False if it could not be written."""
    path = Path(disk_dir) / DISK_SIZE_FILE
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(f"{nbytes}  # SSD tier size in bytes chosen at its first start; --disk-size overrides\n")
        os.replace(partial, path)
    except OSError as exc:
        log.warning("could not record the SSD tier's size in %s: %s", path, exc)
        return False
    return True


def _bytes_in(folder: str) -> int:
    """Bytes of the files directly in ``folder`` (the SSD tier keeps its files there); 0 if it is not there."""
    total = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    except OSError:
        return 0
    return total


_SIZE_FIELDS = ("memory", "disk_size", "gpu_memory", "segment_size")
_LEVELS = ("debug", "info", "warning", "error")
#: the store's names for the worker's settings (its errors name them)
_STORE_NAMES = {
    "memory_bytes": "memory",
    "disk_bytes": "disk_size",
    "gpu_bytes": "gpu_memory",
    "segment_bytes": "segment_size",
}
#: KVSTRATA_* variables read elsewhere than the worker's settings (grep the sources for os.environ): never warned about
OTHER_VARIABLES = frozenset(
    {
        "KVSTRATA_WORKER",  # where clients look for the worker (and where a worker listens, without a socket set)
        "KVSTRATA_TOKEN",  # the token a worker's TCP listeners ask for, and clients answer with (kvstrata.transport)
        "KVSTRATA_CONFIG",  # the worker's YAML file, without --config
        "KVSTRATA_LOG",  # kvstrata.devobj.debug
        "KVSTRATA_CACHE_DIR",  # kvstrata.ops.calibration
        "KVSTRATA_AUTO_CALIBRATE",
        "KVSTRATA_AG_FLAG_KERNEL",  # kvstrata.comm.hostpath
        "KVSTRATA_HUGE_FRAMES",  # kvstrata.transport.stream: 0 asks for no huge pages under large frames
        "KVSTRATA_TEST_WAIT",  # the tests
        # tools/
        "KVSTRATA_ASYNC_MSET_THREADS",
        "KVSTRATA_DOZE_US",
        "KVSTRATA_JOIN_LEGACY",
        "KVSTRATA_PROFILE_SUBSCRIBER",
    }
)
#: families of KVSTRATA_* variables read elsewhere (device objects, the native module, staging, the benches, and the
#: etcd TLS files, user and password of kvstrata.cluster.etcd)
OTHER_PREFIXES = ("KVSTRATA_DEVOBJ_", "KVSTRATA_NATIVE", "KVSTRATA_STAGING_", "KVSTRATA_BENCH_", "KVSTRATA_ETCD_")


def flag_of(name: str) -> str:
    """The ``kvstrata worker`` flag of setting ``name``."""
    if name in ("placement_table", "cluster_rebalance"):  # (on by default: the flag turns it off)
        return "--no-" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


def _named(name: str) -> str:
    """``"memory (--memory)"``: how an error names a setting, which may have come from a file, a variable or a flag."""
    return f"{name} ({flag_of(name)})"


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs. ``WorkerConfig.load(flags={"memory": "8GiB"})`` fills the rest.

    ``disk_dir=""`` (or ``disk_size=0``) turns the SSD tier off. Sizes below :data:`MEMORY_MIN` are refused, naming
    the setting and its flag (``memory (--memory): must be at least 1.0 MiB``).
    """

    socket: str = field(default_factory=default_socket_path)
    socket_mode: int = 0o600
    memory: int = field(default_factory=default_memory_bytes)
    disk_dir: str = field(default_factory=default_disk_dir)
    #: None: the size recorded in disk_dir at the tier's first start, else chosen then from the room there
    #: (see default_disk_bytes); 0: no SSD tier (as disk_dir "")
    disk_size: int | None = None
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
    #: the cluster this worker joins (``etcd://HOST:PORT/NAME``, ``etcds://`` over TLS; kvstrata.cluster); "": none
    cluster: str = ""
    #: where the worker also listens for clients and peers of other hosts, in cluster mode (port 0: any free one)
    cluster_listen: str = "tcp://0.0.0.0:0"
    #: the address other hosts reach that listener at ("": its own, with a wildcard host replaced by this host's IP)
    cluster_advertise: str = ""
    #: the worker's name in the cluster ("": HOST:PORT of its cluster address)
    node_id: str = ""
    #: seconds a dead worker stays listed in the cluster (its etcd lease), renewed every third of that
    cluster_ttl: float = 10.0
    #: seconds a worker stopping on purpose may spend handing its objects to the workers that own their keys once
    #: it is gone (kvstrata.server.drain); 0 (the default): none, its keys leave with it
    cluster_drain: float = 0.0
    #: how many workers each key is kept on (clients that do not choose write each key to that many; a drain and a
    #: rebalance restore that many copies)
    cluster_replicas: int = 1
    #: on each change of the member list, copy this worker's objects to the workers that now own their keys and drop
    #: those it no longer owns (kvstrata.server.rebalance); off: a change moves no data (clients still find a key
    #: written before one change)
    cluster_rebalance: bool = True
    #: a file holding the secret token clients and peers must prove they hold to use this worker's TCP listeners
    #: (kvstrata.transport.core: a challenge, the token never sent); "" (the default): ``$KVSTRATA_TOKEN`` if set,
    #: else none. Unix sockets are guarded by their file mode instead.
    auth_token_file: str = ""

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            if name == "disk_size" and self.disk_size is None:
                continue
            object.__setattr__(self, name, parse_size(getattr(self, name), _named(name)))
        if isinstance(self.numa_node, str):  # from a flag, the environment or the file: "Auto", "NONE" too
            node = self.numa_node.strip().lower()
            if node != "auto":
                node = None if node in ("none", "off", "") else _int("numa_node", node)
            object.__setattr__(self, "numa_node", node)
        if not isinstance(self.socket, str) or not self.socket.strip():
            raise InvalidValue(f"socket: must be a path or address, got {self.socket!r}")
        object.__setattr__(self, "socket", _expand_socket(self.socket))
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
        if self.disk_dir:
            object.__setattr__(self, "disk_dir", os.path.expanduser(self.disk_dir))
        for name in ("memory", "segment_size", "disk_size"):
            value = getattr(self, name)
            if value is not None and (value > 0 or name != "disk_size") and value < MEMORY_MIN:
                raise InvalidValue(
                    f"{_named(name)}: must be at least {format_size(MEMORY_MIN)}, got {value} bytes"
                    + (" (a bare number is bytes: write the unit, such as 8GiB)" if value else "")
                    + (" (0 turns the SSD tier off)" if name == "disk_size" else "")
                )
        if self.disk_size == 0:  # the SSD tier's size is none: no SSD tier, as with disk_dir ""
            object.__setattr__(self, "disk_dir", "")
        if self.log_level not in _LEVELS:
            raise InvalidValue(f"log_level: must be one of {', '.join(_LEVELS)}, got {self.log_level!r}")
        if isinstance(self.spin_us, bool) or not isinstance(self.spin_us, int | float) or not 0 <= self.spin_us <= 1e5:
            raise InvalidValue(f"spin_us: must be a number of microseconds in [0, 100000], got {self.spin_us!r}")
        if not isinstance(self.placement_table, bool):
            raise InvalidValue(f"placement_table: must be true or false, got {self.placement_table!r}")
        high, low = self.high_watermark, self.low_watermark
        if _real(high) and _real(low) and 0 < high <= 1 and low > high:
            raise InvalidValue(
                f"{_named('high_watermark')} {high} is below {_named('low_watermark')} {low}, where eviction stops: "
                f"lower --low-watermark too (below {high})"
            )
        self.metrics_endpoint()  # raises naming the setting
        self._check_cluster()
        if not self.disk_dir:
            object.__setattr__(self, "disk_size", 0)
        elif self.disk_size is None:
            object.__setattr__(self, "disk_size", default_disk_bytes(self.disk_dir))
            object.__setattr__(self, "_disk_size_default", True)  # Worker.start records it (record_default_disk_size)
        try:
            self.store_config()  # the engine validates its own fields, with their names
        except InvalidValue as exc:
            raise InvalidValue(_in_worker_names(str(exc))) from None

    def _check_cluster(self) -> None:
        """The cluster settings' form (etcd is reached only at start)."""
        from kvstrata.cluster.membership import check_node_id, check_ttl

        if not isinstance(self.cluster, str):
            raise InvalidValue(
                f"{_named('cluster')}: must be an address such as etcd://HOST:2379/NAME, got {self.cluster!r}"
            )
        scheme = self.cluster.partition("://")[0] if "://" in self.cluster else None
        if self.cluster and scheme not in ("etcd", "etcds", "inproc"):
            raise InvalidValue(
                f"{_named('cluster')}: must be etcd://HOST:PORT[/NAME], etcds://HOST:PORT[/NAME] (over TLS) "
                f"(or inproc://NAME in one process), got {self.cluster!r}"
            )
        for name in ("cluster_listen", "cluster_advertise"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not _is_tcp_address(value)):
                raise InvalidValue(f"{_named(name)}: must be tcp://HOST:PORT, got {value!r}")
        if self.node_id:
            try:
                check_node_id(self.node_id)
            except ValueError as exc:
                raise InvalidValue(f"{_named('node_id')}: {exc}".replace("node_id: ", "")) from None
        try:
            check_ttl(self.cluster_ttl)
        except ValueError as exc:
            raise InvalidValue(f"{_named('cluster_ttl')}: {exc}".replace("ttl: ", "")) from None
        if not _real(self.cluster_drain) or self.cluster_drain < 0:
            raise InvalidValue(f"{_named('cluster_drain')}: seconds, 0 or more, got {self.cluster_drain!r}")
        if type(self.cluster_replicas) is not int or not 1 <= self.cluster_replicas <= 16:
            raise InvalidValue(f"{_named('cluster_replicas')}: an int from 1 to 16, got {self.cluster_replicas!r}")
        if not isinstance(self.auth_token_file, str):
            raise InvalidValue(f"{_named('auth_token_file')}: a path, got {self.auth_token_file!r}")
        if self.auth_token_file:
            self.auth_token()  # (a file that is missing, unreadable or empty: named now, not at start)
        if not isinstance(self.cluster_rebalance, bool):
            raise InvalidValue(f"{_named('cluster_rebalance')}: must be true or false, got {self.cluster_rebalance!r}")

    def auth_token(self, environ: Mapping[str, str] | None = None) -> bytes | None:
        """The token this worker's TCP listeners ask for: the ``auth_token_file``'s contents (surrounding whitespace
        dropped), else ``$KVSTRATA_TOKEN``; None: none. InvalidValue for a file that cannot be read or is empty."""
        if not self.auth_token_file:
            token = (os.environ if environ is None else environ).get("KVSTRATA_TOKEN", "").strip()
            return token.encode() or None
        try:
            with open(os.path.expanduser(self.auth_token_file), "rb") as f:
                token = f.read(1 << 16).strip()
        except OSError as exc:
            raise InvalidValue(f"{_named('auth_token_file')}: cannot read {self.auth_token_file}: {exc}") from None
        if not token:
            raise InvalidValue(f"{_named('auth_token_file')}: {self.auth_token_file} is empty")
        return token

    @property
    def disk_size_is_default(self) -> bool:
        """Whether ``disk_size`` was not given (so :func:`default_disk_bytes` chose it)."""
        return bool(getattr(self, "_disk_size_default", False))

    def record_default_disk_size(self) -> None:
        """With no size given, record the SSD tier's size in its folder, if none is there yet (a worker calls this
        once the store made the folder): later starts keep the size, whatever the room then."""
        if not (self.disk_dir and self.disk_size_is_default) or recorded_disk_bytes(self.disk_dir) is not None:
            return
        if record_disk_bytes(self.disk_dir, self.disk_size):
            log.info(
                "SSD tier size %s recorded in %s (later starts keep it; --disk-size sets another)",
                format_size(self.disk_size),
                Path(self.disk_dir) / DISK_SIZE_FILE,
            )

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

        With no ``config_file``, ``KVSTRATA_CONFIG`` names the YAML file. With no ``KVSTRATA_SOCKET``, a
        ``KVSTRATA_WORKER`` (what clients use: ``unix://PATH``, a bare path or ``tcp://HOST:PORT``) is the
        socket, ranked as the environment: above the file, below the flags. ``no_<setting>`` (YAML) and
        ``KVSTRATA_NO_<SETTING>`` set a true/false setting to the opposite, as ``--no-placement-table`` does.
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if config_file is None:
            config_file = environ.get("KVSTRATA_CONFIG") or None
        if config_file:
            values.update(_read_yaml(os.path.expanduser(config_file)))
        from_environ = _from_environ(environ)
        clients_look_at = environ.get("KVSTRATA_WORKER", "")
        if clients_look_at.strip() and "socket" not in from_environ:
            from_environ["socket"] = worker_address(clients_look_at)  # a bare path means the same to clients
        values.update(from_environ)
        values.update({k: v for k, v in (flags or {}).items() if v is not None})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise InvalidValue(f"unknown worker setting(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return cls(**values)

    def apply_logging(self) -> None:
        logging.getLogger("kvstrata").setLevel(self.log_level.upper())


def _is_tcp_address(address: str) -> bool:
    host, colon, port = address.removeprefix("tcp://").rpartition(":")
    return address.startswith("tcp://") and bool(colon and host) and port.isdigit() and int(port) < 65536


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
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    for name in _BOOL_FIELDS:
        negative = f"no_{name}"
        if negative in values:
            flag = values.pop(negative)
            if not isinstance(flag, bool):
                raise InvalidValue(f"config: {negative} in {path}: must be true or false, got {flag!r}")
            if name in values and values[name] is flag:
                raise InvalidValue(f"config: {path} sets both {name}: {values[name]} and {negative}: {flag}")
            values[name] = not flag
    return values


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    types = {f.name: f.type for f in dataclasses.fields(WorkerConfig)}
    out: dict[str, Any] = {}
    for name, typ in types.items():
        raw = environ.get(f"KVSTRATA_{name.upper()}")
        if raw is not None:
            out[name] = _coerce(name, raw, str(typ))
        negative = f"KVSTRATA_NO_{name.upper()}"
        if name in _BOOL_FIELDS and environ.get(negative) is not None:
            value = not _coerce(f"no_{name}", environ[negative], "bool")
            if name in out and out[name] != value:
                raise InvalidValue(f"KVSTRATA_{name.upper()}={raw} and {negative}={environ[negative]} disagree")
            out[name] = value
    _warn_unknown_variables(environ, types)
    return out


def _warn_unknown_variables(environ: Mapping[str, str], fields: Mapping[str, Any]) -> None:
    """Log a warning for each ``KVSTRATA_*`` variable nothing reads: a misspelt setting is otherwise silently lost."""
    known = {f"KVSTRATA_{name.upper()}" for name in fields}
    known |= {f"KVSTRATA_NO_{name.upper()}" for name in _BOOL_FIELDS} | OTHER_VARIABLES
    for variable in sorted(environ):
        if not variable.startswith("KVSTRATA_") or variable in known or variable.startswith(OTHER_PREFIXES):
            continue
        near = difflib.get_close_matches(variable, sorted(known), n=1)
        log.warning(
            "ignoring %s: no kvstrata setting has that name%s",
            variable,
            f"; did you mean {near[0]}?" if near else " (a worker's is KVSTRATA_ and its flag's name: KVSTRATA_MEMORY)",
        )


def _coerce(name: str, raw: str, typ: str) -> Any:
    try:
        if typ == "bool":
            if raw.strip().lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(raw)
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if typ == "float":
            return float(raw)
        if name == "socket_mode":
            return int(raw, 8)
        if name == "gpu_device":
            return None if raw.lower() in ("", "none") else int(raw)
        if typ == "int" and name == "cluster_replicas":
            return int(raw)
    except ValueError:
        raise InvalidValue(f"KVSTRATA_{name.upper()}: cannot read {raw!r} as {typ}") from None
    return raw


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise InvalidValue(f"{name}: expected an integer, 'auto' or 'none', got {raw!r}") from None


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _expand_socket(socket: str) -> str:
    """``~`` at the start of a socket path (bare or ``unix://``) is the home folder."""
    if "://" not in socket:
        return os.path.expanduser(socket)
    if socket.startswith("unix://~"):
        return "unix://" + os.path.expanduser(socket.removeprefix("unix://"))
    return socket


def _in_worker_names(message: str) -> str:
    """A store error's message, naming the worker's setting and flag rather than the store's field."""
    head, sep, rest = message.partition(":")
    name = _STORE_NAMES.get(head, head)
    if sep and name in _FIELD_NAMES:
        return f"{_named(name)}:{rest}"
    return message


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(WorkerConfig))
_BOOL_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerConfig) if f.type == "bool")
