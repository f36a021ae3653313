"""`mbridge-epoverlap validate`: check a recipe plus overrides for a target GPU and software versions.

Exit codes: 0 no errors (warnings allowed), 1 errors found, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check EP-overlap settings of a recipe, reporting every problem with a fix",
        description="Validate a recipe's EP-overlap and delayed-wgrad settings for a target GPU and "
        "Megatron-Core / Transformer Engine versions. Every violation is reported at once.",
    )
    parser.add_argument("--recipe", "-mr", default=None,
                        help="recipe name or FILE.py[:FUNCTION] (default: qwen3_30b_a3b)")
    parser.add_argument("--task", choices=("pretrain", "sft"), default="pretrain")
    from mbridge_epoverlap.gpus import GPU_FACTS

    parser.add_argument("--gpu", "-g", default=None,
                        help=f"target GPU ({', '.join(GPU_FACTS)}, or cpu; H100-style names work too); "
                        "default: this machine")
    parser.add_argument("--te-version", "--te_version", default=None,
                        help="Transformer Engine version of the job (default: installed)")
    parser.add_argument("--torch-version", "--torch_version", default=None,
                        help="PyTorch version of the job (default: installed)")
    parser.add_argument("--mcore-version", "--mcore_version", default=None,
                        help="Megatron-Core version whose rules apply (default: installed, else newest)")
    parser.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    parser.add_argument("--list-rules", action="store_true", help="list every rule id and exit")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. comm_overlap.overlap_moe_expert_parallel_comm=true")
    parser.set_defaults(handler=run_validate)


def resolve_environment(gpu: str | None, te_version: str | None, torch_version: str | None,
                        mcore_version: str | None):
    """The environment to check for: a catalog GPU (versions as given) or this machine (versions replaced)."""
    from mbridge_epoverlap.config.environment import Environment, parse_version

    versions = {
        "te_version": parse_version(te_version, "--te-version"),
        "torch_version": parse_version(torch_version, "--torch-version"),
        "mcore_version": parse_version(mcore_version, "--mcore-version"),
    }
    detected = Environment.detect()
    if gpu is None or gpu.lower() == "cpu":
        env = detected if gpu is None else Environment(detected.torch_version, detected.te_version,
                                                       detected.mcore_version)
        return env.with_versions(**versions)
    # A cluster job: unknown versions default to what is installed here, the usual case of one container.
    defaults = {"te_version": detected.te_version, "torch_version": detected.torch_version,
                "mcore_version": detected.mcore_version}
    return Environment.for_gpu(gpu, **{k: versions[k] or defaults[k] for k in versions})


def run_validate(args: argparse.Namespace) -> int:
    from mbridge_epoverlap.config.overrides import apply_overrides
    from mbridge_epoverlap.config.recipes import load_recipe
    from mbridge_epoverlap.config.rules import all_rules
    from mbridge_epoverlap.config.violations import errors_of
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE

    if args.list_rules:
        return _list_rules(all_rules(), args.json)
    env = resolve_environment(args.gpu, args.te_version, args.torch_version, args.mcore_version)
    cfg = load_recipe(args.recipe or DEFAULT_RECIPE, args.task)
    apply_overrides(cfg, args.overrides)
    violations = cfg.validate(env)
    errors = errors_of(violations)
    report = {
        "valid": not errors,
        "recipe": cfg.recipe,
        "task": cfg.task,
        "environment": env.to_dict(),
        "overlap_moe_expert_parallel_comm": cfg.comm_overlap.effective_overlap(cfg.model),
        "delay_wgrad_compute": cfg.comm_overlap.effective_delay_wgrad(cfg.model),
        "rules_checked": len(all_rules()),
        "errors": len(errors),
        "warnings": len(violations) - len(errors),
        "violations": [v.to_dict() for v in violations],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report, env.describe())
    return EXIT_OK if not errors else EXIT_FAILED


def _print_table(report: dict[str, Any], env_text: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(soft_wrap=False, width=max(Console().width, 160))
    on_off = {True: "on", False: "off"}
    console.print(f"recipe [bold]{report['recipe']}[/] ({report['task']}): EP overlap "
                  f"{on_off[report['overlap_moe_expert_parallel_comm']]}, delayed wgrad "
                  f"{on_off[report['delay_wgrad_compute']]}")
    console.print(f"checked for: {env_text}; {report['rules_checked']} rules")
    if not report["violations"]:
        console.print("[green]valid[/]: no violations")
        return
    table = Table(show_lines=True)
    for column in ("severity", "rule", "problem", "fix"):
        table.add_column(column, overflow="fold")
    for v in report["violations"]:
        style = "red" if v["severity"] == "error" else "yellow"
        table.add_row(f"[{style}]{v['severity']}[/]", v["rule"], escape(v["message"]), escape(v["fix"]))
    console.print(table)
    verdict = "[red]invalid[/]" if report["errors"] else "[green]valid[/]"
    console.print(f"{verdict}: {report['errors']} error(s), {report['warnings']} warning(s)")


def _list_rules(rules: list, as_json: bool) -> int:
    rows = [(r.id, r.when, r.source, r.summary) for r in rules]
    if as_json:
        keys = ("rule", "when", "source", "summary")
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=2))
        return EXIT_OK
    width = max(len(row[0]) for row in rows)
    for rule_id, when, source, summary in rows:
        sys.stdout.write(f"{rule_id:<{width}}  {when:<11}  {source:<40}  {summary}\n")
    return EXIT_OK
