"""`mbridge-epoverlap plan`: pick a disaggregated-EP deployment for a MoE model and a TBT objective.

`register` only touches argparse so `mbridge-epoverlap --help` stays fast; numpy, the planner and
rich are imported by the handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mbridge_epoverlap.errors import UsageError

# Columns of the readable output: (key, header, format).
_PLAN_ROWS: tuple[tuple[str, str, str], ...] = (
    ("deployment", "deployment", "{}"),
    ("tp_a", "attention TP (tp_a)", "{}"),
    ("n_a", "attention nodes (n_a)", "{}"),
    ("tp_e", "expert TP (tp_e)", "{}"),
    ("n_e", "expert nodes (n_e)", "{}"),
    ("experts_per_group", "experts per expert node", "{}"),
    ("m", "micro-batches (m)", "{}"),
    ("B", "global batch (B)", "{:,}"),
    ("tokens_per_expert", "tokens per expert per micro-batch", "{:.1f}"),
    ("t_attn_ms", "T_a (ms)", "{:.3f}"),
    ("t_expert_ms", "T_e (ms)", "{:.3f}"),
    ("t_comm_ms", "T_c (ms)", "{:.3f}"),
    ("tbt_ms", "time between tokens (ms)", "{:.1f}"),
    ("throughput_tokens_s", "throughput (tokens/s)", "{:,.0f}"),
    ("gpus", "GPUs", "{}"),
    ("throughput_per_gpu", "tokens/s per GPU", "{:,.1f}"),
    ("cost_per_hour", "cost per hour (price units)", "{:.2f}"),
    ("throughput_per_cost", "tokens/s per price unit", "{:,.1f}"),
    ("binding_constraint", "binding constraint", "{}"),
    ("attn_memory_gb", "attention node memory (GB)", "{:.1f}"),
    ("expert_memory_gb", "expert node memory (GB)", "{:.1f}"),
)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to `subparsers`."""
    parser = subparsers.add_parser(
        "plan",
        help="plan a disaggregated expert-parallel deployment (MegaScale-Infer Algorithm 1)",
        usage=(
            "%(prog)s --model MODEL --attn-gpu GPU [--expert-gpu GPU] [options]\n"
            "       %(prog)s --model MODEL --attn-gpu GPU --colocated [--tp-a N] [options]\n"
            "       %(prog)s --model MODEL --compare [--gpus GPU,GPU...] [options]\n"
            "       %(prog)s --list"
        ),
        description=(
            "Search attention/expert TP sizes, attention replicas, micro-batches and batch size for the\n"
            "highest decode throughput per cost that meets a time-between-tokens objective.\n"
            "--model is required, and --attn-gpu unless --compare is given."
        ),
        epilog=(
            "examples:\n"
            "  mbridge-epoverlap plan --model Mixtral-8x22B --attn-gpu H20 --expert-gpu L40S\n"
            "  mbridge-epoverlap plan --model Mixtral-8x22B --attn-gpu H100 --colocated\n"
            "  mbridge-epoverlap plan --model Mixtral-8x22B --compare --gpus H20,L40S,H100\n"
            "  mbridge-epoverlap plan --list"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="model name (see --list); required")
    parser.add_argument("--attn-gpu", help="GPU for attention nodes (see --list); required unless --compare")
    parser.add_argument("--expert-gpu", help="GPU for expert nodes (default: the attention GPU)")
    parser.add_argument("--tbt-slo-ms", type=float, default=150.0, help="time-between-tokens objective (default 150)")
    parser.add_argument("--context", type=int, default=730, help="tokens of context per sequence (default 730)")
    parser.add_argument("--compare", action="store_true", help="plan every GPU pair (and colocated EP) and rank them")
    parser.add_argument(
        "--gpus", help="with --compare: comma-separated GPUs to pair (default: --attn-gpu/--expert-gpu, else all)"
    )
    parser.add_argument("--colocated", action="store_true", help="plan the colocated EP baseline on --attn-gpu")
    parser.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="GPU=X",
        help="override a relative price per GPU-hour (repeatable)",
    )
    parser.add_argument("--m", type=int, default=None, help="fix the number of micro-batches (1..4)")
    parser.add_argument("--n-a", type=int, default=None, help="fix the number of attention nodes")
    parser.add_argument(
        "--tp-a", type=int, default=None, help="fix the attention TP size (1, 2, 4, 8); with --colocated, the TP size"
    )
    parser.add_argument("--tp-e", type=int, default=None, help="fix the expert TP size (1, 2, 4, 8)")
    parser.add_argument("--experts-per-group", type=int, default=None, help="fix the experts held by one expert node")
    parser.add_argument(
        "--link-util", type=float, default=None,
        help="share of NIC bandwidth M2N transfers reach, in (0, 1] (default 0.7)"
    )
    parser.add_argument(
        "--engine-workers", type=int, default=None, metavar="N",
        help="also print the `serve` layout flags that run this deployment with at most N worker processes "
             "(shrunk in the plan's proportions where it has more nodes)"
    )
    parser.add_argument("--list", action="store_true", help="list the known models and GPUs and exit")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=handle)
    return parser


def parse_prices(items: list[str]) -> dict[str, float]:
    """`["H20=1.9", "L40S=1.1,H100=3"]` -> `{"H20": 1.9, "L40S": 1.1, "H100": 3.0}`."""
    prices: dict[str, float] = {}
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            name, sep, value = part.partition("=")
            try:
                if not sep:
                    raise ValueError
                prices[name.strip()] = float(value)
            except ValueError:
                raise UsageError(f"--price expects GPU=PRICE, got {part!r}; e.g. --price H20=1.85") from None
    return prices


def handle(args: argparse.Namespace) -> int:
    """Run `plan` for parsed `args`; return the exit code."""
    from mbridge_epoverlap.serving.planning import catalog

    if args.list:
        return _print_catalog(args.json)
    if not args.model:
        raise UsageError(f"--model is required; known: {', '.join(catalog.MODELS)}")
    _check_combinations(args)
    prices = parse_prices(args.price)
    for name in prices:
        catalog.get_gpu(name, flag="--price", prices=prices)

    from mbridge_epoverlap.serving.planning import perf_model
    from mbridge_epoverlap.serving.planning import search as planner

    params = (
        perf_model.PerfParams() if args.link_util is None else perf_model.PerfParams(link_utilization=args.link_util)
    )
    common = {"prices": prices, "params": params}
    if args.compare:
        if args.gpus:
            gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
        else:
            gpus = [g for g in (args.attn_gpu, args.expert_gpu) if g] or None
        if gpus is not None:
            gpus = list(dict.fromkeys(catalog.get_gpu(g, flag="--gpus", prices=prices).name for g in gpus))
        rows = planner.compare(args.model, gpus, args.tbt_slo_ms, args.context, **common)
        if args.json:
            _dump(rows)
        else:
            _print_compare(rows, args)
        return 0
    if not args.attn_gpu:
        raise UsageError(f"--attn-gpu is required (or use --compare); known: {', '.join(catalog.GPUS)}")
    if args.colocated:
        result = planner.best_colocated(
            args.model, args.attn_gpu, args.tbt_slo_ms, args.context, tp=args.tp_a, **common
        )
    else:
        result = planner.best_disaggregated(
            args.model,
            args.attn_gpu,
            args.expert_gpu,
            args.tbt_slo_ms,
            args.context,
            m=args.m,
            n_a=args.n_a,
            tp_a=args.tp_a,
            tp_e=args.tp_e,
            experts_per_group=args.experts_per_group,
            **common,
        )
    row = result.to_dict()
    if args.engine_workers is not None:
        from mbridge_epoverlap.serving.planning.to_engine import engine_layout

        layout = engine_layout(result, workers=args.engine_workers, num_experts=catalog.get_model(args.model).experts)
        row["engine"] = {"flags": layout.flags(), "shrunk": layout.shrunk, "why": layout.why}
    if args.json:
        _dump(row)
    else:
        _print_plan(row)
        if "engine" in row:
            _console().print(f"engine layout: serve {' '.join(row['engine']['flags'])} ({row['engine']['why']})")
    return 0


# Options that fix one search axis of the disaggregated plan (ignored by --colocated and --compare).
_DISAGGREGATED_ONLY = (
    ("--m", "m"), ("--n-a", "n_a"), ("--tp-e", "tp_e"), ("--experts-per-group", "experts_per_group"),
)


def _check_combinations(args: argparse.Namespace) -> None:
    """Options the chosen mode would ignore are usage errors, never silently dropped."""
    if args.link_util is not None and not 0 < args.link_util <= 1:
        raise UsageError(f"--link-util is the share of NIC bandwidth M2N transfers reach, between 0 (excluded) and 1; "
                         f"got {args.link_util:g}; pass e.g. --link-util 0.7")
    if args.engine_workers is not None and args.compare:
        raise UsageError("--engine-workers turns one plan into serve flags; --compare ranks many: drop one of them")
    if args.colocated and args.compare:
        raise UsageError("--compare already ranks colocated EP beside every GPU pair; drop --colocated")
    if args.gpus is not None and not args.compare:
        raise UsageError("--gpus lists the GPUs --compare pairs; add --compare, or plan one pair with "
                         "--attn-gpu GPU --expert-gpu GPU")
    if args.colocated and args.expert_gpu:
        raise UsageError("--colocated runs attention and experts on the same GPUs (--attn-gpu); drop --expert-gpu, "
                         "or drop --colocated to plan experts on another GPU")
    ignored = [flag for flag, dest in _DISAGGREGATED_ONLY if getattr(args, dest) is not None]
    if args.compare:
        ignored += [flag for flag in ("--tp-a",) if args.tp_a is not None]
    mode = "--compare" if args.compare else "--colocated" if args.colocated else None
    if mode and ignored:
        raise UsageError(f"{', '.join(ignored)} fix(es) a search axis of one disaggregated plan, which {mode} does "
                         f"not use; drop {mode} or drop {', '.join(ignored)}")


def _dump(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _print_plan(row: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        title=(
            f"{row['model']}: attention on {row['attn_gpu']}, experts on {row['expert_gpu']}, "
            f"TBT <= {row['tbt_slo_ms']:g} ms, context {row['context']}"
        )
    )
    table.add_column("setting")
    table.add_column("value", justify="right")
    for key, header, fmt in _PLAN_ROWS:
        table.add_row(header, fmt.format(row[key]))
    _console().print(table)


def _print_compare(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.table import Table

    console = _console()
    table = Table(title=f"{args.model}: TBT <= {args.tbt_slo_ms:g} ms, context {args.context}, best per cost first")
    for header in (
        "deployment",
        "attention",
        "experts",
        "tp_a/n_a",
        "tp_e/n_e",
        "m",
        "B",
        "TBT ms",
        "tok/s",
        "tok/s/GPU",
        "tok/s per cost",
        "binds",
    ):
        table.add_column(
            header, justify="left" if header in ("deployment", "attention", "experts", "binds") else "right"
        )
    for row in rows:
        if "error" in row:
            continue
        table.add_row(
            row["deployment"],
            row["attn_gpu"],
            row["expert_gpu"],
            f"{row['tp_a']}/{row['n_a']}",
            f"{row['tp_e']}/{row['n_e']}",
            str(row["m"]),
            f"{row['B']:,}",
            f"{row['tbt_ms']:.1f}",
            f"{row['throughput_tokens_s']:,.0f}",
            f"{row['throughput_per_gpu']:,.1f}",
            f"{row['throughput_per_cost']:,.1f}",
            row["binding_constraint"],
        )
    console.print(table)
    for row in rows:
        if "error" in row:
            console.print(
                f"[yellow]{row['deployment']} {row['attn_gpu']}+{row['expert_gpu']}: {row['error']}[/yellow]"
            )


def _print_catalog(as_json: bool) -> int:
    from dataclasses import asdict

    from mbridge_epoverlap.serving.planning import catalog

    if as_json:
        _dump(
            {
                "gpus": [asdict(g) for g in catalog.GPUS.values()],
                "models": [asdict(m) for m in catalog.MODELS.values()],
            }
        )
        return 0
    from rich.table import Table

    console = _console()
    gpus = Table(title="GPUs (dense bf16; prices relative, override with --price)")
    for header in ("name", "TFLOP/s", "HBM TB/s", "HBM GB", "NIC Gb/s", "scale-up GB/s", "price"):
        gpus.add_column(header, justify="left" if header == "name" else "right")
    for g in catalog.GPUS.values():
        gpus.add_row(
            g.name,
            f"{g.tflops_bf16:g}",
            f"{g.hbm_tbs:g}",
            f"{g.hbm_gb:g}",
            f"{g.nic_gbps:g}",
            f"{g.scale_up_gbs:g} {g.scale_up}",
            f"{g.price:g}",
        )
    models = Table(title="Models")
    for header in ("name", "layers", "hidden", "heads/KV", "experts", "top-k", "expert FFN", "shared", "params (B)"):
        models.add_column(header, justify="left" if header == "name" else "right")
    for m in catalog.MODELS.values():
        models.add_row(
            m.name,
            str(m.layers),
            str(m.hidden),
            f"{m.heads}/{m.kv_heads}",
            str(m.experts),
            str(m.top_k),
            str(m.expert_ffn),
            str(m.shared_experts),
            f"{m.total_params / 1e9:.1f}",
        )
    console.print(gpus)
    console.print(models)
    return 0


def _console() -> Any:
    """A rich console; 200 columns wide when the output is not a terminal."""
    from rich.console import Console

    console = Console()
    # Piped output has no terminal width; rich would squeeze wide tables into 80 columns.
    return console if console.is_terminal else Console(width=200)
