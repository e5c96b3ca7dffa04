"""``kvstrata worker``: run this node's worker in the foreground (SIGTERM/SIGINT: clean shutdown)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvstrata.errors import KvstrataError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run the node's worker (shared-memory store served over a Unix socket)",
        description="Run the node's worker in the foreground. Every flag can also be set in the YAML file "
        "(--config) or as KVSTRATA_<FLAG> in the environment; flags win, then the environment, then the file.",
    )
    p.add_argument(
        "--socket",
        help="Unix socket path or address (default: $XDG_RUNTIME_DIR/kvstrata/worker.sock, "
        "else /tmp/kvstrata-<uid>/worker.sock)",
    )
    p.add_argument("--memory", help="DRAM tier size, e.g. 8GiB (default: 25%% of RAM, at most 64 GiB)")
    p.add_argument("--disk-dir", dest="disk_dir", help="SSD tier folder ('' for none; default ~/.cache/kvstrata/disk)")
    p.add_argument("--disk-size", dest="disk_size", help="SSD tier size, e.g. 100GiB (default: from free space)")
    p.add_argument("--gpu-memory", dest="gpu_memory", help="HBM tier size on --gpu-device (default: none)")
    p.add_argument("--gpu-device", dest="gpu_device", type=int, help="CUDA device of the HBM tier")
    p.add_argument("--segment-size", dest="segment_size", help="DRAM tier growth step (default 256MiB)")
    p.add_argument("--hugepages", choices=("auto", "on", "off"), help="huge pages for the DRAM tier")
    p.add_argument(
        "--numa-node", dest="numa_node", help="bind the DRAM tier to this NUMA node ('auto': the GPU's; 'none')"
    )
    p.add_argument("--socket-mode", dest="socket_mode", help="socket file mode, in octal (default 0600)")
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
        action="store_const",
        const=True,
        help="fsync every SSD file, spills and write-back flushes too (write_through ones always are)",
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
        "--log-level",
        dest="log_level",
        choices=("debug", "info", "warning", "error"),
        help="what the worker logs (default info; -v / -vv before 'worker' mean info / debug too)",
    )
    p.add_argument("--config", help="YAML file of settings (same names as the flags, with underscores)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvstrata.server import Worker, WorkerConfig

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
    try:
        worker = Worker(config).start()
    except (KvstrataError, ValueError, OSError) as exc:
        print(f"kvstrata worker: cannot start: {exc}", file=sys.stderr)
        return 1
    worker.serve_forever()
    return 0
