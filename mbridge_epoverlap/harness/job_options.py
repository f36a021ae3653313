"""What a Slurm job gets from the run_script.py flags beyond the run config: the Megatron-Bridge recipe
choice and the pass-through flags (sbatch lines, srun arguments, exports, the job's settings), plus the
comment lines that show, in the script a dry run prints, which recipe is built and where each flag went.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.bridge_recipes import (
    BridgeRecipe,
    choose_perf_recipe,
    library_recipe,
    perf_recipe_function,
)
from mbridge_epoverlap.harness.flags import given
from mbridge_epoverlap.harness.upstream_flags import job_settings, passthrough_routes


def _compute_dtype(args: Any) -> str:
    """The -c value the recipe lookup uses: as given, else bf16 (Megatron-Bridge's default)."""
    return args.compute_dtype if given(args, "compute_dtype") else "bf16"


def bridge_lookup(args: Any, cfg: Any) -> dict[str, Any]:
    """The recipe-lookup arguments the job gets (`mbridge_job.choose_recipe`'s keywords beyond the recipe)."""
    return {"gpu": args.gpu, "compute_dtype": _compute_dtype(args), "num_gpus": cfg.num_gpus,
            "config_variant": args.config_variant, "use_recipes": bool(args.use_recipes)}


def recipe_note(args: Any, recipe: str, task: str, num_gpus: int) -> str:
    """Which Megatron-Bridge recipe the job builds, and of which release (from the installed Megatron-Bridge's names
    when it is the release of --bridge_version, else from that release's facts; a guess of the exact name for a model
    neither has)."""
    from mbridge_epoverlap.harness.recipe_facts import facts_label, recipe_names_for
    from mbridge_epoverlap.recipes.loader import family_of

    family = family_of(recipe)
    if family is None:
        return f"Megatron-Bridge recipe: none known for {recipe!r} (a recipe file); the job stops with an error"
    release = getattr(args, "bridge_version", None)
    label = facts_label(release)
    if args.use_recipes:
        return f"{label} recipe: {library_recipe(family, recipe, task).describe()}"
    names = recipe_names_for(release)
    if any(name.startswith(f"{recipe}_") for name in names):
        try:
            chosen: BridgeRecipe = choose_perf_recipe(names, family=family, model=recipe, task=task, gpu=args.gpu,
                                                      compute_dtype=_compute_dtype(args), num_gpus=num_gpus,
                                                      config_variant=args.config_variant)
        except UsageError as exc:
            return f"{label} recipe: none ({exc}); the job stops with an error"
        return f"{label} recipe: {chosen.describe()}"
    exact = perf_recipe_function(recipe, task, num_gpus, args.gpu, _compute_dtype(args), args.config_variant)
    return (f"Megatron-Bridge recipe: megatron.bridge.perf_recipes.{family}.{exact} (performance recipe; where that "
            "GPU count has none, the default count's recipe is chosen on the node; --use_recipes builds the library "
            "recipe)")


def profile_window(args: Any, max_steps: int) -> str | None:
    """`START:END` of the profiled iterations for -en/-pyp: upstream's --profiling_start_step/--profiling_stop_step,
    clipped to the run; None (the stable window) without those flags or when the range starts after the run."""
    if not (args.enable_nsys or args.pytorch_profiler) or args.profiling_start_step > max_steps:
        return None
    start = max(args.profiling_start_step, 1)
    return f"{start}:{max(start, min(args.profiling_stop_step, max_steps))}"


def slurm_options(args: Any, cfg: Any) -> dict[str, Any]:
    """Keyword arguments of `ScriptOptions` for the pass-through flags, the recipe choice and the profiling range."""
    recipe, task, num_gpus = cfg.recipe, cfg.task, cfg.num_gpus
    routes = passthrough_routes(args)
    sbatch, srun, setup = [], [], []
    if args.gres:
        sbatch.append(f"#SBATCH --gres={shlex.quote(args.gres)}")
    for key, value in (args.additional_slurm_params or {}).items():
        sbatch.append(f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}")
    if args.container_image and given_value(args, "container_image"):
        srun.append(f"--container-image={args.container_image}")
    if args.custom_mounts:
        srun.append(f"--container-mounts={','.join(args.custom_mounts)}")
    srun += list(args.custom_srun_args or [])
    exports = dict(args.custom_env_vars or {})
    exports.update(dict(args.env or []))
    if args.hf_token:
        exports["HF_TOKEN"] = args.hf_token
    if given_value(args, "nemo_home"):
        exports["NEMO_HOME"] = args.nemo_home
    if args.offline:
        exports.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    setup += [f"export {key}={shlex.quote(str(value))}" for key, value in exports.items()]
    setup += [" ".join(command) for command in (args.custom_bash_cmds or []) if command]
    notes = []
    job_args: list[str] = []
    if args.gpu != "cpu":
        notes.append(recipe_note(args, recipe, task, num_gpus))
        job_args += ["--gpu", args.gpu, "--compute-dtype", _compute_dtype(args), "--num-gpus", str(num_gpus)]
        if args.config_variant:
            job_args += ["--config-variant", args.config_variant]
        if args.use_recipes:
            job_args.append("--use-recipes")
        if args.pytorch_profiler:  # the profiled runs record Kineto traces instead of running under nsys
            job_args.append("--pytorch-profiler")
        settings = job_settings(routes)
        if settings:
            job_args += ["--job-settings", json.dumps(settings, sort_keys=True)]
    for route in routes:
        notes.append(f"run_script.py {route.flag}={route.value!r} -> {route.destination}: {route.effect}")
    window = profile_window(args, cfg.train.train_iters)
    nsys_args = _nsys_args(args)
    if args.enable_nsys or args.pytorch_profiler:
        notes.append(f"profiled iterations: {window or 'the stable window'} (-en/-pyp; --profiling_start_step "
                     f"{args.profiling_start_step} --profiling_stop_step {args.profiling_stop_step})")
    return {"job_args": tuple(job_args), "sbatch_lines": tuple(sbatch), "srun_args": tuple(srun),
            "setup_lines": tuple(setup), "notes": tuple(notes), "profile_window": window, "nsys_args": nsys_args}


def _nsys_args(args: Any) -> tuple[str, ...]:
    """The user's nsys options (--nsys_trace, --nsys_extra_args); the report path (-o) is the harness's, which reads
    the reports from there."""
    extra = [option.strip() for option in (getattr(args, "nsys_extra_args", None) or []) if option.strip()]
    if any(option.split("=", 1)[0] in ("-o", "--output") for option in extra):
        raise UsageError("--nsys_extra_args: -o/--output is the harness's (it reads each rank's report from the job "
                         "folder); leave it out")
    trace = [name.strip() for name in (getattr(args, "nsys_trace", None) or []) if name.strip()]
    return tuple(([f"--trace={','.join(trace)}"] if trace else []) + extra)


def given_value(args: Any, dest: str) -> bool:
    """Whether a pass-through flag differs from upstream's default (so an untouched default adds nothing)."""
    from mbridge_epoverlap.harness.upstream_flags import UPSTREAM_FLAGS

    default = next(f.default for f in UPSTREAM_FLAGS if f.dest == dest)
    return getattr(args, dest, default) != default
