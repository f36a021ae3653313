"""`mbridge-epoverlap validate`: check a recipe plus overrides for a target GPU and software versions.

Exit codes: 0 no errors (warnings allowed), 1 errors found, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, UsageError

EPILOG = """\
exit status: 0 valid (warnings allowed), 1 errors found, 2 usage error (bad flag, override or recipe).

recipe files: -mr FILE.py[:FUNCTION] loads FUNCTION (default: the file's function named `recipe`, or
its only public function) and calls it as FUNCTION(task), task being "pretrain" or "sft"; it returns
a mbridge_epoverlap.config.RunConfig, e.g. by copying a built-in recipe:

  from mbridge_epoverlap.recipes import qwen3_30b_a3b

  def recipe(task="pretrain"):
      cfg = qwen3_30b_a3b(task)
      cfg.model.expert_model_parallel_size = 4
      return cfg

examples:
  mbridge-epoverlap validate -mr qwen3_30b_a3b -g h100 --te-version 2.9 comm_overlap.delay_wgrad_compute=true
  mbridge-epoverlap validate -mr my_recipes.py:big_moe -g b200 --json
  mbridge-epoverlap validate --list-rules
"""

RECIPE_HELP = "recipe name or FILE.py[:FUNCTION] (see \"recipe files\" below; default: qwen3_30b_a3b)"


def register(subparsers: Any) -> None:
    from mbridge_epoverlap.gpus import GPUS

    parser = subparsers.add_parser(
        "validate",
        help="check EP-overlap settings of a recipe, reporting every problem with a fix",
        description="Validate a recipe's EP-overlap and delayed-wgrad settings for a target GPU and "
        "Megatron-Core / Transformer Engine versions. Every violation is reported at once, each with a fix.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--recipe", "-mr", default=None, help=RECIPE_HELP)
    parser.add_argument("--task", choices=("pretrain", "sft"), default="pretrain", help="default: pretrain")
    parser.add_argument("--gpu", "-g", default=None, type=str.lower, choices=GPUS, metavar="GPU",
                        help=f"target GPU family ({', '.join(GPUS)}; H100-style names work too); "
                        "default: this machine")
    parser.add_argument("--te-version", "--te_version", default=None,
                        help="Transformer Engine version of the job (default: installed)")
    parser.add_argument("--torch-version", "--torch_version", default=None,
                        help="PyTorch version of the job (default: installed)")
    parser.add_argument("--mcore-version", "--mcore_version", default=None,
                        help="Megatron-Core version whose rules apply, 0.15 ... 0.20 (0.20: Megatron-LM main; "
                        "default: 0.20 with --bridge-version main, else installed, else newest)")
    parser.add_argument("--bridge-version", "--bridge_version", default=None,
                        help="Megatron-Bridge release whose behaviour applies: 0.6 (0.6.x) or main (default: "
                        "installed, else the newest release)")
    parser.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    parser.add_argument("--list-rules", action="store_true",
                        help="list every rule id and exit (with --bridge-version/--mcore-version: the rules of those "
                        "releases, the other one newest)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. comm_overlap.overlap_moe_expert_parallel_comm=true")
    parser.set_defaults(handler=run_validate)


def resolve_environment(gpu: str | None, te_version: str | None, torch_version: str | None,
                        mcore_version: str | None, bridge_version: str | None = None):
    """The environment to check for: a catalog GPU (versions as given) or this machine (versions replaced).

    Megatron-Bridge main is checked with Megatron-Core main (0.20) unless `mcore_version` says otherwise: main is
    built against it, whatever Megatron-Core is installed here.
    """
    from mbridge_epoverlap.config.environment import Environment, parse_bridge_version, parse_version
    from mbridge_epoverlap.config.versions import CORE_OF_BRIDGE_MAIN, check_known_releases

    check_known_releases(mcore_version, bridge_version)
    versions = {
        "te_version": parse_version(te_version, "--te-version"),
        "torch_version": parse_version(torch_version, "--torch-version"),
        "mcore_version": parse_version(mcore_version, "--mcore-version"),
        "bridge_version": parse_bridge_version(bridge_version, "--bridge-version"),
    }
    if versions["bridge_version"] == "main" and versions["mcore_version"] is None:
        versions["mcore_version"] = CORE_OF_BRIDGE_MAIN
    installed = installed_versions()
    if gpu is None and _may_have_cuda_gpu():
        return Environment.detect().with_versions(**versions)  # probes the GPU through torch (seconds)
    if gpu is None or gpu.lower() == "cpu":
        return Environment(**installed).with_versions(**versions)
    # A cluster job: unknown versions default to what is installed here, the usual case of one container.
    return Environment.for_gpu(gpu, **{k: versions[k] or installed[k] for k in versions})


def installed_versions() -> dict[str, str | None]:
    """Versions of torch, Transformer Engine and Megatron-Core installed here, from package metadata.

    Reading metadata instead of importing torch keeps a pre-submit check well under a second.
    """
    from importlib import metadata

    from mbridge_epoverlap.config.versions import installed_bridge_release

    def version_of(*dists: str) -> str | None:
        for dist in dists:
            try:
                return metadata.version(dist).split("+")[0]
            except metadata.PackageNotFoundError:
                continue
        return None

    return {"torch_version": version_of("torch"),
            "te_version": version_of("transformer-engine", "transformer_engine"),
            "mcore_version": version_of("megatron-core", "megatron_core"),
            "bridge_version": installed_bridge_release()}


def _may_have_cuda_gpu() -> bool:
    """False when this machine certainly has no NVIDIA GPU (no driver), so torch need not be imported."""
    import glob
    import os

    return os.path.exists("/proc/driver/nvidia") or bool(glob.glob("/dev/nvidia[0-9]*"))


def run_validate(args: argparse.Namespace) -> int:
    from mbridge_epoverlap.config.overrides import apply_overrides
    from mbridge_epoverlap.config.release_fields import check_release_fields
    from mbridge_epoverlap.config.rules import all_rules
    from mbridge_epoverlap.config.versions import bridge_rules, core_rules
    from mbridge_epoverlap.config.violations import errors_of
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE
    from mbridge_epoverlap.recipes.bridge_models import BY_NAME, facts_core_version
    from mbridge_epoverlap.recipes.loader import load_recipe

    if args.list_rules:
        return _list_rules(_rules_of_releases(all_rules(), args.mcore_version, args.bridge_version), args.json)
    if args.overrides and any("=" not in item for item in args.overrides) and args.recipe is None:
        bare = next(item for item in args.overrides if "=" not in item)
        if bare.endswith(".py") or ".py:" in bare:
            raise UsageError(f"{bare!r} looks like a recipe file; pass it as -mr {bare}")
    mcore_version = args.mcore_version
    if mcore_version is None and args.bridge_version is None and args.recipe in BY_NAME:
        # Megatron-Bridge's recipe sets fields of the Megatron-Core it was built with: check it for that release.
        mcore_version = facts_core_version()
        print(f"note: {args.recipe} is Megatron-Bridge 0.6.2's recipe; checked for its Megatron-Core {mcore_version} "
              "(--mcore-version picks another)", file=sys.stderr)
    env = resolve_environment(args.gpu, args.te_version, args.torch_version, mcore_version, args.bridge_version)
    cfg = load_recipe(args.recipe or DEFAULT_RECIPE, args.task)
    apply_overrides(cfg, args.overrides)
    check_release_fields(cfg, bridge_rules(env.bridge_version), core_rules(env.mcore_version))
    violations = cfg.validate(env)
    errors = errors_of(violations)
    overlap, delay = cfg.effective_switches(env)
    report = {
        "valid": not errors,
        "recipe": cfg.recipe,
        "task": cfg.task,
        "environment": env.to_dict(),
        "overlap_moe_expert_parallel_comm": overlap,
        "delay_wgrad_compute": delay,
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


def _rules_of_releases(rules: list, mcore_version: str | None, bridge_version: str | None) -> list:
    """Every rule, or with a release given the rules that exist in it (the other release: the newest, main's
    Megatron-Core for Megatron-Bridge main)."""
    from mbridge_epoverlap.config.environment import parse_bridge_version, parse_version
    from mbridge_epoverlap.config.versions import CORE_OF_BRIDGE_MAIN, bridge_rules, check_known_releases, core_rules

    if mcore_version is None and bridge_version is None:
        return rules
    check_known_releases(mcore_version, bridge_version)
    bridge = bridge_rules(parse_bridge_version(bridge_version, "--bridge-version"))
    core_version = parse_version(mcore_version, "--mcore-version") or (CORE_OF_BRIDGE_MAIN if bridge.is_main else None)
    core = core_rules(core_version)
    return [r for r in rules if r.exists_in(bridge, core)]


def _list_rules(rules: list, as_json: bool) -> int:
    rows = [(r.id, r.when, r.source, r.summary, r.versions) for r in rules]
    if as_json:
        keys = ("rule", "when", "source", "summary", "versions")
        print(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=2))
        return EXIT_OK
    width = max(len(row[0]) for row in rows)
    for rule_id, when, source, summary, versions in rows:
        sys.stdout.write(f"{rule_id:<{width}}  {when:<11}  {source:<40}  {summary} [{versions}]\n")
    return EXIT_OK
