"""``kvstrata bench <job>``: one benchmark module per job under ``kvstrata.bench``.

A job module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Jobs are listed here so
``kvstrata bench --help`` shows them even when a job's own dependencies are missing.
"""

from __future__ import annotations

import argparse
import importlib

# job name -> (module, one-line help)
JOBS: dict[str, tuple[str, str]] = {
    "gather": ("kvstrata.bench.gather", "gather rows from pinned host memory: kvstrata vs table[ids].to(cuda) and DMA"),
    "transfer": ("kvstrata.bench.transfer", "KV block transfer methods vs the DMA ceiling and baselines"),
    "prefix": (
        "kvstrata.bench.prefix",
        "a paged KV cache's offload and prefix reuse (PrefixKVCache) vs per-piece torch copies and DMA",
    ),
    "allgather": ("kvstrata.bench.allgather", "hybrid all-gather (NCCL + host path) vs NCCL and the host path alone"),
    "device": ("kvstrata.bench.device", "GPU-to-GPU device objects vs peer copy and NCCL (2 GPUs; --smoke: CPU)"),
    "checkpoint": (
        "kvstrata.bench.checkpoint",
        "a model's weights saved and loaded through a worker vs torch.save/torch.load via /dev/shm (and DMA on a GPU)",
    ),
    "cluster": (
        "kvstrata.bench.cluster",
        "a cluster of workers over etcd (ClusterClient, replicas 1/2, TCP) vs one worker direct; failover time",
    ),
    "store": (
        "kvstrata.bench.store",
        "kvstrata's node-local clients vs Redis and Mooncake Store: set/get 4KiB-16MiB (--sizes: any), 1 and 8 clients",
    ),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (kvstrata beside its baseline and ceiling)")
    jobs = parser.add_subparsers(dest="job", metavar="JOB")
    for job, (module_name, help_text) in JOBS.items():
        job_parser = jobs.add_parser(job, help=help_text)
        job_parser.add_argument("--out", default=None, help="folder for the JSON/PNG results (default bench/results)")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            job_parser.set_defaults(func=lambda args, exc=exc: _unavailable(args, exc))
            continue
        module.add_arguments(job_parser)
        job_parser.set_defaults(func=lambda args, run=module.run: _checked_run(run, args))
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _unavailable(args: argparse.Namespace, exc: ImportError) -> int:
    print(f"kvstrata bench {args.job}: unavailable here ({exc})")
    return 2


def _checked_run(run, args: argparse.Namespace) -> int:
    """Run a job once its results folder is known to be usable (a bad --out fails before the run, not after)."""
    from kvstrata.bench._common import results_folder

    results_folder(args.out)
    return run(args)
