#!/usr/bin/env python3
"""Write the parts of the docs that the code knows: rules, failure diagnosis, flags, results.

Hand-written prose lives in README.md, the skill card (SKILL.md, card.yaml) and
docs/training/communication-overlap.md; between marker comments

    <!-- BEGIN GENERATED: NAME -->  ...  <!-- END GENERATED: NAME -->      (Markdown)
    # BEGIN GENERATED: NAME  ...  # END GENERATED: NAME                    (YAML)

this script writes blocks built from the code, so they cannot drift from it:

- rules            every validator rule: `mbridge_epoverlap.config.rules.all_rules()`.
- diagnosis        the failure-diagnosis table: one row per rule (the symptom, cause and reproducer each rule
                   carries; the message and the fix are what the validator prints for the reproducer run at
                   generation time) plus the failures no rule can catch.
- failure_modes    the same rows as YAML, for card.yaml.
- core_versions    which Megatron-Core release enforces which rule: `mbridge_epoverlap.config.versions`.
- differences      the deliberate differences from Megatron-Bridge: `mbridge_epoverlap.config.differences`.
- run_script_flags every flag of `scripts/performance/run_script.py`, from the harness's `build_parser()`.
- cli              every `mbridge-epoverlap` subcommand and option, from `mbridge_epoverlap.cli.build_parser()`.
- cli_summary      the subcommands only (one line each).
- env_vars         the `MBRIDGE_EPOVERLAP_*` environment variables, from `mbridge_epoverlap.envvars`.
- results          the CPU A/B table from docs/results/cpu_ab.json, or "not yet measured".
- results_yaml     the same figures for card.yaml.
- results_figure   the A/B chart next to the results JSON, else the simulator's Gantt picture.

Usage:
    python scripts/generate_docs.py           # rewrite the generated blocks in place
    python scripts/generate_docs.py --check   # exit 1 when a file is out of date (nothing written)
    python scripts/generate_docs.py --images  # also draw the Gantt pictures with `mbridge-epoverlap simulate`
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import shlex
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an installed package
    sys.path.insert(0, str(ROOT))

SKILL_DIR = ROOT / "skills" / "nemo-mbridge-perf-expert-parallel-overlap"
README = ROOT / "README.md"
SKILL_MD = SKILL_DIR / "SKILL.md"
CARD_YAML = SKILL_DIR / "card.yaml"
TRAINING_DOC = ROOT / "docs" / "training" / "communication-overlap.md"
UPSTREAM_RECIPES_DOC = ROOT / "docs" / "training" / "upstream-perf-recipes.md"
SERVING_DOC = ROOT / "docs" / "serving" / "disaggregated-serving.md"
DOC_FILES: tuple[Path, ...] = (README, SKILL_MD, CARD_YAML, TRAINING_DOC, UPSTREAM_RECIPES_DOC, SERVING_DOC)
SERVING_RESULTS_JSON = ROOT / "docs" / "results" / "serving_bench.json"
RESULTS_JSON = ROOT / "docs" / "results" / "cpu_ab.json"
IMG_DIR = ROOT / "docs" / "training" / "img"
GANTT_1F1B = IMG_DIR / "combined_1f1b_gantt.png"
GANTT_PINGPONG = IMG_DIR / "pingpong_gantt.png"

# The simulator commands that draw the pictures the docs show (the docs print the same commands and a
# table computed with the same settings). Times are in ms: attention 1, experts 1, one all-to-all 1 (training)
# or 0.3 (serving), two MoE layers.
SIM_1F1B = {"micro_batches": 3, "layers": 2, "t_comm": 1.0}
SIM_PINGPONG = {"micro_batches": 3, "layers": 2, "t_comm": 0.3}
GANTT_COMMANDS: dict[Path, list[str]] = {
    GANTT_1F1B: ["simulate", "--schedule", "1f1b", "--micro-batches", "3", "--layers", "2", "--t-comm", "1",
                 "--png", "docs/training/img/combined_1f1b_gantt.png"],
    GANTT_PINGPONG: ["simulate", "--schedule", "pingpong", "--micro-batches", "3", "--layers", "2", "--t-comm", "0.3",
                     "--png", "docs/training/img/pingpong_gantt.png"],
}

_MD_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)", re.DOTALL)
_YAML_BLOCK = re.compile(
    r"(# BEGIN GENERATED: (?P<name>[\w-]+)\n)(?P<body>.*?)(# END GENERATED: (?P=name))", re.DOTALL)


# ---- Failure diagnosis ---------------------------------------------------------------------------------

# Reproducers run against this software unless a rule's example says otherwise: new enough that only the
# setting a row changes trips a rule, and pinned so the generated text does not depend on this machine.
BASE_VERSIONS = {"--torch-version": "2.7.0", "--te-version": "2.12.0", "--mcore-version": "0.20.0"}


def rule_command(rule: Any) -> list[str]:
    """`mbridge-epoverlap validate ...` arguments (after the program name) that reproduce a rule's example."""
    versions = dict(BASE_VERSIONS)
    versions.update(dict(rule.example_versions))
    args = ["validate", "-g", rule.example_gpu]
    for flag, value in versions.items():
        args += [flag, value]
    return args + list(rule.example)


@dataclass(frozen=True)
class OtherFailure:
    """A failure no validator rule can catch (it depends on the run, not on the config)."""

    name: str
    symptom: str
    cause: str
    check: str
    fix: str


OTHER_FAILURES: tuple[OtherFailure, ...] = (
    OtherFailure(
        "hang_old_torch",
        "the job hangs at the first overlapped MoE layer; no error, no progress, until the Slurm time limit",
        "PyTorch < 2.6 in the job's container, while validation ran against another (newer) torch",
        "`python -c 'import torch; print(torch.__version__)'` inside the container; then "
        "`mbridge-epoverlap validate --torch-version <that version>` reports `torch_version`",
        "a container with torch >= 2.6, or `--moe_a2a_overlap false`"),
    OtherFailure(
        "flex_backend_field_only",
        "flex was asked for, but the run is as slow as alltoall and shows no DeepEP/HybridEP kernels",
        "only `model.moe_flex_dispatcher_backend` was set; the dispatcher type stayed `alltoall`, so the "
        "backend field is ignored",
        "the resolved config (`--dryrun --save_config_filepath cfg.yaml`) shows "
        "`moe_token_dispatcher_type: alltoall`; `mbridge-epoverlap profile` finds no `deep_ep`/`hybrid_ep` kernels",
        "use `--moe_flex_dispatcher_backend deepep` (or `hybridep`), or call "
        "`apply_flex_dispatcher_backend(model_cfg, \"deepep\")` in the recipe: both set the type, the backend "
        "and `moe_shared_expert_overlap=False` together"),
    OtherFailure(
        "flex_skipped_on_gpu",
        "a `FlexDispatcherWarning` (\"... keeping the alltoall dispatcher\") in the log of a recipe that calls "
        "`apply_flex_dispatcher_backend`",
        "the target GPU does not support the backend (e.g. DeepEP on GB200)",
        "`mbridge-epoverlap validate -g <gpu> model.moe_token_dispatcher_type=flex "
        "model.moe_flex_dispatcher_backend=<backend>` reports `flex_backend_gpu`",
        "`--moe_flex_dispatcher_backend hybridep`, or `strict=True` to make it an error"),
    OtherFailure(
        "summed_kernel_time_rises",
        "after enabling overlap, the summed duration of communication or GEMM kernels goes up",
        "expected: kernels that run concurrently share SMs and memory bandwidth, so each one takes longer "
        "even when the step gets shorter",
        "`mbridge-epoverlap profile off.sqlite on.sqlite --compare`: overlap should rise, exposed communication "
        "and the active union should fall",
        "none needed; judge by step time in a stable window and by the union of GPU-active intervals, "
        "never by summed kernel time"),
    OtherFailure(
        "serialized_streams",
        "overlap on, validation clean, but no speed-up and no communication/compute overlap in the profile",
        "`CUDA_DEVICE_MAX_CONNECTIONS=1` in the launch environment (or set from Python after start-up, which "
        "has no effect), so the comm stream queues behind the compute stream",
        "the launch environment the harness prints or writes into the sbatch script; `run_script.py` warns when "
        "`CUDA_DEVICE_MAX_CONNECTIONS=1` (an `env_vars.` override, or the recipe's own value) meets EP overlap",
        "drop the override, or give --moe_a2a_overlap true: after it (or -tp, -cp) the harness recomputes the "
        "value as Megatron-Bridge does (8; 32 after a DeepEP/HybridEP recipe or on Blackwell)"),
    OtherFailure(
        "no_gain_small_comm",
        "overlap on, matched A/B shows no gain",
        "dispatch/combine is a small share of the step (small EP, fast links, or large experts), so there is "
        "little to hide",
        "`mbridge-epoverlap profile` on the baseline: exposed communication as a share of the active union",
        "keep overlap off for this shape, or move to flex (DeepEP/HybridEP) where the all-to-all is the bottleneck"),
)


# ---- Parsers -------------------------------------------------------------------------------------------


def cli_parser() -> argparse.ArgumentParser:
    """The `mbridge-epoverlap` parser, as the console script builds it."""
    from mbridge_epoverlap.cli import build_parser

    return build_parser()


def harness_parser() -> argparse.ArgumentParser:
    """`run_script.py`'s parser, as the harness builds it."""
    from mbridge_epoverlap.harness.flags import build_parser

    parser = build_parser()
    parser.prog = "run_script.py"
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """{name: (help, parser)} of a parser's subcommands, in registration order."""
    found: dict[str, tuple[str, argparse.ArgumentParser]] = {}
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found[name] = (helps.get(name, ""), sub)
    return found


# ---- Rendering helpers ---------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else f"``{text}``"


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _help_text(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if text == argparse.SUPPRESS:
        return ""
    return text.replace("%(prog)s", prog).replace("%(default)s", str(action.default)).replace("%%", "%")


def _default_text(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS, [], ()):
        return ""
    if type(default).__name__ == "_Unset":  # the harness's "keep the recipe's value" marker
        return "recipe's"
    return str(getattr(default, "text", default))


# Names of argparse type converters as a reader would say them.
_TYPE_WORDS = {"lower": "str", "str": "str", "int": "integer", "float": "number", "positive_int": "integer >= 1",
               "positive_float": "number > 0", "bool_arg": "true, false"}


def _values_text(action: argparse.Action) -> str:
    if action.choices:
        return ", ".join("None" if c is None else str(c) for c in action.choices)
    if action.nargs == 0:
        return "(switch)"
    if action.metavar:
        return str(action.metavar)
    name = getattr(action.type, "__name__", "str") if action.type else "str"
    return _TYPE_WORDS.get(name.lstrip("_"), name.lstrip("_").replace("_", " "))


def _harness_meanings() -> dict[str, str]:
    """{dest: meaning} for harness flags without help text: the setting a flag writes, or its sbatch option."""
    keys = {"global_batch_size": "train.global_batch_size", "micro_batch_size": "train.micro_batch_size"}
    from mbridge_epoverlap.harness.flags import MODEL_FLAGS

    keys.update({dest: f"model.{field}" for dest, field in MODEL_FLAGS})
    meanings = {dest: f"sets {_code(key)}" for dest, key in keys.items()}
    meanings.update(account="Slurm account (`sbatch --account`)", partition="Slurm partition (`sbatch --partition`)")
    return meanings


def _option_rows(parser: argparse.ArgumentParser, meanings: dict[str, str] | None = None) -> list[list[str]]:
    rows = []
    meanings = meanings or {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            names = ", ".join(_code(s) for s in action.option_strings)
        else:
            names = _code(str(action.metavar or action.dest))
        meaning = _help_text(action, parser.prog)
        if not meaning:
            meaning = meanings.get(action.dest, "")
        rows.append([names, _values_text(action), _default_text(action), meaning])
    return rows


# ---- Blocks --------------------------------------------------------------------------------------------


def render_rules() -> str:
    from mbridge_epoverlap.config.rules import all_rules

    when_text = {"overlap": "EP overlap on", "delay_wgrad": "delayed wgrad on", "always": "always",
                 "layout": "always (run layout)"}
    rows = [[_code(r.id), when_text.get(r.when, r.when), r.source, r.summary, r.versions] for r in all_rules()]
    return (f"{len(rows)} rules (`mbridge-epoverlap validate --list-rules` prints the same list). All are checked "
            "on every validation and every violation is reported at once; `--mcore-version` and `--bridge-version` "
            "pick the releases (default: installed, else the newest Megatron-Core rules and Megatron-Bridge 0.6; "
            "`--bridge-version main` checks with Megatron-Core main, 0.20, unless `--mcore-version` says otherwise). "
            "A rule whose releases exclude the ones checked is not run; `validate --list-rules --bridge-version main` "
            "lists the rules of main.\n\n"
            + _table(["rule", "checked when", "source", "constraint", "releases"], rows))


@dataclass(frozen=True)
class Reproduced:
    """What the validator says for a rule's reproducer."""

    rules: tuple[str, ...]  # every rule the reproducer breaks (errors and warnings)
    message: str
    fix: str
    severity: str


def reproduce(rule: Any) -> Reproduced:
    """Run a rule's reproducer through the validator (in process, exactly as `validate` would)."""
    from mbridge_epoverlap.config.environment import Environment
    from mbridge_epoverlap.config.overrides import apply_overrides
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE
    from mbridge_epoverlap.recipes.loader import load_recipe

    args = cli_parser().parse_args(rule_command(rule))
    # All three versions are given, so this is the environment `validate` builds, without probing torch.
    env = Environment.for_gpu(args.gpu, torch_version=args.torch_version, te_version=args.te_version,
                              mcore_version=args.mcore_version, bridge_version=args.bridge_version)
    cfg = load_recipe(args.recipe or DEFAULT_RECIPE, args.task)
    apply_overrides(cfg, args.overrides)
    violations = cfg.validate(env)
    mine = [v for v in violations if v.rule == rule.id]
    if not mine:
        raise RuntimeError(f"the example of rule {rule.id!r} does not trip it (it trips "
                           f"{[v.rule for v in violations]}); fix its `example` in mbridge_epoverlap/config/rules/")
    return Reproduced(tuple(v.rule for v in violations), mine[0].message, mine[0].fix, mine[0].severity)


def diagnosis_rows() -> list[dict[str, str]]:
    """Every failure-diagnosis row: one per rule (its own symptom, cause and reproducer), then the rest."""
    from mbridge_epoverlap.config.rules import all_rules

    rows = []
    for rule in all_rules():
        r = reproduce(rule)
        rows.append({
            "id": rule.id,
            "symptom": f"{rule.symptom}; `validate` says: {r.message}",
            "cause": rule.cause,
            "check": f"{rule.where}; reproduce: `mbridge-epoverlap {shlex.join(rule_command(rule))}`",
            "fix": r.fix,
        })
    for o in OTHER_FAILURES:
        rows.append({"id": o.name, "symptom": o.symptom, "cause": o.cause, "check": o.check, "fix": o.fix})
    return rows


_CORE_ROWS = (
    ("mtp_allows_zero", "`mtp_num_layers = 0` allowed with overlap (None and 1 always are)"),
    ("mtp_one_needs_pp", "`mtp_num_layers = 1` needs PP > 1"),
    ("rejects_moe_recompute", "`moe` in `recompute_modules` rejected (Megatron-Bridge: always)"),
    ("graph_impl_must_be_te", "any CUDA graph with overlap must be `transformer_engine`"),
    ("rejects_te_graph_of_moe", "`transformer_engine` graph of `moe`/`mlp` rejected"),
    ("delay_te_graph_needs_te_2_10", "delayed wgrad + `transformer_engine` graphs needs TE >= 2.10"),
    ("delay_rejects_legacy_grouped_gemm", "delayed wgrad rejects `moe_use_legacy_grouped_gemm`"),
    ("has_early_attn_release", "`model.ep_overlap_early_attn_memory_release` exists (needs overlap)"),
    ("has_graph_modules", "graph scope in `cuda_graph_modules`; `full_iteration` implementation"),
    ("has_dispatch_wgrad_overlap", "`overlap_dispatch_backward_with_experts_wgrad` exists (excludes overlap)"),
    ("has_rank_capacity_factor", "`moe_expert_rank_capacity_factor` (hybridep/ncclep) and the TE op fuser exist"),
    ("ncclep_capacity_picks_mode", "NCCL EP: the rank capacity factor picks static or eager; no drop-and-pad (#6229)"),
    ("has_a2a_dtypes", "`moe_dispatch_fwd_dtype` / `moe_combine_bwd_dtype` (ncclep only; mxfp8 needs the fused GEMM)"),
    ("has_grouped_tensor", "`moe_use_grouped_tensor` (needs grouped GEMM; ncclep also the op fuser, #6000)"),
    ("has_fsdp_v2", "Megatron-FSDP v2 (`ddp.megatron_fsdp_version=2`; no delayed wgrad, no graphs, #5865)"),
)


def render_core_versions() -> str:
    from mbridge_epoverlap.config.versions import KNOWN_RELEASES, core_rules

    rules = [core_rules(release) for release in KNOWN_RELEASES]
    rows = [[text, *("yes" if getattr(r, field) else "no" for r in rules)] for field, text in _CORE_ROWS]
    return ("What each Megatron-Core release's `TransformerConfig` enforces (read from the release tags; "
            "`--mcore-version` picks the column, the newest when unknown; 0.20 is Megatron-LM main). A whole-layer "
            "`transformer_engine` graph with overlap passes `TransformerConfig` in every release but, from 0.16, "
            "fails when the layer is built (`cuda_graph_whole_layer`).\n\n"
            + _table(["rule", *KNOWN_RELEASES], rows))


def render_differences() -> str:
    from mbridge_epoverlap.config.differences import DIFFERENCES

    rows = [[d.topic, d.upstream, d.ours, d.why, d.open_pr or "none"] for d in DIFFERENCES]
    return ("Deliberate differences from Megatron-Bridge (each row holds for the 0.6.2 release and for main at "
            "067f987, 2026-08-22, with Megatron-Core 0.19-0.20). Everything else behaves as upstream; any other "
            "difference is a bug. The last column names the open upstream pull request that would change a row.\n\n"
            + _table(["topic", "Megatron-Bridge", "mbridge_epoverlap", "why", "open pull request"], rows))


def render_diagnosis() -> str:
    rows = diagnosis_rows()
    table = _table(["id", "symptom", "likely cause", "how to check", "fix"],
                   [[_code(r["id"]), r["symptom"], r["cause"], r["check"], r["fix"]] for r in rows])
    return ("One row per validator rule (the `validate` message and fix are the validator's own output for the "
            "reproducer shown), then the failures no rule can catch.\n\n" + table)


def render_failure_modes() -> str:
    import yaml

    text = yaml.safe_dump(diagnosis_rows(), sort_keys=False, width=100, allow_unicode=True)
    return "".join(f"  {line}\n" for line in text.splitlines())


def render_run_script_flags() -> str:
    parser = harness_parser()
    return ("Every flag of `scripts/performance/run_script.py` (from `build_parser()` in the harness). A flag that "
            "is absent keeps the recipe's value; positional `KEY=VALUE` items are dotted overrides.\n\n"
            + _table(["flag", "values", "default", "meaning"], _option_rows(parser, _harness_meanings())))


def render_cli() -> str:
    parts = []
    for name, (help_text, sub) in subcommands(cli_parser()).items():
        parts.append(f"#### `mbridge-epoverlap {name}`\n\n{_cell(help_text)}.\n\n"
                     + _table(["option", "values", "default", "meaning"], _option_rows(sub)))
    return "\n".join(parts)


def render_cli_summary() -> str:
    rows = [[_code(f"mbridge-epoverlap {name}"), help_text] for name, (help_text, _) in
            subcommands(cli_parser()).items()]
    return _table(["command", "what it does"], rows)


def render_env_vars() -> str:
    from mbridge_epoverlap.envvars import env_markdown

    return env_markdown()


def load_results(path: Path | None = None) -> dict[str, Any] | None:
    path = path or RESULTS_JSON  # looked up at call time so tests can point it elsewhere
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


NOT_MEASURED = ("Not yet measured: `docs/results/cpu_ab.json` is not in this checkout. Run `make run` (the CPU "
                "A/B), copy the results JSON it names (and the `.png` next to it) to `docs/results/cpu_ab.json` "
                "(`cpu_ab.png`) and run `make docs`.\n")


def equivalent_command(doc: dict[str, Any]) -> str:
    """The run_script.py command line a results JSON describes (rebuilt from its recorded settings)."""
    if doc.get("command"):
        command = doc["command"]
        return shlex.join(command) if isinstance(command, list) else str(command)
    args = ["python", "scripts/performance/run_script.py"]
    for flag, key in (("-mr", "recipe"), ("--task", "task"), ("-g", "gpu"), ("-ng", "num_gpus"),
                      ("-ms", "max_steps"), ("--ab", "ab"), ("--repeats", "repeats")):
        if doc.get(key) not in (None, ""):
            args += [flag, str(doc[key])]
    window = doc.get("stable_window")
    if isinstance(window, list) and len(window) == 2:
        args += ["--stable_window", f"{window[0]}:{window[1]}"]
    return shlex.join(args)


def machine_text(doc: dict[str, Any]) -> str:
    """Where a result was measured, from the environment the harness records."""
    env = doc.get("environment") or {}
    machine = env.get("machine") if isinstance(env, dict) else None
    parts = []
    if isinstance(machine, dict):
        for key in ("hostname", "cpu", "processor", "cpus", "platform", "python"):
            value = machine.get(key)
            if value not in (None, ""):
                parts.append(f"{key} {value}")
    if isinstance(env, dict):
        for key in ("torch_version", "mcore_version"):
            if env.get(key):
                parts.append(f"{key.split('_')[0]} {env[key]}")
    return ", ".join(parts) or "not recorded"


def cpu_text(doc: dict[str, Any]) -> str:
    """The CPU flags a result was measured with and the dtype it computed in: CPU step times depend on
    native bf16 (`avx512_bf16`/`amx_bf16`) several-fold."""
    env = doc.get("environment") or {}
    machine = env.get("machine") if isinstance(env, dict) else None
    flags = machine.get("cpu_flags") if isinstance(machine, dict) else None
    if flags is None:
        text = ("CPU flags not recorded (measured before the harness recorded them; re-run `make run` to "
                "record them)")
    else:
        native = any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))
        text = (f"CPU flags {' '.join(flags) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'} "
                f"({'native bf16' if native else 'no native bf16'})")
    precision = env.get("compute_dtype") if isinstance(env, dict) else None
    if isinstance(precision, dict) and precision.get("reason"):
        text += f"; computed in {precision['reason']}"
    return text


def results_markdown(doc: dict[str, Any]) -> str:
    """The A/B table of a harness results JSON (the harness's own table), with where and how it ran."""
    from mbridge_epoverlap.harness.report import markdown_table
    from mbridge_epoverlap.harness.stats import overlap_ceiling

    lines = [f"- machine: {machine_text(doc)}",
             f"- CPU: {cpu_text(doc)}",
             f"- command: {_code(equivalent_command(doc))}",
             f"- measured: {doc.get('created_utc') or 'date not recorded'}"
             f" ({doc.get('executor') or 'local'} executor, {doc.get('repeats')} interleaved repeat(s))",
             "", markdown_table(doc).rstrip("\n")]
    lines += ["", "`relative` is the baseline's stable-window mean over the case's (above 1 is faster). CPU "
              "processes over gloo on loopback: a check of the method and the runtime, not a prediction for GPUs."]
    cases = doc.get("cases") or []
    base = cases[0] if cases else {}
    if base.get("comm_wait_s") is not None and base.get("comm_cpu_s") is not None and base.get("stable_mean_s"):
        step, wait, cpu = base["stable_mean_s"], base["comm_wait_s"], base["comm_cpu_s"]
        ceiling = overlap_ceiling(step, wait, cpu)
        lines += ["", f"`exposed comm / iter` is the time the training thread spent issuing and waiting for "
                      f"all-to-alls. Over gloo most of an all-to-all is CPU work (in the baseline, {cpu * 1e3:.0f} ms "
                      f"per iteration ran on the communication threads), and with every core computing, that work "
                      f"cannot be hidden: hiding every wait gains roughly {step * 1e3:.0f} / ({step * 1e3:.0f} - "
                      f"{wait * 1e3:.0f} + {cpu * 1e3:.0f}) = {ceiling:.2f}x on this machine, an "
                      "estimate that single A/B runs scatter around. Behind a slower link, where moving the bytes is "
                      "not CPU work, the same runtime gains more (`benchmarks/runtime_overlap_bench.py "
                      "--emulate-link-gbps 1`)."]
    return "\n".join(lines) + "\n"


def render_results() -> str:
    doc = load_results()
    if doc is None:
        return NOT_MEASURED
    return results_markdown(doc)


def render_results_yaml() -> str:
    import yaml

    doc = load_results()
    if doc is None:
        data: Any = {"status": "not yet measured", "source": "docs/results/cpu_ab.json (absent)"}
    else:
        data = {"status": "measured", "source": "docs/results/cpu_ab.json",
                "summary": results_markdown(doc).strip()}
    text = yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True)
    return "".join(f"    {line}\n" for line in text.splitlines())


def results_chart() -> Path | None:
    """The A/B chart the harness writes next to the results JSON (same stem, .png)."""
    chart = RESULTS_JSON.with_suffix(".png")
    return chart if chart.is_file() else None


def render_results_figure() -> str:
    chart = results_chart()
    if chart is not None:
        return f"![CPU A/B of EP overlap]({chart.relative_to(ROOT).as_posix()})\n"
    if GANTT_1F1B.is_file():
        return (f"![Combined 1F1B schedule with EP overlap]({GANTT_1F1B.relative_to(ROOT).as_posix()})\n\n"
                "The simulated combined 1F1B schedule (`mbridge-epoverlap simulate --schedule 1f1b`); the A/B chart "
                "appears here once `docs/results/cpu_ab.png` exists.\n")
    return "No picture yet: neither the A/B chart nor the simulator's Gantt chart is in this checkout.\n"


def render_flex_support() -> str:
    from mbridge_epoverlap.config.environment import GPU_CATALOG, Environment
    from mbridge_epoverlap.config.flex import FLEX_BACKENDS, backend_supports_gpu

    rows = []
    for key, spec in GPU_CATALOG.items():
        env = Environment.for_gpu(key)
        support = ["yes" if backend_supports_gpu(b, env) else "no" for b in FLEX_BACKENDS]
        capability = ".".join(map(str, spec.compute_capability)) if spec.compute_capability else "not known here"
        rows.append([_code(key), spec.device_name or "not known here", capability, str(spec.nvlink_domain),
                     *support])
    return ("Where `apply_flex_dispatcher_backend` enables each flex backend (`-g` values; from "
            "`config/flex.py` and the GPU catalog `mbridge_epoverlap/gpus.py`; a GPU whose capability is not "
            "known here gets neither backend):\n\n"
            + _table(["-g", "device name", "compute capability", "NVLink domain", *FLEX_BACKENDS], rows))


def render_recipes() -> str:
    from mbridge_epoverlap.recipes import FAMILIES, RECIPES

    rows = []
    for name, fn in RECIPES.items():
        family = next((f for f, names in FAMILIES.items() if name in names), "")
        cfg = fn("pretrain")
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        on_off = {True: "on", False: "off"}
        rows.append([_code(name), _code(family), doc, on_off[cfg.comm_overlap.effective_overlap(cfg.model)],
                     on_off[cfg.comm_overlap.effective_delay_wgrad(cfg.model)]])
    return _table(["recipe (`-mr`)", "family (`-m`)", "shape", "EP overlap", "delayed wgrad"], rows)


def upstream_recipe_rows(release: str | None = None) -> list[dict[str, Any]]:
    """Every performance recipe of the facts fixture of `release` (None: the newest release), as the validator
    reads it: its name's parts and the EP settings the job would run with."""
    from mbridge_epoverlap.config.container import RunConfig
    from mbridge_epoverlap.config.overrides import apply_recipe_values
    from mbridge_epoverlap.harness.recipe_facts import load_facts
    from mbridge_epoverlap.recipes.bridge_models import PERF_PREFIX, recipe_parts

    rows = []
    for key, facts in load_facts(release=release)["recipes"].items():
        module, _, function = key.rpartition(".")
        parts = recipe_parts(function)
        if not module.startswith(PERF_PREFIX) or parts is None:
            continue
        cfg = RunConfig()
        apply_recipe_values(cfg, facts)
        m = cfg.model
        rows.append({**parts, "family": module.removeprefix(PERF_PREFIX), "ep": m.expert_model_parallel_size,
                     "dispatcher": m.moe_token_dispatcher_type,
                     "backend": m.moe_flex_dispatcher_backend if m.moe_token_dispatcher_type == "flex" else None,
                     "overlap": cfg.comm_overlap.effective_overlap(m),
                     "delay": cfg.comm_overlap.effective_delay_wgrad(m),
                     "graphs": m.cuda_graph_impl, "scopes": list(m.cuda_graph_scope)})
    return sorted(rows, key=lambda r: (r["family"], r["model"], r["task"], r["gpu"], r["precision"], r["variant"],
                                       int(r["count"])))


def render_upstream_recipe_summary() -> str:
    """Per workload: how many performance configs Megatron-Bridge ships and how many turn each switch on."""
    from collections import defaultdict

    from mbridge_epoverlap.harness.recipe_facts import facts_label, load_facts
    from mbridge_epoverlap.recipes.bridge_models import recipe_parts

    by_workload: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in upstream_recipe_rows():
        by_workload[(row["family"], row["model"])].append(row)
    broken: dict[str, int] = defaultdict(int)
    for key in load_facts().get("not_built", {}):
        parts = recipe_parts(key.rpartition(".")[2])
        if parts is not None and ".perf_recipes." in key:
            broken[parts["model"]] += 1
    table = []
    for (family, model), rows in sorted(by_workload.items()):
        on = [r for r in rows if r["overlap"]]
        where = ", ".join(sorted({f"{r['gpu']} {r['precision']}" for r in on})) or "none"
        table.append([_code(family), _code(model), len(rows), broken.get(model, 0), len(on),
                      sum(r["delay"] for r in rows), where])
    total = sum(len(rows) for rows in by_workload.values())
    return (f"{facts_label()}: {total} performance configs of {len(by_workload)} workloads, and "
            f"{sum(broken.values())} the release has but cannot build (`scripts/extract_bridge_recipe_facts.py`; "
            "every row: docs/training/upstream-perf-recipes.md).\n\n"
            + _table(["family (`-m`)", "workload (`-mr`)", "configs", "not buildable", "EP overlap on",
                      "delayed wgrad on", "where overlap is on"], table))


def render_upstream_recipes() -> str:
    """Every performance recipe of Megatron-Bridge with its EP layout, dispatcher and the two switches."""
    on_off = {True: "on", False: "off"}
    rows = [[_code(r["model"]), r["task"], r["gpu"], r["count"], r["precision"], r["variant"], r["ep"],
             r["dispatcher"] + (f" ({r['backend']})" if r["backend"] else ""), on_off[r["overlap"]],
             on_off[r["delay"]], r["graphs"] + (f": {', '.join(r['scopes'])}" if r["scopes"] else "")]
            for r in upstream_recipe_rows()]
    return _table(["workload", "task", "GPU", "GPUs", "precision", "variant", "EP", "dispatcher", "EP overlap",
                   "delayed wgrad", "CUDA graphs"], rows)


def _sim_row(label: str, timeline: Any, micro_batches: int | None = None) -> list[str]:
    data = timeline.to_dict()
    util = ", ".join(f"{name} {value:.0%}" for name, value in data["utilization"].items())
    row = [label, f"{data['makespan']:.4g}"]
    if micro_batches is not None:  # serving: what each micro-batch costs is what throughput sees
        row.append(f"{data['makespan'] / micro_batches:.3g}")
    return row + [f"{data['exposed_comm']:.4g}", util]


def render_schedule_sim() -> str:
    from mbridge_epoverlap.schedule.presets import simulate_schedule

    cases = (("plain 1F1B (`--no-overlap`)", {"overlap": False}),
             ("combined 1F1B, Megatron-Core's edges (`--megatron-core-edges`)",
              {"overlap": True, "paired_edges": False}),
             ("combined 1F1B (EP overlap)", {"overlap": True}),
             ("combined 1F1B + delayed wgrad (`--delay-wgrad`)", {"overlap": True, "delay_wgrad": True}))
    rows = [_sim_row(label, simulate_schedule("1f1b", **SIM_1F1B, **extra)) for label, extra in cases]
    return ("`mbridge-epoverlap simulate --schedule 1f1b --micro-batches 3 --layers 2 --t-comm 1` with and without "
            "overlap (attention 1 ms, experts 1 ms, one all-to-all 1 ms, backward twice the forward):\n\n"
            + _table(["schedule", "makespan (ms)", "exposed comm (ms)", "utilization"], rows))


def render_pingpong_sim() -> str:
    from mbridge_epoverlap.schedule.presets import min_micro_batches, simulate_schedule

    settings = dict(SIM_PINGPONG)
    rows = []
    for m in (1, 2, 3, 4):
        settings["micro_batches"] = m
        rows.append(_sim_row(f"m = {m}", simulate_schedule("pingpong", **settings), m))
    smallest = min_micro_batches(1.0, 1.0, SIM_PINGPONG["t_comm"])
    return ("`mbridge-epoverlap simulate --schedule pingpong --layers 2 --t-comm 0.3 --micro-batches M` "
            f"(attention 1 ms, experts 1 ms, one transfer 0.3 ms); the smallest m that keeps the busiest worker "
            f"busy is {smallest}:\n\n"
            + _table(["micro-batches", "makespan (ms)", "per micro-batch (ms)", "exposed comm (ms)", "utilization"],
                     rows))


def _first_paragraph(module_path: Path) -> str:
    import ast

    doc = ast.get_docstring(ast.parse(module_path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def render_serving_modules() -> str:
    """One row per room of `serving/` (its package docstring's first paragraph), then one per module in it."""
    folder = ROOT / "mbridge_epoverlap" / "serving"
    rows = []
    for init in sorted(folder.glob("*/__init__.py")):
        room = init.parent
        rows.append([f"**{_code(room.relative_to(ROOT).as_posix() + '/')}**", _first_paragraph(init)])
        rows += [[_code(p.relative_to(ROOT).as_posix()), _first_paragraph(p)]
                 for p in sorted(room.glob("*.py")) if p.stem != "__init__"]
    return ("The serving rooms and their modules (each with its own description):\n\n"
            + _table(["room / module", "what it does"], rows))


def render_stage_table() -> str:
    from mbridge_epoverlap.schedule.program import STAGES, Kind

    rows = []
    for stage in STAGES.values():
        needs = ", ".join(f"{n.stage} ({n.where.value} layer)" for n in stage.needs) or "-"
        if stage.kind is Kind.COMM:
            where = (f"issued by {stage.role.value}, waited by {stage.to_role.value}" if stage.to_role
                     else "one process (training)")
        else:
            where = stage.role.value if stage.direction.value == "F" else "one process (training)"
        rows.append([_code(stage.name), stage.kind.value, "forward" if stage.direction.value == "F" else "backward",
                     needs, where])
    return ("The stage table (`mbridge_epoverlap.schedule.program.STAGES`): `check_schedule`, the simulator, the "
            "training executor and the serving workers all derive their dependencies and roles from it. "
            "`previous layer` is the layer below going forward and the layer above going backward; `turn` "
            "applies where backward starts (the top layer).\n\n"
            + _table(["stage", "kind", "direction", "needs", "disaggregated serving: runs on"], rows))


def render_serving_results() -> str:
    if not SERVING_RESULTS_JSON.is_file():
        return ("Not yet measured: `python benchmarks/serving_bench.py --json docs/results/serving_bench.json` "
                "writes the figures this block shows.\n")
    doc = json.loads(SERVING_RESULTS_JSON.read_text(encoding="utf-8"))
    m = doc["machine"]
    rows = [[name, f"{c['tokens_per_s']:.1f}", f"{c['predicted_tokens_per_s']:.1f}",
             f"{c['utilization']['attention']:.0%} / {c['utilization']['expert']:.0%}", f"{c['tbt_ms_p50']:.1f}",
             "yes" if c["matches_reference"] else "no"] for name, c in doc["cases"].items()]
    r = doc["ratios"]
    command = doc.get("command", "python benchmarks/serving_bench.py")
    return (f"`{command}` on {m['cpu']} ({m['cores']} cores, avx512_bf16="
            f"{m['avx512_bf16']}, amx_bf16={m['amx_bf16']}). "
            f"{doc['batch']} sequences, 1 attention + 1 expert worker (colocated: 2 processes); medians of "
            f"{doc.get('repeats', 'several')} interleaved repeats (ratios are medians of per-repeat ratios; single "
            "repeats scatter by about 20 % on a 2-vCPU VM).\n\n"
            + _table(["case", "decode tokens/s", "predicted (replay)", "utilization attention / expert",
                      "TBT p50 (ms)", "tokens = reference"], rows)
            + f"\nm=2 / m=1: {r['m2_over_m1']:.2f}x (target >= 1.7); m=3 / m=2: {r['m3_over_m2']:.2f}x (target >= "
              f"0.95); disaggregated m=2 / colocated: {r['disaggregated_m2_over_colocated']:.2f}x.\n")


def render_serving_architectures() -> str:
    """One row per registered architecture of `serving.model.architectures`: its module and what differs."""
    from mbridge_epoverlap.serving.model import architectures

    rows = [[_code(arch.name), _code(type(arch).__module__.rsplit(".", 1)[-1] + ".py"), _code(arch.expert_ffn_field),
             ", ".join(_code(m) for m in arch.quantizations) or "none", arch.summary]
            for arch in architectures.REGISTRY.values()]
    return ("The Hugging Face architectures `serve` loads from a checkpoint directory (the `architectures` entry of "
            "its `config.json`), one module each in `mbridge_epoverlap/serving/model/architectures/`. Every one "
            "decodes to `transformers`' greedy tokens, its reference-model prefill logits equal `transformers`' "
            "eager model bit for bit (`docs/numerics.md`), and a field it cannot serve (a `quantization_config` "
            "method or a rope scaling its row does not name, a feature the table does not name) stops `serve` with "
            "exit 2 before any weight is read. `fp8`: the block-scaled FP8 weights of DeepSeek-V3/R1, Kimi K2 and "
            "the `-FP8` releases of Qwen3 and GLM-4.5 (`float8_e4m3fn` with a `weight_scale_inv` per block of "
            "`weight_block_size`), sharded as released, dequantized in fp32 as each tensor is read (an expert worker "
            "reads only its experts' blocks and scales); served in fp32, each expert also keeps FP8 tiles that a "
            "decode step's one-row experts read, with the fp32 tiles' bits (`MBRIDGE_EPOVERLAP_QUANTIZED_TILES`, "
            "`benchmarks/fp8_tiles.py`).\n\n"
            + _table(["architecture", "module", "experts' FFN width", "quantized weights",
                      "what differs from the shared layout"], rows))


RENDERERS: dict[str, Callable[[], str]] = {
    "rules": render_rules,
    "differences": render_differences,
    "core_versions": render_core_versions,
    "diagnosis": render_diagnosis,
    "failure_modes": render_failure_modes,
    "run_script_flags": render_run_script_flags,
    "cli": render_cli,
    "cli_summary": render_cli_summary,
    "env_vars": render_env_vars,
    "results": render_results,
    "results_yaml": render_results_yaml,
    "results_figure": render_results_figure,
    "flex_support": render_flex_support,
    "recipes": render_recipes,
    "upstream_recipe_summary": render_upstream_recipe_summary,
    "upstream_recipes": render_upstream_recipes,
    "schedule_sim": render_schedule_sim,
    "pingpong_sim": render_pingpong_sim,
    "serving_modules": render_serving_modules,
    "stage_table": render_stage_table,
    "serving_results": render_serving_results,
    "serving_architectures": render_serving_architectures,
}


# ---- Files ---------------------------------------------------------------------------------------------


def _display(path: Path) -> str:
    """A path as messages show it: relative to the repository when inside it."""
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _relative_links(text: str, path: Path) -> str:
    """Repository-root image links (docs/...) rewritten relative to the file that shows them."""
    try:
        depth = len(path.relative_to(ROOT).parts) - 1
    except ValueError:  # a file outside the checkout (tests): keep the links as they are
        return text
    if depth == 0:
        return text
    return re.sub(r"\]\((docs/[^)]+)\)", lambda m: f"]({'../' * depth}{m.group(1)})", text)


def render_file(path: Path, cache: dict[str, str] | None = None) -> str:
    """The file's text with every generated block rewritten."""
    cache = {} if cache is None else cache
    text = path.read_text(encoding="utf-8")
    pattern = _YAML_BLOCK if path.suffix in (".yaml", ".yml") else _MD_BLOCK

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in RENDERERS:
            raise KeyError(f"{_display(path)}: unknown generated block {name!r}; known: {sorted(RENDERERS)}")
        if name not in cache:
            cache[name] = RENDERERS[name]()
        body = cache[name] if pattern is _YAML_BLOCK else _relative_links(cache[name], path)
        if not body.endswith("\n"):
            body += "\n"
        return match.group(1) + body + match.group(4)

    return pattern.sub(replace, text)


def generated_blocks(path: Path) -> list[str]:
    pattern = _YAML_BLOCK if path.suffix in (".yaml", ".yml") else _MD_BLOCK
    return [m.group("name") for m in pattern.finditer(path.read_text(encoding="utf-8"))]


def stale_files(files: Iterable[Path] | None = None) -> dict[Path, str]:
    """{path: unified diff} of every file whose generated blocks are out of date."""
    files = DOC_FILES if files is None else files  # looked up at call time so tests can point it elsewhere
    cache: dict[str, str] = {}
    stale = {}
    for path in files:
        if not path.is_file():
            stale[path] = f"{_display(path)} is missing\n"
            continue
        old = path.read_text(encoding="utf-8")
        new = render_file(path, cache)
        if new != old:
            rel = _display(path)
            stale[path] = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, rel, n=1))
    return stale


def draw_images(only_missing: bool = False) -> list[Path]:
    """Draw the Gantt pictures with the simulator commands the docs show."""
    from mbridge_epoverlap.cli import main

    drawn = []
    for path, args in GANTT_COMMANDS.items():
        if only_missing and path.is_file():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if main(args + ["--json"]) != 0:
            raise RuntimeError(f"mbridge-epoverlap {shlex.join(args)} failed")
        drawn.append(path)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated block is out of date")
    parser.add_argument("--images", action="store_true", help="also draw the Gantt pictures (missing ones only "
                        "unless --force-images)")
    parser.add_argument("--force-images", action="store_true", help="redraw the Gantt pictures even if present")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for diff in stale.values():
            sys.stdout.write(diff)
        if stale:
            names = ", ".join(_display(p) for p in stale)
            print(f"out of date: {names}; run `make docs` (python scripts/generate_docs.py)", file=sys.stderr)
            return 1
        print("docs are up to date")
        return 0
    if args.images or args.force_images:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):  # the simulator's JSON is not wanted here
            drawn = draw_images(only_missing=not args.force_images)
        for path in drawn:
            print(f"drew {_display(path)}")
    cache: dict[str, str] = {}
    for path in DOC_FILES:
        if not path.is_file():
            print(f"skipped {_display(path)} (missing)", file=sys.stderr)
            continue
        old = path.read_text(encoding="utf-8")
        new = render_file(path, cache)
        if new != old:
            path.write_text(new, encoding="utf-8")
            print(f"updated {_display(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
