"""The perf harness command: resolve, validate, launch, report.

Order: recipe -> dotted overrides -> flags -> (-g cpu) shrink -> validation of every case for the
target (any error stops before anything is launched) -> launch environment -> executor -> report.
Exit status: 0 done, 1 invalid configuration or failed run, 2 usage error.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, RunFailedError, UsageError
from mbridge_epoverlap.harness.flags import build_parser, given

if TYPE_CHECKING:  # imported lazily at run time so `--help` and errors stay fast
    from mbridge_epoverlap.harness.cases import Case
    from mbridge_epoverlap.harness.experiment import Experiment
    from mbridge_epoverlap.harness.resolve import Resolved
    from mbridge_epoverlap.harness.stats import Window


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None, prog: str = "run_script.py") -> int:
    """Run the harness; return the exit status (errors are printed, never raised)."""
    args = build_parser(prog).parse_intermixed_args(argv)  # --help and flag errors exit here, before imports
    from mbridge_epoverlap.cli_io import reader_may_leave
    from mbridge_epoverlap.harness.cases import ValidationFailed

    try:
        with reader_may_leave():  # `run_script.py ... | head` keeps the run's own exit status
            if args.from_logs:
                return report_logs(args)
            return run(args)
    except ValidationFailed as exc:
        _err(f"error: {exc.report()}")
        return EXIT_FAILED
    except UsageError as exc:
        _err(f"error: {exc}")
        return EXIT_USAGE
    except RunFailedError as exc:
        _err(f"error: {exc}")
        return EXIT_FAILED
    except OSError as exc:  # results, configs or job files that cannot be written
        where = f" {exc.filename}" if exc.filename else ""
        _err(f"error: cannot write{where}: {exc.strerror or exc}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        _err("interrupted; nothing was written to the results path")
        return 130


def _check_combinations(args: argparse.Namespace, executor: str) -> None:
    is_cpu = args.gpu == "cpu"
    if executor == "local" and not is_cpu and not args.dryrun:
        raise UsageError(f"the local executor runs the CPU reference runtime; -g {args.gpu} runs on a cluster: "
                         "use --executor slurm (or -g cpu)")
    if args.detach and executor != "slurm":
        raise UsageError("--detach needs --executor slurm")
    if args.emulate_link_gbps is not None and executor != "local":
        raise UsageError("--emulate_link_gbps shapes links between local ranks; use it with --executor local")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def default_results_path(recipe: str, task: str, gpu: str, num_gpus: int, ab: str | None) -> Path:
    return Path("results") / f"{_slug(recipe)}_{task}_{gpu}_ng{num_gpus}_{_slug(ab or 'single')}.json"


def run(args: argparse.Namespace) -> int:
    from mbridge_epoverlap.harness.cases import build_cases, case_specs, same_except_switches
    from mbridge_epoverlap.harness.resolve import resolve
    from mbridge_epoverlap.harness.stats import clip_window, parse_window

    if args.task == "serve_bench":
        from mbridge_epoverlap.harness.executors.slurm_serve import run_serve_bench

        return run_serve_bench(args)
    if args.task == "serve":
        from mbridge_epoverlap.harness.executors.slurm_serve import run_serve

        return run_serve(args)
    if getattr(args, "list_config_variants", False):
        return list_config_variants(args)
    args.gpu = args.gpu or "cpu"
    executor = args.executor or ("local" if args.gpu == "cpu" else "slurm")
    _check_combinations(args, executor)
    window = parse_window(args.stable_window)
    resolved = resolve(args)
    for note in resolved.notes:
        _err(f"note: {note}")
    precision_warning = resolved.cpu_precision.warning if resolved.cpu_precision else None
    cfg = resolved.cfg
    if executor == "slurm":
        from mbridge_epoverlap.harness.executors.slurm import job_shape

        job_shape(cfg.num_gpus, cfg.gpus_per_node, gpus=args.gpu != "cpu")  # a layout Slurm cannot place
    cases, warnings = build_cases(resolved, case_specs(args.ab, cfg, resolved.explicit))
    if precision_warning:
        warnings.append(precision_warning)
    stray = same_except_switches(cases)
    if stray:
        warnings.append(f"cases also differ in {', '.join(stray)}; the comparison is not matched")
    window, clip_warning = clip_window(window, resolved.max_steps)
    for warning in warnings:
        _err(f"warning: {warning}")
    # Recorded with the results (the report's notes): what the CPU model runs in place of the recipe's other layers.
    warnings += [f"stand-in: {line}" for line in resolved.stand_ins]
    if clip_warning:
        # Printed once: now for a dry run, else as a note under the results table, where it qualifies the figures.
        if args.dryrun:
            _err(f"warning: {clip_warning}")
        warnings.append(clip_warning)
    if executor == "local":
        crowded = oversubscription(cfg.num_gpus)
        if crowded:
            _err(f"warning: {crowded}")
    results_path = Path(args.results_json or default_results_path(
        cfg.recipe, cfg.task, args.gpu, cfg.num_gpus, args.ab)).resolve()
    if args.save_config_filepath:
        config_dir = Path(args.save_config_filepath).parent
        if not config_dir.exists():
            _err(f"note: creating folder {config_dir} for --save_config_filepath")
        for path in save_configs(Path(args.save_config_filepath), cases):
            _err(f"resolved config written to {path}")
    exp = _experiment(args, resolved, cases, window, results_path, executor, warnings)
    if executor == "local":
        return _run_local(args, exp, cases, results_path)
    return _run_slurm(args, resolved, exp, cases, results_path)


def list_config_variants(args: argparse.Namespace) -> int:
    """`--list_config_variants`: the performance configs Megatron-Bridge has for the workload, narrowed by the task,
    -g and -c given, one line each with the flags that pick it. Upstream's prompt for a choice is left out: the
    list ends the command, so a script can read it."""
    from mbridge_epoverlap.harness.bridge_recipes import FLAG_PRECISION, available_configs, configs_of, precision_name
    from mbridge_epoverlap.harness.recipe_facts import facts_label, recipe_names_for
    from mbridge_epoverlap.harness.resolve import pick_recipe
    from mbridge_epoverlap.recipes.bridge_models import recipe_parts
    from mbridge_epoverlap.recipes.loader import family_of

    name = pick_recipe(args.model_family_name, args.model_recipe_name)
    release = getattr(args, "bridge_version", None)
    names = recipe_names_for(release)
    configs = configs_of(names, name)
    if not configs:
        workloads = sorted({parts["model"] for n in names if (parts := recipe_parts(n))})
        raise UsageError(f"Megatron-Bridge has no performance recipe for {name!r}; workloads with recipes: "
                         f"-mr {', '.join(workloads)}")
    wanted = {"task": args.task if given(args, "task") else None, "gpu": args.gpu,
              "precision": precision_name(args.compute_dtype) if given(args, "compute_dtype") else None}
    rows = [c for c in configs if all(value is None or c[key] == value for key, value in wanted.items())]
    if not rows:
        raise UsageError(available_configs(names, name, wanted["task"] or args.task, args.gpu or "",
                                           wanted["precision"] or "bf16"))
    print(f"# {facts_label(release)}: {len(rows)} performance config(s) of {name} "
          f"(megatron.bridge.perf_recipes.{family_of(name)})")
    for c in sorted(rows, key=lambda c: (c["task"], c["gpu"], c["precision"], c["variant"], int(c["count"]))):
        variant = "" if c["variant"] == "default" else f" -cv {c['variant']}"
        precision = FLAG_PRECISION.get(c["precision"], c["precision"])
        print(f"--task {c['task']} -g {c['gpu']} -ng {c['count']} -c {precision}{variant}")
    return EXIT_OK


def _experiment(args: argparse.Namespace, resolved: Resolved, cases: list[Case], window: Window,
                results_path: Path, executor: str, warnings: list[str]) -> Experiment:
    from mbridge_epoverlap.config.flops import model_flops_per_iteration
    from mbridge_epoverlap.harness.experiment import CaseRecord, Experiment
    from mbridge_epoverlap.machine import machine

    cfg = resolved.cfg
    environment: dict[str, Any] = {"target": args.gpu, **resolved.target.env.to_dict()}
    if executor == "local":
        environment["machine"] = machine()
    if resolved.cpu_precision is not None:
        environment["compute_dtype"] = resolved.cpu_precision.to_dict()
    records = [CaseRecord(case.name, list(case.overrides), dict(case.launch_env),
                          model_flops_per_iteration=model_flops_per_iteration(case.cfg)) for case in cases]
    return Experiment(
        recipe=cfg.recipe, task=cfg.task, gpu=args.gpu, num_gpus=cfg.num_gpus, gpus_per_node=cfg.gpus_per_node,
        environment=environment, cases=records, repeats=args.repeats, max_steps=resolved.max_steps, window=window,
        results_json=str(results_path), ab=args.ab, executor=executor,
        profile=args.profile or args.enable_nsys or args.pytorch_profiler, warnings=list(warnings))


def save_configs(path: Path, cases: list[Case]) -> list[Path]:
    """The resolved YAML of each case: `path` for the first, `path.<case>.yaml` style siblings for the rest."""
    from mbridge_epoverlap.harness.results import atomic_write

    written = []
    for index, case in enumerate(cases):
        target = path if index == 0 else path.with_name(f"{path.stem}.{case.name}{path.suffix or '.yaml'}")
        text = case.cfg.to_yaml()
        atomic_write(target, lambda tmp, text=text: tmp.write_text(text))
        written.append(target)
    return written


def _progress(line: str) -> None:
    _err(line)


def _run_local(args: argparse.Namespace, exp: Experiment, cases: list[Case], results_path: Path) -> int:
    from mbridge_epoverlap.harness.executors.local import LocalExecutor
    from mbridge_epoverlap.harness.results import write_outputs

    if args.dryrun:
        _err(f"dry run: {len(cases)} case(s) resolved and validated for -g {args.gpu}; nothing launched")
        if not args.save_config_filepath:
            for case in cases:
                print(f"# case {case.name}" + (f" ({', '.join(case.overrides)})" if case.overrides else ""))
                print(case.cfg.to_yaml())
        return EXIT_OK
    executor = LocalExecutor(timeout_s=float(args.time_limit.seconds), emulate_link_gbps=args.emulate_link_gbps,
                             trace_root=results_path.with_suffix(".traces"), progress=_progress)
    results = executor.run(exp, cases)
    paths = write_outputs(results, results_path)
    status = _finish(results, paths)
    _print_traces(results)
    return status


def _print_traces(results: dict[str, Any]) -> None:
    """Where each case's profiled traces are, and the command that reads them."""
    traces = [(case["name"], case.get("trace_dir")) for case in results["cases"] if case.get("trace_dir")]
    if not traces:
        return
    width = max(len(name) for name, _ in traces)
    print("traces (one file per rank; `mbridge-epoverlap profile FOLDER`):")
    for name, folder in traces:
        print(f"  {name:<{width}}  {_shown(folder)}")
    if len(traces) >= 2:
        print(f"compare: mbridge-epoverlap profile {_shown(traces[0][1])} {_shown(traces[1][1])} --compare")


def _shown(path: str) -> str:
    """A path relative to the working directory when it lies below it (shorter to paste)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def oversubscription(processes: int) -> str | None:
    """A warning when -g cpu starts more rank processes than this machine has cores."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if processes <= cores:
        return None
    return (f"-ng {processes} starts {processes} CPU processes on {cores} core(s): ranks will share cores, so step "
            f"times measure contention more than overlap; use -ng {max(cores - cores % 2, 1)} or fewer for figures "
            "that mean something")


def _check_with_bridge(args: argparse.Namespace, resolved: Resolved, cases: list[Case]) -> int:
    """--check_with_bridge: each case's job built and validated by the real Megatron-Bridge before submission."""
    from mbridge_epoverlap.harness.bridge_check import disagreements, run_check
    from mbridge_epoverlap.harness.job_options import bridge_lookup
    from mbridge_epoverlap.recipes.loader import family_of

    cfg = resolved.cfg
    choose = {"family": family_of(cfg.recipe), "name": cfg.recipe, "task": cfg.task, **bridge_lookup(args, cfg)}
    try:
        recipe, outcomes = run_check(choose, cases, gpu=args.gpu, num_gpus=cfg.num_gpus,
                                     max_steps=resolved.max_steps, te_version=resolved.target.env.te_version,
                                     project_recipe=cfg, release=resolved.target.env.bridge_version)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    problems = disagreements(cases, outcomes)
    from mbridge_epoverlap.harness.recipe_facts import release_of

    _err(f"checked with Megatron-Bridge {release_of(resolved.target.env.bridge_version)} ({recipe}, "
         f"runtime_config_update on a CPU, {args.gpu} mocked):")
    for outcome in outcomes:
        if outcome.ok:
            backend = f"/{outcome.backend}" if outcome.backend else ""
            _err(f"  case {outcome.case}: accepted; EP overlap {'on' if outcome.overlap else 'off'}, delayed wgrad "
                 f"{'on' if outcome.delay_wgrad else 'off'}, dispatcher {outcome.dispatcher}{backend}")
    for line in problems:
        _err(f"  error: {line}")
    if problems:
        _err("Megatron-Bridge and this harness disagree; nothing was submitted")
        return EXIT_FAILED
    return EXIT_OK


def _run_slurm(args: argparse.Namespace, resolved: Resolved, exp: Experiment, cases: list[Case],
               results_path: Path) -> int:
    from mbridge_epoverlap.harness.executors.slurm import SlurmExecutor, job_shape, require_tool
    from mbridge_epoverlap.harness.executors.slurm_script import ScriptOptions
    from mbridge_epoverlap.harness.job_options import slurm_options
    from mbridge_epoverlap.harness.results import sibling

    cfg = resolved.cfg
    if getattr(args, "check_with_bridge", False) and args.gpu != "cpu":
        status = _check_with_bridge(args, resolved, cases)
        if status != EXIT_OK:
            return status
    if not args.dryrun:
        require_tool("sbatch")  # before writing anything
    repo_root = Path(__file__).resolve().parents[2]
    options = ScriptOptions(
        job_dir=results_path.with_suffix(".slurm"), repo_root=repo_root,
        python=sys.executable if args.gpu == "cpu" else "python3", time_limit=args.time_limit,
        account=args.account, partition=args.partition, mixed_precision=resolved.mixed_precision,
        tokenizer_type=resolved.tokenizer_type, **slurm_options(args, cfg))
    shape = job_shape(cfg.num_gpus, cfg.gpus_per_node, gpus=args.gpu != "cpu")
    executor = SlurmExecutor(options, shape, detach=args.detach, poll_s=2.0 if args.gpu == "cpu" else 10.0,
                             progress=_progress)
    files = executor.prepare(exp, cases)
    if args.dryrun:
        print(files.script_text, end="")
        _err(f"dry run: sbatch script written to {files.script} (not submitted); submit it with "
             f"`sbatch {files.script}`")
        return EXIT_OK
    results = executor.run(exp, files)
    if results is None:
        print(f"submitted; results will appear at {results_path} (table {sibling(results_path, '.md')}, chart "
              f"{sibling(results_path, '.png')}) when the job ends; job files in {files.job_dir}")
        return EXIT_OK
    return _finish(results, {"json": results_path, "markdown": sibling(results_path, ".md"),
                             "chart": sibling(results_path, ".png")})


def _finish(results: dict[str, Any], paths: dict[str, Path]) -> int:
    """Print the table and where the outputs are; return the exit status the results call for."""
    from mbridge_epoverlap.harness.report import markdown_report

    problems = result_problems(results)
    print(markdown_report(results))
    print(f"results: {paths['json']}\ntable:   {paths['markdown']}\nchart:   {paths['chart']}")
    for severity, line in problems:
        _err(f"{severity}: {line}")
    return EXIT_FAILED if any(severity == "error" for severity, _ in problems) else EXIT_OK


def result_problems(results: dict[str, Any]) -> list[tuple[str, str]]:
    """("error" | "warning", text) for each case whose losses say the run went wrong.

    On the reference runtime (`-g cpu`) overlap settings never change the arithmetic, so a loss that
    differs from the baseline's in any bit is an error. On GPUs the schedules may order reductions
    differently, so there it is a warning. A non-finite loss is an error everywhere; skipped
    iterations (fp16 loss scaling backing off) are a warning.
    """
    problems: list[tuple[str, str]] = []
    cases = results["cases"]
    exact = results.get("gpu") == "cpu"
    for case in cases[1:]:
        if case.get("loss_match_baseline") is False:
            problems.append(("error" if exact else "warning",
                             f"{case['name']}: losses differ from {cases[0]['name']} from iteration "
                             f"{case['loss_mismatch_iters'][0]} (overlap must not change the loss"
                             f"{'; the reference runtime is bitwise exact, so this is a bug' if exact else ''})"))
    for case in cases:
        if not case.get("finite_loss") or case.get("nan_iters"):
            problems.append(("error", f"{case['name']}: non-finite loss ({case.get('nan_iters') or 0} NaN "
                                      "iterations); the step times of a diverged run mean nothing"))
        elif case.get("skipped_iters"):
            problems.append(("warning", f"{case['name']}: {case['skipped_iters']} skipped iterations"))
    return problems


def _check_log_cases(items: list[tuple[str, str]]) -> None:
    """Several logs of one case are its repeats, which is said; logs of one case only compare nothing."""
    seen: dict[str, list[str]] = {}
    for name, path in items:
        seen.setdefault(name, []).append(path)
    if len(seen) == 1 and len(items) > 1:
        name = next(iter(seen))
        raise UsageError(f"--from_logs gives only case {name!r} ({len(items)} logs), so there is nothing to compare; "
                         f"name each case, e.g. --from_logs ep_overlap_off={items[0][1]} ep_overlap_on={items[1][1]}")
    for name, paths in seen.items():
        if len(paths) > 1:
            _err(f"note: --from_logs: case {name!r} has {len(paths)} logs ({', '.join(paths)}), read as {len(paths)} "
                 "repeats of one case; give different cases different names")


def report_logs(args: argparse.Namespace) -> int:
    """--from_logs: training logs of finished runs -> the same results JSON, table and chart."""
    from mbridge_epoverlap.config.environment import GPU_CATALOG, Environment
    from mbridge_epoverlap.harness.experiment import CaseRecord, Experiment
    from mbridge_epoverlap.harness.flags import given
    from mbridge_epoverlap.harness.mbridge_logs import LogParseError, parse_log_file
    from mbridge_epoverlap.harness.results import build_results, write_outputs
    from mbridge_epoverlap.harness.stats import clip_window, parse_window
    from mbridge_epoverlap.runtime.metrics import RunMetrics

    if args.ab or args.dryrun:
        raise UsageError("--from_logs reports finished runs; it takes no --ab or --dryrun")
    runs: dict[str, list[RunMetrics]] = {}
    _check_log_cases(args.from_logs)
    for name, path in args.from_logs:
        if not Path(path).is_file():
            raise UsageError(f"--from_logs {name}={path}: no such file")
        try:
            runs.setdefault(name, []).append(parse_log_file(path))
        except LogParseError as exc:
            raise UsageError(f"--from_logs {name}={path}: {exc}") from None
    last = max(max(run.iteration_numbers()) for group in runs.values() for run in group)
    window, warning = clip_window(parse_window(args.stable_window), last)
    warnings = [warning] if warning else []
    for line in warnings:
        _err(f"warning: {line}")
    gpu = args.gpu or "unknown"
    environment: dict[str, Any] = {"target": gpu, "source": "training logs"}
    if gpu in GPU_CATALOG:
        environment.update(Environment.for_gpu(gpu, te_version=args.te_version, torch_version=args.torch_version,
                                               mcore_version=args.mcore_version).to_dict())
    recipe = args.model_recipe_name or "unknown"
    results_path = Path(args.results_json or Path("results") / f"{_slug(recipe)}_from_logs.json").resolve()
    exp = Experiment(
        recipe=recipe, task=args.task, gpu=gpu, num_gpus=args.num_gpus if given(args, "num_gpus") else None,
        gpus_per_node=args.gpus_per_node if given(args, "gpus_per_node") else None, environment=environment,
        cases=[CaseRecord(name) for name in runs], repeats=max(len(group) for group in runs.values()),
        max_steps=last, window=window, results_json=str(results_path), ab="from_logs", executor="logs",
        warnings=warnings)
    results = build_results(exp, runs)
    paths = write_outputs(results, results_path)
    return _finish(results, paths)
