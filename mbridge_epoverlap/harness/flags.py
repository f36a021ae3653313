"""The perf harness's command line, compatible with Megatron-Bridge's `scripts/performance/run_script.py`.

`build_parser()` is the single definition: `run_script.py` parses with it and the docs are generated
from it (`flags_markdown()`). Flags that change the run config default to `UNSET`, so "flag absent"
(keep the recipe's value) differs from an explicit value, including an explicit `None`.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from typing import Any

from mbridge_epoverlap.arg_types import bool_arg, none_or, positive_float, positive_int
from mbridge_epoverlap.gpus import GPUS

COMPUTE_DTYPES = ("bf16", "fp16", "fp32", "fp8_cs", "fp8_mx", "fp8_sc", "nvfp4")
TASKS = ("pretrain", "sft", "peft", "serve_bench", "serve")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
CUDA_GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
TOKENIZERS = ("NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer")
EXECUTORS = ("local", "slurm")
DEFAULT_MAX_STEPS = 10
DEFAULT_STABLE_WINDOW = "3:8"
DEFAULT_TIME_LIMIT = "00:30:00"
DEFAULT_CPU_PROCS = 2


class _Unset:
    """Marker for "flag not given" (distinct from an explicit None)."""

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


@dataclass(frozen=True)
class TimeLimit:
    """A Slurm time limit as written (`HH:MM:SS`, `MM`, `D-HH:MM`, ...) and in seconds."""

    text: str
    seconds: int


def graph_scopes(text: str) -> list[str]:
    """Comma-separated CUDA-graph scopes; `none` (or empty) means no scope."""
    if text.strip().lower() in ("", "none", "null"):
        return []
    scopes = [part.strip() for part in text.split(",") if part.strip()]
    bad = [s for s in scopes if s not in CUDA_GRAPH_SCOPES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown CUDA-graph scope(s) {bad}; choose from {', '.join(CUDA_GRAPH_SCOPES)}")
    return scopes


def recipe_name(text: str) -> str:
    """A recipe name, lowercased as Megatron-Bridge does; a FILE.py[:FUNCTION] path is kept as written."""
    return text if ("/" in text or ".py" in text) else text.lower()


def string_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def flex_backend(text: str) -> str | None:
    if text in ("None", "none"):
        return None
    if text not in ("deepep", "hybridep", "ncclep"):
        raise argparse.ArgumentTypeError(f"expected deepep, hybridep, ncclep or None, got {text!r}")
    return text


_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def time_limit(text: str) -> TimeLimit:
    """Parse Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    match = _TIME_RE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"time limit {text!r} is not HH:MM:SS (or MM, D-HH:MM:SS)")
    days, first, second, third = match.groups()
    if days is not None:
        # D-HH[:MM[:SS]]
        seconds = int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    elif third is not None:
        seconds = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:
        seconds = int(first) * 60 + int(second)
    else:
        seconds = int(first) * 60
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"time limit {text!r} must be longer than zero")
    return TimeLimit(text.strip(), seconds)


def case_log(text: str) -> tuple[str, str]:
    """`CASE=LOGFILE` for --from_logs."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected CASE=LOGFILE, got {text!r}")
    return name.strip(), path.strip()


class HarnessParser(argparse.ArgumentParser):
    """argparse already exits with 2 and a one-line message on bad input; only the wording is ours."""

    def error(self, message: str):  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _env_epilog() -> str:
    from mbridge_epoverlap.envvars import env_epilog

    return env_epilog()


def build_parser(prog: str = "run_script.py") -> argparse.ArgumentParser:
    """The harness's argument parser (every flag, grouped as in `--help`)."""
    parser = HarnessParser(
        prog=prog,
        description=(
            "Matched A/B performance runs for expert-parallel (EP) overlap in MoE models. "
            "Order: recipe -> dotted overrides -> flags -> (-g cpu: shrink to CPU processes) -> validation "
            "-> launch environment -> executor. A flag that is absent keeps the recipe's value."
        ),
        epilog=(
            "examples:\n"
            "  %(prog)s -m qwen -mr qwen3_30b_a3b -g cpu -ng 2 --ab ep_overlap\n"
            "  %(prog)s -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 --ab ep_overlap -a ACCOUNT -p PARTITION\n"
            "  %(prog)s -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 --dryrun comm_overlap.delay_wgrad_compute=false\n"
            "  %(prog)s --from_logs ep_overlap_off=off.log ep_overlap_on=on.log --results_json ab.json\n\n"
            "exit status: 0 done, 1 invalid configuration or failed run, 2 usage error.\n\n"
            + _env_epilog()
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="dotted config overrides applied after the recipe, before flags "
             "(e.g. comm_overlap.delay_wgrad_compute=false model.moe_shared_expert_overlap=false)")

    what = parser.add_argument_group("what to run")
    what.add_argument("-m", "--model_family_name", type=str.lower, default=None,
                      help="model family (qwen, deepseek, mixtral, dbrx); checked against the recipe")
    what.add_argument("-mr", "--model_recipe_name", type=recipe_name, default=None,
                      help="recipe name (e.g. qwen3_30b_a3b) or FILE.py[:FUNCTION]; default: the family's first")
    what.add_argument("--task", choices=TASKS, default="pretrain",
                      help="pretrain or sft (default: pretrain); peft is accepted as upstream does, but the project's "
                           "recipes define pretrain and sft; serve_bench runs the serving bench (roles by rank); "
                           "serve starts the OpenAI-compatible server as a Slurm job (front end on the first node)")
    what.add_argument("-g", "--gpu", type=str.lower, choices=GPUS, default=None,
                      help="target GPU; cpu runs the reference runtime in CPU processes (default: cpu)")
    what.add_argument("-c", "--compute_dtype", type=str.lower, choices=COMPUTE_DTYPES, default=UNSET,
                      help="precision: bf16, fp16, fp32 (cpu only), fp8_cs/fp8_mx/fp8_sc/nvfp4 (GPU jobs: bf16 "
                           "params with Megatron-Bridge's FP8/FP4 mixed precision); default: the recipe's")
    what.add_argument("-ng", "--num_gpus", type=positive_int, default=UNSET,
                      help=f"GPUs (CPU processes for -g cpu; default {DEFAULT_CPU_PROCS} there, else the recipe's)")
    what.add_argument("-gn", "--gpus_per_node", type=positive_int, default=UNSET,
                      help="GPUs per node (default: the recipe's; 4 on gb200/gb300)")
    what.add_argument("-ms", "--max_steps", type=positive_int, default=UNSET,
                      help=f"training iterations per run (default {DEFAULT_MAX_STEPS})")
    what.add_argument("--tokenizer_type", choices=TOKENIZERS, default=None,
                      help="tokenizer of GPU jobs (Megatron-Bridge); the CPU runtime uses synthetic tokens")

    shape = parser.add_argument_group("batch shape and parallel layout")
    shape.add_argument("-gb", "--global_batch_size", type=positive_int, default=UNSET)
    shape.add_argument("--attn_workers", type=positive_int, default=1,
                       help="--task serve_bench: attention workers (ranks 0..A-1; the other ranks are expert workers)")
    shape.add_argument("--micro_batches", type=positive_int, default=2,
                       help="--task serve_bench: micro-batches in flight (ping-pong)")
    shape.add_argument("-mb", "--micro_batch_size", type=positive_int, default=UNSET)
    shape.add_argument("-sl", "--seq_length", type=positive_int, default=UNSET)
    shape.add_argument("-tp", "--tensor_model_parallel_size", type=positive_int, default=UNSET)
    shape.add_argument("-pp", "--pipeline_model_parallel_size", type=positive_int, default=UNSET)
    shape.add_argument("-cp", "--context_parallel_size", type=positive_int, default=UNSET)
    shape.add_argument("-vp", "--virtual_pipeline_model_parallel_size", type=none_or(positive_int), default=UNSET,
                       help="virtual pipeline size, or None")
    shape.add_argument("-ep", "--expert_model_parallel_size", type=positive_int, default=UNSET,
                       help="expert parallel size (-g cpu: defaults to -ng)")
    shape.add_argument("-et", "--expert_tensor_parallel_size", type=none_or(positive_int), nargs="?", const=None,
                       default=UNSET, help="expert tensor parallel size; bare -et means None")

    model = parser.add_argument_group("model features (each keeps the recipe's value when absent)")
    model.add_argument("--cuda_graph_impl", choices=CUDA_GRAPH_IMPLS, default=UNSET)
    model.add_argument("--cuda_graph_scope", type=graph_scopes, default=UNSET,
                       help=f"comma-separated: {', '.join(CUDA_GRAPH_SCOPES)}; or none")
    model.add_argument("--moe_flex_dispatcher_backend", type=flex_backend, default=UNSET,
                       metavar="{deepep,hybridep,ncclep,None}",
                       help="deepep, hybridep or ncclep switch the dispatcher to flex where the GPU supports it (an "
                            "unsupported GPU is a validation error, never a silent fallback); None keeps alltoall")
    model.add_argument("--moe_a2a_overlap", type=bool_arg, default=UNSET, metavar="{true,false}",
                       help="sets comm_overlap.overlap_moe_expert_parallel_comm only: false really turns EP overlap "
                            "off, true does not add delayed wgrad")
    model.add_argument("--delay_wgrad_compute", type=bool_arg, default=UNSET, metavar="{true,false}",
                       help="sets comm_overlap.delay_wgrad_compute only")
    model.add_argument("--recompute_granularity", type=none_or(str), choices=("full", "selective", None),
                       default=UNSET)
    model.add_argument("--recompute_method", type=none_or(str), choices=("uniform", "block", None), default=UNSET)
    model.add_argument("-rl", "--recompute_num_layers", type=none_or(positive_int), default=UNSET)
    model.add_argument("--recompute_modules", type=none_or(string_list), default=UNSET,
                       help="comma-separated modules to recompute (e.g. core_attn,moe_act), or None")

    compare = parser.add_argument_group("measurement")
    compare.add_argument("--ab", default=None, metavar="ep_overlap|KEY[,KEY...]",
                         help="A/B cases that differ only in switches: ep_overlap runs ep_overlap_off, "
                              "ep_overlap_on and ep_overlap_on_delay_wgrad; dotted boolean keys run a baseline plus "
                              "one case per key with that switch flipped")
    compare.add_argument("--repeats", type=positive_int, default=1,
                         help="repeat the cases interleaved (A B C A B C ...) so drift cancels (default 1)")
    compare.add_argument("--stable_window", default=DEFAULT_STABLE_WINDOW, metavar="START:END",
                         help=f"1-based inclusive iterations averaged for the comparison (default "
                              f"{DEFAULT_STABLE_WINDOW}, clipped to --max_steps)")
    compare.add_argument("--profile", action="store_true",
                         help="after the timed runs, one extra profiled run per case (its time is not compared)")
    compare.add_argument("--emulate_link_gbps", type=positive_float, default=None, metavar="G",
                         help="local executor: shape the ranks' links to G Gbit/s (needs root)")
    compare.add_argument("--results_json", default=None, metavar="PATH",
                         help="results JSON (a .md table and a .png chart are written next to it); "
                              "default results/<recipe>_<task>_<gpu>_ng<N>_<ab>.json")
    compare.add_argument("--from_logs", type=case_log, nargs="+", default=None, metavar="CASE=LOG",
                         help="report Megatron-Bridge training logs as an A/B (first case is the baseline); "
                              "runs nothing")

    target = parser.add_argument_group("software on the target (validation checks for these)")
    target.add_argument("--te_version", "--te-version", default=None,
                        help="Transformer Engine version the job will run")
    target.add_argument("--torch_version", "--torch-version", default=None, help="PyTorch version the job will run")
    target.add_argument("--mcore_version", "--mcore-version", default=None,
                        help="Megatron-Core version the job will run, 0.15 ... 0.20 (0.20: Megatron-LM main; default: "
                             "the newest rules, 0.20)")
    target.add_argument("--bridge_version", "--bridge-version", default=None,
                        help="Megatron-Bridge release the job will run: 0.6 (0.6.x) or main; it picks the rules and "
                             "the recipe facts (default: the newest release)")

    launch = parser.add_argument_group("launching")
    launch.add_argument("--executor", choices=EXECUTORS, default=None,
                        help="local (reference runtime here; default for -g cpu) or slurm (sbatch; default for GPUs)")
    launch.add_argument("-d", "--dryrun", action="store_true",
                        help="resolve, validate, write the config (and the sbatch script), launch nothing")
    launch.add_argument("--check_with_bridge", action="store_true",
                        help="GPU targets: build each case's job with the real Megatron-Bridge (here, or the Python "
                             "in MBRIDGE_EPOVERLAP_BRIDGE_PYTHON) and run its runtime_config_update on the CPU under "
                             "the GPU's mock before submitting; a disagreement stops the run")
    launch.add_argument("--save_config_filepath", default=None, metavar="PATH",
                        help="write the resolved config as YAML (A/B: PATH holds the first case, "
                             "STEM.<case>.yaml beside it the others)")
    launch.add_argument("--detach", type=bool_arg, nargs="?", const=True, default=False, metavar="{true,false}",
                        help="slurm: submit, print the job id and where results will appear, and return (bare "
                             "--detach means true; default false: follow the job to report the A/B)")

    slurm = parser.add_argument_group("slurm")
    slurm.add_argument("-a", "--account", default=None)
    slurm.add_argument("-p", "--partition", default=None)
    slurm.add_argument("-t", "--time_limit", type=time_limit, default=time_limit(DEFAULT_TIME_LIMIT),
                       help=f"job time limit, HH:MM:SS (default {DEFAULT_TIME_LIMIT}); also bounds following the job")

    from mbridge_epoverlap.harness.upstream_flags import add_upstream_flags

    add_upstream_flags(parser)  # every other flag of Megatron-Bridge's run_script.py, passed through
    return parser


# Flags that write one model field each: (dest, MoEModelConfig field).
MODEL_FLAGS: tuple[tuple[str, str], ...] = (
    ("tensor_model_parallel_size", "tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "pipeline_model_parallel_size"),
    ("context_parallel_size", "context_parallel_size"),
    ("virtual_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"),
    ("expert_model_parallel_size", "expert_model_parallel_size"),
    ("expert_tensor_parallel_size", "expert_tensor_parallel_size"),
    ("cuda_graph_impl", "cuda_graph_impl"),
    ("cuda_graph_scope", "cuda_graph_scope"),
    ("recompute_granularity", "recompute_granularity"),
    ("recompute_method", "recompute_method"),
    ("recompute_num_layers", "recompute_num_layers"),
    ("recompute_modules", "recompute_modules"),
    ("seq_length", "seq_length"),
)


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether flag `dest` was given on the command line."""
    return getattr(args, dest, UNSET) is not UNSET


def flags_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """A markdown table of every flag (for the docs)."""
    parser = parser or build_parser()
    lines = ["| flag | values | meaning |", "|---|---|---|"]
    for group in parser._action_groups:  # argparse exposes groups only through this attribute
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
            if action.choices:
                values = ", ".join(str(c) for c in action.choices)
            elif action.metavar:
                values = str(action.metavar)
            elif action.nargs == 0:
                values = "(switch)"
            else:
                values = getattr(action.type, "__name__", "str")
            text = (action.help or "").replace("%(prog)s", "run_script.py").replace("|", "\\|")
            lines.append(f"| {names} | {values.replace('|', '/')} | {text} |")
    return "\n".join(lines) + "\n"
