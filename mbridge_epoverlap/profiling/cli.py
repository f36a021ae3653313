"""`mbridge-epoverlap profile`: overlap figures from Nsight Systems or Kineto traces.

Registration is argparse only; numpy and the loaders are imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

DESCRIPTION = """\
Communication/compute overlap per device from Nsight Systems SQLite exports (.sqlite, .sqlite.gz) or
PyTorch/Kineto JSON traces (.json, .json.gz); a folder means all per-rank traces in it. Builds the
union of communication intervals (NCCL, DeepEP, HybridEP, gloo) and of compute intervals and reports
their intersection, exposed communication and the active union; never sums kernel durations.
"""

EPILOG = """\
where traces come from:
  - the A/B harness: add --profile to scripts/performance/run_script.py; it prints the folder of each
    case's per-rank traces (results/<name>.traces/<case>/ by default)
  - PyTorch: torch.profiler with on_trace_ready=tensorboard_trace_handler(DIR) or
    prof.export_chrome_trace("rank0.json")
  - Nsight Systems: nsys profile --trace=cuda,nvtx -o run python train.py, then
    nsys export --type sqlite run.nsys-rep

examples:
  mbridge-epoverlap profile rank0.sqlite
  mbridge-epoverlap profile traces/ --window steps:3:8 --json
  mbridge-epoverlap profile results/run.traces/ep_overlap_off results/run.traces/ep_overlap_on --compare
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
    parser.add_argument("--compare", action="store_true",
                        help="two traces (before, after): add a before/after comparison block")
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
    if window is not None:
        for report in reports:
            _warn_if_window_empty(report, args.window, args.comm_regex)
    comparison = compare_or_raise(reports) if args.compare else None
    if args.json:
        write_json(reports, comparison, sys.stdout)
    else:
        write_table(reports, comparison, sys.stdout)
    return 0


def _warn_if_window_empty(report: Any, text: str, comm_regex: str | None) -> None:
    """A window past the end of a trace reads as an all-zero table; say so, with the trace's length."""
    from mbridge_epoverlap.profiling.analyze import analyze_trace

    if report.totals()["kernels"]:
        return
    whole = analyze_trace(report.path, comm_regex=comm_regex)
    if not whole.totals()["kernels"]:
        return  # the trace itself has no work; its notes say why
    busy_ms = max(d.active_ns for d in whole.devices) / 1e6
    print(f"warning: {report.path}: nothing runs inside --window {text}, which may lie past the end of the trace "
          f"(its {whole.totals()['kernels']:,} kernels keep the busiest device busy for {busy_ms:,.3f} ms; times "
          "count from the first kernel); pick a window inside the trace, or drop --window", file=sys.stderr)
