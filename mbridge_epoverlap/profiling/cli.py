"""`mbridge-epoverlap profile`: overlap figures from Nsight Systems or Kineto traces.

Registration is argparse only; numpy and the loaders are imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Communication/compute overlap per device from Nsight Systems SQLite exports or PyTorch/Kineto JSON
traces (.json, .json.gz; a folder means all per-rank traces in it). Builds the union of
communication intervals (NCCL, DeepEP, HybridEP, gloo) and of compute intervals and reports their
intersection, exposed communication and the active union; never sums kernel durations.
"""

EPILOG = """\
examples:
  mbridge-epoverlap profile rank0.sqlite
  mbridge-epoverlap profile traces/ --window steps:3:8 --json
  mbridge-epoverlap profile off.sqlite on.sqlite --compare
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `profile` subcommand."""
    parser = subparsers.add_parser(
        "profile",
        help="overlap of communication with compute in profiler traces",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace file or folder of per-rank traces")
    parser.add_argument("--json", action="store_true", help="print the JSON document instead of tables")
    parser.add_argument(
        "--comm-regex",
        metavar="R",
        help="extra pattern (case-insensitive, Python re) for communication kernel/range names",
    )
    parser.add_argument(
        "--window",
        metavar="START:END",
        help="time window from the trace's first kernel (ns, or units: 1.5s:3s, 200ms:) or steps:A:B",
    )
    parser.add_argument("--compare", action="store_true", help="two traces: before/after comparison block")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of `profile`; UsageError propagates to the CLI front end (exit 2)."""
    from mbridge_epoverlap.profiling.analyze import analyze_trace, compare_or_raise, require_pair
    from mbridge_epoverlap.profiling.classify import Classifier
    from mbridge_epoverlap.profiling.report import write_json, write_table
    from mbridge_epoverlap.profiling.window import parse_window

    # Check the cheap settings before reading any (possibly large) trace.
    Classifier(args.comm_regex)
    window = parse_window(args.window)
    if args.compare:
        require_pair(len(args.traces))
    reports = [analyze_trace(p, comm_regex=args.comm_regex, window=window) for p in args.traces]
    comparison = compare_or_raise(reports) if args.compare else None
    if args.json:
        write_json(reports, comparison, sys.stdout)
    else:
        write_table(reports, comparison, sys.stdout)
    return 0
