"""``kvstrata worker``: run this node's worker in the foreground (SIGTERM/SIGINT/SIGHUP: clean shutdown).

Exit status: 0 stopped cleanly; 1 could not start; 2 bad settings; 3 (:data:`EXIT_WRITE_BACK_LOST`) stopped, but
write-back data could not be flushed to SSD and is lost.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvstrata.errors import KvstrataError

#: the exit status of a worker that stopped with write-back objects it could not flush to SSD (lost)
EXIT_WRITE_BACK_LOST = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run the node's worker (shared-memory store served over a Unix socket)",
        description="Run the node's worker in the foreground. Every flag can also be set in the YAML file "
        "(--config, or KVSTRATA_CONFIG) under its name with underscores (disk_size, no_placement_table), or as "
        "KVSTRATA_<FLAG> in the environment (KVSTRATA_DISK_SIZE, KVSTRATA_NO_DISK_SYNC=1); flags win, then the "
        "environment, then the file. Without --socket or KVSTRATA_SOCKET, the worker listens at KVSTRATA_WORKER "
        "(where clients look) when that is set.",
        epilog="SIGTERM, SIGINT and SIGHUP stop the worker cleanly (write-back data flushed). Exit status: 0 stopped "
        "cleanly; 1 could not start; 2 bad settings; 3 stopped, but write-back data could not be written to SSD "
        "and is lost.",
    )
    p.add_argument(
        "--socket",
        help="Unix socket path, unix://PATH or tcp://HOST:PORT (default: $KVSTRATA_WORKER, else "
        "$XDG_RUNTIME_DIR/kvstrata/worker.sock, else /tmp/kvstrata-<uid>/worker.sock)",
    )
    p.add_argument(
        "--memory",
        help="DRAM tier size, e.g. 8GiB, at least 1MiB (default: 25%% of RAM, or of the cgroup's memory limit where "
        "lower; at most 64 GiB)",
    )
    p.add_argument("--disk-dir", dest="disk_dir", help="SSD tier folder ('' for none; default ~/.cache/kvstrata/disk)")
    p.add_argument(
        "--disk-size",
        dest="disk_size",
        help="SSD tier size, e.g. 100GiB; 0: no SSD tier (default: the size recorded in --disk-dir at its first "
        "start, which chose half the room there: free space plus the tier's files, at most 64 GiB)",
    )
    p.add_argument("--gpu-memory", dest="gpu_memory", help="HBM tier size on --gpu-device (default: none)")
    p.add_argument("--gpu-device", dest="gpu_device", type=int, help="CUDA device of the HBM tier")
    p.add_argument("--segment-size", dest="segment_size", help="DRAM tier growth step, at least 1MiB (default 256MiB)")
    p.add_argument("--hugepages", choices=("auto", "on", "off"), help="huge pages for the DRAM tier")
    p.add_argument(
        "--numa-node", dest="numa_node", help="bind the DRAM tier to this NUMA node ('auto': the GPU's; 'none')"
    )
    p.add_argument(
        "--socket-mode",
        dest="socket_mode",
        help="socket file mode, in octal (default 0600); 0660/0666 also give the folder kvstrata makes for the socket "
        "the group's/others' search (x) bit, and a warning names any folder above that keeps them out",
    )
    p.add_argument(
        "--high-watermark",
        dest="high_watermark",
        type=float,
        help="DRAM use (a fraction of the tier) above which objects are spilled or evicted (default 0.9)",
    )
    p.add_argument("--low-watermark", dest="low_watermark", type=float, help="where that eviction stops (default 0.8)")
    p.add_argument(
        "--disk-sync",
        dest="disk_sync",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fsync every SSD file, spills and write-back flushes too (write_through ones always are); "
        "--no-disk-sync: not those (the default, and over a file's or the environment's setting)",
    )
    p.add_argument(
        "--spin-us",
        dest="spin_us",
        type=float,
        help="busy-poll for a lone client's next request this many microseconds before sleeping (200; 0: off)",
    )
    p.add_argument(
        "--no-placement-table",
        dest="placement_table",
        action="store_const",
        const=False,
        help="no table of where objects lie: cold device reads wait for their leases before copying",
    )
    p.add_argument(
        "--metrics-address",
        dest="metrics_address",
        help="serve Prometheus metrics over HTTP at HOST:PORT/metrics (a bare port: 127.0.0.1; default: none)",
    )
    p.add_argument(
        "--cluster",
        help="join this cluster: etcd://HOST:PORT[,HOST:PORT...][/NAME], or etcds://... over TLS "
        "(?cacert=&cert=&key=, else $KVSTRATA_ETCD_CACERT/_CERT/_KEY); etcd auth: ?user=NAME or $KVSTRATA_ETCD_USER, "
        "password in $KVSTRATA_ETCD_PASSWORD (default: none, this node alone)",
    )
    p.add_argument(
        "--cluster-listen",
        dest="cluster_listen",
        help="in a cluster, where to listen for clients and peers of other hosts (default tcp://0.0.0.0:0, any port)",
    )
    p.add_argument(
        "--cluster-advertise",
        dest="cluster_advertise",
        help="the tcp://HOST:PORT other hosts reach --cluster-listen at (default: its own, with this host's IP for "
        "a wildcard host)",
    )
    p.add_argument("--node-id", dest="node_id", help="this worker's name in the cluster (default: HOST:PORT)")
    p.add_argument(
        "--cluster-ttl",
        dest="cluster_ttl",
        type=float,
        help="seconds a dead worker stays listed in the cluster before its keys go to others (default 10)",
    )
    p.add_argument(
        "--cluster-drain",
        dest="cluster_drain",
        type=float,
        help="seconds a worker stopping on purpose (SIGTERM, SIGINT) may spend handing its objects to the workers "
        "that own their keys without it (default 0: none, its keys leave with it)",
    )
    p.add_argument(
        "--cluster-replicas",
        dest="cluster_replicas",
        type=int,
        help="how many workers keep each key: the default of the cluster's clients, and what a drain or a rebalance "
        "restores (default 1)",
    )
    p.add_argument(
        "--no-cluster-rebalance",
        dest="cluster_rebalance",
        action="store_const",
        const=False,
        help="move no data when the member list changes (default: each worker copies its objects to their keys' new "
        "owners and drops those it no longer owns)",
    )
    p.add_argument(
        "--auth-token-file",
        dest="auth_token_file",
        help="a file holding the secret token clients and other workers must prove they hold to use this worker's "
        "TCP listeners (they set $KVSTRATA_TOKEN; it never crosses the wire; default: $KVSTRATA_TOKEN if set, else "
        "none)",
    )
    p.add_argument(
        "--log-level",
        dest="log_level",
        choices=("debug", "info", "warning", "error"),
        help="what the worker logs (default info; -v / -vv before 'worker' mean info / debug too)",
    )
    p.add_argument(
        "--config", help="YAML file of settings (same names as the flags, with underscores; default $KVSTRATA_CONFIG)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.server import Worker, WorkerConfig
    from kvstrata.server.worker import SHUTDOWN_SIGNALS

    flags = {
        k: getattr(args, k)
        for k in (
            "socket",
            "memory",
            "disk_dir",
            "disk_size",
            "gpu_memory",
            "gpu_device",
            "segment_size",
            "hugepages",
            "numa_node",
            "socket_mode",
            "high_watermark",
            "low_watermark",
            "disk_sync",
            "log_level",
            "spin_us",
            "placement_table",
            "metrics_address",
            "cluster",
            "cluster_listen",
            "cluster_advertise",
            "node_id",
            "cluster_ttl",
            "cluster_drain",
            "cluster_replicas",
            "cluster_rebalance",
            "auth_token_file",
        )
    }
    if flags["log_level"] is None and getattr(args, "verbose", 0):
        flags["log_level"] = "debug" if args.verbose > 1 else "info"
    try:
        config = WorkerConfig.load(flags, config_file=args.config)
    except ValueError as exc:
        print(f"kvstrata worker: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("kvstrata").setLevel(config.log_level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A signal while the worker starts (its socket may be there already) waits for serve_forever, which stops at once
    pending: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():  # (signal handlers are the main thread's)
        previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in SHUTDOWN_SIGNALS}
    try:
        worker = Worker(config).start()
    except (KvstrataError, ValueError, OSError) as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print(f"kvstrata worker: cannot start: {exc}", file=sys.stderr)
        return 1
    if pending:
        worker._on_signal(pending[0])
    lost = worker.serve_forever()
    if lost:
        print(
            f"kvstrata worker: stopped, but {lost} write-back objects could not be written to SSD and are lost "
            f"(exit status {EXIT_WRITE_BACK_LOST})",
            file=sys.stderr,
        )
        return EXIT_WRITE_BACK_LOST
    return 0
