"""The flags that `serve`, `serve-bench` and `elastic-bench` share, and how they are read.

`register` functions call these; nothing here imports torch or the engine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mbridge_epoverlap.arg_types import count, positive, positive_float
from mbridge_epoverlap.errors import UsageError


def number_above(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number > `minimum` (>= with `inclusive`); argparse reports the flag, exit 2."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'at least' if inclusive else 'more than'} {minimum:g}")
        return value

    return parse


positive_seconds = number_above(0.0, inclusive=False)  # --timeout: 0 would start workers that cannot wait
non_negative_seconds = number_above(0.0, inclusive=True)


def dtype_arg(text: str) -> str:
    """An argparse type: `--dtype`'s value (`engine.choice.dtype.parse_dtype`); argparse reports the flag, exit 2."""
    from mbridge_epoverlap.serving.engine.choice.dtype import parse_dtype

    try:
        return parse_dtype(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def resolve_dtype(args: argparse.Namespace, source: str | Path | None) -> Any:
    """Replace `args.dtype` ("auto" or an explicit one) by the dtype the workers compute in, said on stderr with its
    reason (a warning where it will be slow); the `engine.choice.dtype.ServingDtype`, for the result and `/health`,
    is also kept as `args.dtype_choice`."""
    from mbridge_epoverlap.serving.engine.choice.dtype import choose_serving_dtype

    choice = choose_serving_dtype(args.dtype, source)
    args.dtype, args.dtype_choice = choice.dtype, choice
    print(f"  dtype {choice.summary}", file=sys.stderr, flush=True)
    if choice.warning is not None:
        print(f"warning: {choice.warning}", file=sys.stderr, flush=True)
    return choice


def model_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--checkpoint", type=Path, metavar="DIR",
                        help="a Hugging Face checkpoint directory (config.json + *.safetensors; Mixtral or Qwen3-MoE)")
    source.add_argument("-mr", "--model-recipe", dest="recipe", metavar="RECIPE",
                        help="a recipe name: a shrunk random model, as the training runtime shrinks recipes")
    parser.add_argument("--dtype", type=dtype_arg, default="auto", metavar="{auto,float32,bfloat16}",
                        help="the workers' compute dtype (default auto: the checkpoint's dtype where this CPU "
                             "computes it natively, bfloat16 only with avx512_bf16 or amx_bf16, else float32; a "
                             "float16 checkpoint or a recipe model computes in float32)")
    parser.add_argument("--backend", default="m2n", help="M2N backend: m2n (fastest here), shm, mooncake, torch, gloo")
    parser.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S",
                        help="seconds any worker waits for another before naming it lost (default 30)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout instead of a table")


LAYOUT_DEFAULTS = {"attn_workers": 1, "expert_workers": 1, "micro_batches": 2}


def layout_args(parser: argparse.ArgumentParser, *, colocated_flag: bool = False) -> None:
    """The layout flags. Without any of them (and without `--colocated`, `--threads`) the command chooses the
    layout from a short measurement (`serving.engine.choice`: trial runs for `serve`, probes for `serve-bench`); any
    one given forces the layout, the
    others then taking their defaults (1 attention worker, 1 expert worker, m=2)."""
    parser.add_argument("--attn-workers", type=positive, default=None, metavar="A",
                        help="attention workers (default 1 when a layout flag is given, else chosen)")
    parser.add_argument("--expert-workers", type=positive, default=None, metavar="E",
                        help="expert workers (default 1 when a layout flag is given, else chosen)")
    one_process = "" if colocated_flag else ", 1 with --colocated 1"
    parser.add_argument("--micro-batches", type=positive, default=None, metavar="M",
                        help=f"micro-batches in flight (default 2 when a layout flag is given{one_process}, else "
                             "chosen)")
    if colocated_flag:
        parser.add_argument("--colocated", action="store_true",
                            help="the colocated baseline on A+E processes instead")
    else:
        parser.add_argument("--colocated", type=positive, default=0, metavar="N",
                            help="the colocated baseline on N processes instead (1: single process)")
    parser.add_argument("--order", choices=("two_batch_overlap", "sequential"), default="two_batch_overlap",
                        help="colocated order (default two_batch_overlap)")
    parser.add_argument("--threads", type=count, default=0, metavar="T",
                        help="torch threads per worker process (default 0: the cores shared evenly by the processes)")
    parser.add_argument("--max-batch", type=positive, default=64, metavar="B",
                        help="sequences decoding at once per attention worker; more wait (default 64)")


def layout_forced(args: argparse.Namespace) -> bool:
    """Whether a layout flag was given (then the flags decide; else the layout is chosen)."""
    return bool(any(getattr(args, name) is not None for name in LAYOUT_DEFAULTS) or args.colocated or args.threads)


def fill_layout_defaults(args: argparse.Namespace) -> None:
    """The layout flags not given take their defaults. One colocated process (`--colocated 1`) runs one
    micro-batch: it has no exchange for a second to hide, and each micro-batch streams every expert's weights once
    a step (two took 24 ms a decode step of 8 sequences on the 57M Mixtral online against 14.5 ms with one, AMD
    EPYC, one thread)."""
    colocated = getattr(args, "colocated", 0)
    if colocated == 1 and colocated is not True and args.micro_batches is None:
        args.micro_batches = 1
    for name, value in LAYOUT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def apply_layout(args: argparse.Namespace, layout: dict[str, Any], *, colocated_as_flag: bool = False) -> None:
    """Set the layout flags from a chosen layout ("layout" of `engine.choice.layout.choose_layout` or
    `engine.choice.offline.choose_offline_layout`)."""
    processes = layout.get("colocated", 0)
    if processes:
        args.attn_workers, args.expert_workers = (processes, 0) if colocated_as_flag else (1, 1)
        args.colocated = True if colocated_as_flag else processes
        args.order = layout.get("order", args.order)
    else:
        args.attn_workers, args.expert_workers = layout["attn_workers"], layout["expert_workers"]
    args.micro_batches, args.threads = layout["micro_batches"], layout["threads"]
    if hasattr(args, "replicate_experts"):
        args.replicate_experts = bool(layout.get("replicated_experts"))


def source_of(args: argparse.Namespace, default: str | None = None) -> str:
    """The checkpoint directory or recipe name the flags name (`engine.plan.model_source`)."""
    from mbridge_epoverlap.serving.engine.plan import model_source

    return model_source(args.checkpoint, args.recipe, default)


def checked_source(args: argparse.Namespace, default: str | None = None) -> str:
    """`source_of`, refused at once where it is no model (`checkpoint.check_source`): a command's handler calls it
    first, so a wrong path is named before torch is imported or a word is said about the model's dtype."""
    from mbridge_epoverlap.serving.model.checkpoint import check_source

    source = source_of(args, default)
    check_source(source)
    return source


def progress_printer(args: argparse.Namespace) -> Any:
    """Progress of long runs on stderr (stdout carries the result, JSON or table)."""
    return lambda line: print(f"  {line}", file=sys.stderr, flush=True)


def epoch_args(parser: argparse.ArgumentParser, when: str = "") -> None:
    """`--rebalance-every`, `--rejoin-after-steps`, `--rejoin-hold` and `--rebalance-threshold`, for serve
    (`when`: "with --elastic: ") and elastic-bench."""
    parser.add_argument("--rebalance-every", type=count, default=0, metavar="K",
                        help=f"{when}re-solve the expert placement for the measured load every K decode "
                             "steps, moving weights between expert workers (default 0: never)")
    parser.add_argument("--rejoin-after-steps", type=count, default=0, metavar="N",
                        help=f"{when}start a replacement for a lost expert worker and admit it at the first "
                             "step boundary N or more decode steps after the loss where it is ready; decoding goes "
                             "on while it starts (default 0: never)")
    parser.add_argument("--rejoin-hold", action="store_true",
                        help=f"{when}with --rejoin-after-steps: hold decoding N steps after the loss until the "
                             "replacement is ready (at most half of --timeout), so that the step it joins is fixed")
    parser.add_argument("--rebalance-threshold", type=float, default=None, metavar="T",
                        help=f"{when}skip a rebalance (no solve, no weight moved) while max/mean expert load "
                             "over the expert workers is at most T (1 rebalances whenever it helps; default: 1.1, "
                             "or above what routing the window's N pairs over W workers at random gives, "
                             "1 + 3 sqrt((W - 1) / N), whichever is higher)")


def host_args(parser: argparse.ArgumentParser) -> None:
    """`--emulate-hosts` and `--emulate-link-gbps`, for serve, serve-bench and elastic-bench (`engine.hosts`)."""
    parser.add_argument("--emulate-hosts", type=count, default=0, metavar="H",
                        help="2: attention workers and expert workers on two emulated hosts (network namespaces "
                             "joined by a shaped link; root only), so M2N crosses a link (default 0: this host)")
    parser.add_argument("--emulate-link-gbps", type=positive_float, default=None, metavar="G",
                        help="with --emulate-hosts: the link's rate in Gbit/s (tc tbf)")


def on_hosts(plan: Any, args: argparse.Namespace) -> Any:
    """`plan` on the emulated hosts the flags ask for (`engine.hosts.emulate_hosts`)."""
    from mbridge_epoverlap.serving.engine.hosts import emulate_hosts

    return emulate_hosts(plan, args.emulate_hosts, args.emulate_link_gbps)
