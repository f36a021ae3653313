"""The `mbridge-epoverlap` command: thin subcommands over the library.

Each subcommand lives in the module that owns its feature and exposes `register(subparsers)`, which
adds a parser whose `handler` default is a callable `handler(args) -> int`. Registration imports
only argparse-level code so `--help` stays fast; heavy imports happen inside handlers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from mbridge_epoverlap import __version__
from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_USAGE, UsageError

# (module, description) per subcommand; the module provides register(subparsers).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "mbridge_epoverlap.config.cli",
    "mbridge_epoverlap.profiling.cli",
    "mbridge_epoverlap.schedule.cli",
    "mbridge_epoverlap.serving.cli",
    "mbridge_epoverlap.serving.serve_cli",
    "mbridge_epoverlap.serving.elastic_cli",
)


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on usage errors already; keep its message short and on stderr."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mbridge-epoverlap", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(handler(args) or 0)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`... --json | head`); silence the flush at exit too.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
