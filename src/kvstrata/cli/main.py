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

DESCRIPTION = "kvstrata: move and cache AI tensors across GPU memory, host memory and SSD on one node"

# Subcommand modules, in the order `kvstrata --help` lists them.
SUBCOMMAND_MODULES = [
    "kvstrata.cli.bench",
    "kvstrata.cli.demo",
    "kvstrata.cli.worker",
    "kvstrata.cli.status",
    "kvstrata.cli.native",
]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``command``, only that subcommand's module is imported (the benches import torch,
    which would make ``kvstrata status`` take seconds)."""
    parser = argparse.ArgumentParser(prog="kvstrata", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        if command is not None and name.rsplit(".", 1)[1] != command:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # keep the rest of the CLI usable
            logging.getLogger(__name__).debug("subcommand %s unavailable: %s", name, exc)
            continue
        module.register(subparsers)
    return parser


def _command_named(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), if it is one of ours."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in {m.rsplit(".", 1)[1] for m in SUBCOMMAND_MODULES} else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_named(argv))
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
