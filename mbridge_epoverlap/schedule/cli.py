"""`mbridge-epoverlap simulate`: time an overlap schedule and show where the idle time is.

`register` only touches argparse so `mbridge-epoverlap --help` stays fast; the simulator, rich and
matplotlib are imported by the handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError

SCHEDULE_CHOICES = ("pingpong", "1f1b", "two-batch")
# Micro-batches x layers the simulator times in a few seconds; every stage of each is an event.
MAX_MICRO_BATCH_LAYERS = 20_000


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `simulate` subcommand to `subparsers`."""
    parser = subparsers.add_parser(
        "simulate",
        help="time an overlap schedule (ping-pong, combined 1F1B, two-batch overlap) from stage costs",
        description=(
            "Simulate a schedule from per-stage times (all in one unit, e.g. ms) and report makespan, "
            "utilization and idle time per resource, optionally as a Gantt PNG."
        ),
        epilog=(
            "examples:\n"
            "  mbridge-epoverlap simulate --schedule 1f1b --micro-batches 3 --layers 2 --t-comm 1 --png 1f1b.png\n"
            "  mbridge-epoverlap simulate --schedule pingpong --micro-batches 3 --layers 2 --t-comm 0.3\n\n"
            f"limits: --micro-batches x --layers <= {MAX_MICRO_BATCH_LAYERS:,} (every stage of each is timed)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--schedule", required=True, choices=SCHEDULE_CHOICES, help="which schedule to simulate")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches (default: pingpong 3, 1f1b 4, two-batch 2)",
    )
    parser.add_argument("--layers", type=int, default=2, metavar="L", help="MoE layers (default 2)")
    parser.add_argument(
        "--t-attn", type=float, default=1.0, metavar="A", help="attention time per micro-batch and layer (default 1.0)"
    )
    parser.add_argument(
        "--t-expert", type=float, default=1.0, metavar="E", help="expert time per micro-batch and layer (default 1.0)"
    )
    parser.add_argument(
        "--t-comm", type=float, default=0.5, metavar="C", help="time of one all-to-all / M2N transfer (default 0.5)"
    )
    parser.add_argument("--t-post", type=float, default=0.0, metavar="P", help="unpermute + residual time (default 0)")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="1f1b: combined 1F1B (default) or plain 1F1B with --no-overlap",
    )
    parser.add_argument("--delay-wgrad", action="store_true", help="1f1b: delay expert weight gradients")
    parser.add_argument("--megatron-core-edges", action="store_true",
                        help="1f1b with overlap: run the first forward and the last backward alone, as Megatron-Core "
                             "does (default: interleave the first two forwards and the last two backwards)")
    parser.add_argument(
        "--backward-factor", type=float, default=None, metavar="F",
        help="1f1b: backward compute time over forward compute time, > 0 (default 2)"
    )
    parser.add_argument("--unit", default="ms", help="unit of the times, for labels only (default ms)")
    parser.add_argument("--png", metavar="PATH", default=None,
                        help="write a Gantt chart to PATH (a .png file; .png is added to a name without one; "
                        "missing folders are created)")
    parser.add_argument("--events", action="store_true", help="with --json, include every timed event")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=handle)
    return parser


def handle(args: argparse.Namespace) -> int:
    """Run `simulate` for parsed `args`; return the exit code."""
    from mbridge_epoverlap.schedule.presets import (
        DEFAULT_MICRO_BATCHES,
        min_micro_batches,
        ping_pong_makespan,
        simulate_schedule,
    )

    if args.schedule != "1f1b":
        # Training-only flags on a serving schedule would be silently ignored; say so instead.
        given = [
            flag
            for flag, value in (
                ("--overlap/--no-overlap", args.overlap),
                ("--delay-wgrad", args.delay_wgrad or None),
                ("--megatron-core-edges", args.megatron_core_edges or None),
                ("--backward-factor", args.backward_factor),
            )
            if value is not None
        ]
        if given:
            verb, obj = ("applies", "it") if len(given) == 1 else ("apply", "them")
            raise UsageError(f"{', '.join(given)} {verb} only to --schedule 1f1b; drop {obj} or use --schedule 1f1b")
    _check_work(args.micro_batches if args.micro_batches is not None else DEFAULT_MICRO_BATCHES[args.schedule],
                args.layers)
    if args.backward_factor is not None and not (0 < args.backward_factor < float("inf")):
        raise UsageError(f"--backward-factor is backward compute time over forward compute time and must be a "
                         f"positive number, got {args.backward_factor:g}; pass e.g. --backward-factor 2")
    png = _png_path(args.png) if args.png else None
    overlap = True if args.overlap is None else args.overlap
    timeline = simulate_schedule(
        args.schedule,
        micro_batches=args.micro_batches,
        layers=args.layers,
        t_attn=args.t_attn,
        t_expert=args.t_expert,
        t_comm=args.t_comm,
        t_post=args.t_post,
        overlap=overlap,
        delay_wgrad=args.delay_wgrad,
        backward_factor=2.0 if args.backward_factor is None else args.backward_factor,
        paired_edges=not args.megatron_core_edges,
    )
    m = args.micro_batches if args.micro_batches is not None else DEFAULT_MICRO_BATCHES[args.schedule]
    result: dict[str, Any] = {"schedule": args.schedule, "micro_batches": m, "layers": args.layers}
    result.update(timeline.to_dict(events=args.events))
    if args.schedule == "1f1b":
        result.update(overlap=overlap, delay_wgrad=args.delay_wgrad, paired_edges=not args.megatron_core_edges)
    if args.schedule == "pingpong":
        # The closed form folds the residual into attention, so it only applies when that is free.
        if args.t_post == 0:
            result["closed_form"] = ping_pong_makespan(args.t_attn, args.t_expert, args.t_comm, m, args.layers)
        result["min_micro_batches"] = min_micro_batches(args.t_attn, args.t_expert, args.t_comm)
    result["summary"] = timeline.summary()
    if png is not None:
        from mbridge_epoverlap.schedule.gantt import save_gantt

        if not png.parent.exists():
            print(f"note: creating folder {png.parent} for --png", file=sys.stderr)
        title = f"{args.schedule}, m={m}, L={args.layers}: {timeline.summary()}"
        result["png"] = str(save_gantt(timeline, png, title=title, unit=args.unit))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _print_table(result, args.unit)
    return 0


def _check_work(micro_batches: int, layers: int) -> None:
    """Refuse schedules too large to time in seconds (and, far beyond that, to hold in memory)."""
    if micro_batches >= 1 and layers >= 1 and micro_batches * layers > MAX_MICRO_BATCH_LAYERS:
        raise UsageError(f"--micro-batches {micro_batches} x --layers {layers} = {micro_batches * layers:,} exceeds "
                         f"the simulator's limit of {MAX_MICRO_BATCH_LAYERS:,}; simulate fewer micro-batches or"
                         " layers (the steady state shows after a few micro-batches)")


def _png_path(text: str) -> Path:
    """The file `--png` writes: a .png name; a bare name gets .png, a folder or another extension is refused."""
    path = Path(text)
    if path.is_dir() or text.endswith(("/", "\\")):
        raise UsageError(f"--png {text} is a folder; pass a file name in it, e.g. --png {path / 'schedule.png'}")
    if path.suffix.lower() != ".png":
        if path.suffix and path.suffix[1:].isalpha():
            raise UsageError(f"--png writes PNG images; {text!r} ends in {path.suffix}: use e.g. "
                             f"--png {path.with_suffix('.png')}")
        path = path.with_name(path.name + ".png")
    return path


def _print_table(result: dict[str, Any], unit: str) -> None:
    from rich.table import Table

    console = _console()
    table = Table(title=f"{result['schedule']}: m={result['micro_batches']}, L={result['layers']}")
    table.add_column("resource")
    table.add_column(f"busy ({unit})", justify="right")
    table.add_column(f"idle ({unit})", justify="right")
    table.add_column("utilization", justify="right")
    for name in result["resources"]:
        table.add_row(
            name,
            f"{result['busy'][name]:.4g}",
            f"{result['idle'][name]:.4g}",
            f"{result['utilization'][name]:.1%}",
        )
    console.print(table)
    console.print(f"makespan {result['makespan']:.4g} {unit}; exposed comm {result['exposed_comm']:.4g} {unit}")
    if "closed_form" in result:
        console.print(f"closed form {result['closed_form']:.4g} {unit}")
    if "min_micro_batches" in result:
        console.print(f"smallest m that keeps the busiest worker busy: {result['min_micro_batches']}")
    if "png" in result:
        console.print(f"Gantt chart: {result['png']}")


def _console() -> Any:
    """A rich console; 200 columns wide when the output is not a terminal."""
    from rich.console import Console

    console = Console()
    # Piped output has no terminal width; rich would squeeze wide tables into 80 columns.
    return console if console.is_terminal else Console(width=200)
