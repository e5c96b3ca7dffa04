"""``kvstrata`` entry point: a thin dispatcher over subcommand modules.

Each subcommand lives in its own module under ``kvstrata.cli`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a callable taking the parsed
arguments and returning an exit code. A module that fails to import (a missing optional
dependency) does not take the other commands down with it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules, in the order `kvstrata --help` lists them.
SUBCOMMAND_MODULES = [
    "kvstrata.cli.bench",
    "kvstrata.cli.demo",
    "kvstrata.cli.worker",
    "kvstrata.cli.status",
    "kvstrata.cli.native",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # keep the rest of the CLI usable
            logging.getLogger(__name__).debug("subcommand %s unavailable: %s", name, exc)
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
