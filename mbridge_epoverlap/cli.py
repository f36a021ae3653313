"""The `mbridge-epoverlap` command: check, measure and plan expert-parallel overlap of MoE models.

Each subcommand lives in the module that owns its feature and exposes `register(subparsers)`, which
adds a parser whose `handler` default is a callable `handler(args) -> int`. Registration imports
only argparse-level code so `--help` stays fast; heavy imports happen inside handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mbridge_epoverlap import __version__
from mbridge_epoverlap.errors import EXIT_USAGE, UsageError

# (module, description) per subcommand; the module provides register(subparsers).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "mbridge_epoverlap.config.cli",
    "mbridge_epoverlap.profiling.cli",
    "mbridge_epoverlap.schedule.cli",
    "mbridge_epoverlap.serving.cli.plan",
    "mbridge_epoverlap.comm.cli",
    "mbridge_epoverlap.serving.cli.serve",
    "mbridge_epoverlap.serving.cli.elastic",
)


DESCRIPTION = """\
Check, measure and plan expert-parallel (EP) communication overlap of Mixture-of-Experts models:
validate a recipe's overlap settings for a cluster before submitting it, read overlap from profiler
traces, simulate overlap schedules and plan disaggregated serving deployments.

Training A/B runs (overlap off vs on, on CPU here or on a Slurm cluster) are started with
scripts/performance/run_script.py (see its --help).
"""

EPILOG = """\
examples:
  mbridge-epoverlap validate -mr qwen3_30b_a3b -g h100 --te-version 2.9 comm_overlap.delay_wgrad_compute=true
  mbridge-epoverlap profile off_traces/ on_traces/ --compare
  mbridge-epoverlap plan --model Mixtral-8x22B --attn-gpu H20 --expert-gpu L40S
  mbridge-epoverlap simulate --schedule pingpong --micro-batches 3 --t-comm 0.3
  python scripts/performance/run_script.py -g cpu -ng 2 --ab ep_overlap

exit status: 0 done (validate: valid), 1 failed (validate: invalid config), 2 usage error.
Run `mbridge-epoverlap COMMAND --help` for each command's options.
"""


class _Parser(argparse.ArgumentParser):
    """argparse exits with 2 on usage errors already; keep its message short and on stderr."""


def build_parser() -> argparse.ArgumentParser:
    from mbridge_epoverlap.envvars import env_epilog

    parser = _Parser(prog="mbridge-epoverlap", description=DESCRIPTION, epilog=EPILOG + "\n" + env_epilog(),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    from mbridge_epoverlap.cli_io import reader_may_leave

    try:
        # A reader that leaves early (`... | head`) must not change the exit status.
        with reader_may_leave():
            return int(handler(args) or 0)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
