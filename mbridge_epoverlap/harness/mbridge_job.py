"""GPU job entry point: train one case with Megatron-Bridge from a resolved config.

Started once per GPU (`python -m mbridge_epoverlap.harness.mbridge_job --config CASE.yaml ...`) with
RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment. It builds the recipe Megatron-Bridge's
own `run_script.py` would (a flat performance recipe for the GPU, precision, GPU count and `-cv` variant; the
library recipe with `--use_recipes`; see `bridge_recipes`), changes on it only what the user's flags and
dotted overrides set and what the A/B case sets (`--changes`, written by the harness from `Case.changes`)
plus the pass-through flags it has a place for and the iteration count, logs every iteration, and calls
Megatron-Bridge's `pretrain`/`finetune`. Every other setting is the recipe's, as with upstream's
run_script.py. The training log is what the harness reads back (`mbridge_logs`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.errors import EXIT_NO_BRIDGE, EXIT_USAGE
from mbridge_epoverlap.harness.bridge_recipes import BridgeRecipe, choose_perf_recipe, library_recipe


class BridgeMissing(RuntimeError):
    """Megatron-Bridge cannot be imported on this node."""


def import_bridge() -> Any:
    try:
        return importlib.import_module("megatron.bridge")
    except ImportError as exc:
        raise BridgeMissing(
            f"Megatron-Bridge is not importable with {sys.executable} ({exc}); GPU jobs train with Megatron-Bridge: "
            "run the job in a NeMo/Megatron-Bridge container or `pip install megatron-bridge` there, and point "
            "MBRIDGE_EPOVERLAP_PYTHON at that Python when submitting") from None


def installed_perf_recipe_names() -> list[str]:
    """Flat performance recipe names of the installed Megatron-Bridge, read from its files (not imported)."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("megatron.bridge.perf_recipes")
    except ImportError:  # megatron.bridge itself is absent
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    pattern = re.compile(r"^def ([A-Za-z0-9_]+_config)\(", re.MULTILINE)
    names: set[str] = set()
    for root in spec.submodule_search_locations:
        for path in Path(root).rglob("*.py"):
            names.update(pattern.findall(path.read_text(encoding="utf-8", errors="replace")))
    return sorted(names)


def choose_recipe(family: str | None, name: str, task: str, *, gpu: str, compute_dtype: str | None,
                  num_gpus: int | None, config_variant: str | None, use_recipes: bool,
                  perf_names: list[str] | None = None) -> BridgeRecipe:
    """The Megatron-Bridge recipe Megatron-Bridge's run_script.py would build for these flags."""
    if family is None:
        raise LookupError(f"recipe {name!r} has no Megatron-Bridge model family; use a built-in recipe name")
    if use_recipes:
        return library_recipe(family, name, task)
    names = installed_perf_recipe_names() if perf_names is None else perf_names
    return choose_perf_recipe(names, family=family, model=name, task=task, gpu=gpu, compute_dtype=compute_dtype,
                              num_gpus=num_gpus, config_variant=config_variant)


def bridge_recipe(recipe: BridgeRecipe) -> Any:
    """Build the chosen recipe's ConfigContainer."""
    try:
        module = importlib.import_module(recipe.module)
    except ImportError as exc:
        raise LookupError(f"{recipe.module} is not importable ({exc})") from None
    function = getattr(module, recipe.function, None)
    if not callable(function):
        raise LookupError(f"no Megatron-Bridge recipe {recipe.module}.{recipe.function}")
    return function()


# Pass-through flags the job writes onto the ConfigContainer: flag -> (section, field).
JOB_SETTINGS = {
    "lr": ("optimizer", "lr"), "min_lr": ("optimizer", "min_lr"), "warmup_iters": ("scheduler", "lr_warmup_iters"),
    "pretrained_checkpoint": ("checkpoint", "pretrained_checkpoint"), "save_dir": ("checkpoint", "save"),
    "load_dir": ("checkpoint", "load"), "save_interval": ("checkpoint", "save_interval"),
    "most_recent_k": ("checkpoint", "most_recent_k"),
    "distributed_timeout_minutes": ("dist", "distributed_timeout_minutes"),
    "hidden_size": ("model", "hidden_size"), "num_layers": ("model", "num_layers"),
    "num_moe_experts": ("model", "num_moe_experts"), "first_k_dense_replace": ("model", "first_k_dense_replace"),
    "pipeline_model_parallel_layout": ("model", "pipeline_model_parallel_layout"),
    "activation_offload_layers": ("model", "cpu_offloading_num_layers"),
    "deterministic": ("model", "deterministic_mode"),
    "tokenizer_model": ("tokenizer", "tokenizer_model"), "vocab_size": ("tokenizer", "vocab_size"),
    "nccl_ub": ("ddp", "nccl_ub"), "use_megatron_fsdp": ("ddp", "use_megatron_fsdp"),
    "wandb_project_name": ("logger", "wandb_project"), "wandb_entity_name": ("logger", "wandb_entity"),
    "wandb_experiment_name": ("logger", "wandb_exp_name"), "wandb_save_dir": ("logger", "wandb_save_dir"),
    "profiling_ranks": ("profiling", "profile_ranks"), "record_memory_history": ("profiling", "record_memory_history"),
}


def apply_job_settings(bridge_cfg: Any, settings: dict[str, Any]) -> list[str]:
    """Write the pass-through flags the ConfigContainer has a place for; return the ones it has none for."""
    unused = []
    for flag, value in settings.items():
        section, field = JOB_SETTINGS.get(flag, (None, None))
        target = getattr(bridge_cfg, section, None) if section else None
        if target is not None and hasattr(target, field):
            setattr(target, field, value)
        else:
            unused.append(f"--{flag}")
    return unused


# Run-config keys that are launch settings, not ConfigContainer fields (the job gets them another way).
LAUNCH_KEYS = ("num_gpus", "gpus_per_node", "train.train_iters")
# Run-config keys written to a second place of the ConfigContainer as well: key -> (section, field).
ALSO_WRITES = {"model.seq_length": ("dataset", "sequence_length"),
               "model.use_te_rng_tracker": ("rng", "te_rng_tracker")}
# Settings the job makes on every recipe: (section, field, value, why).
JOB_FIXED = (("logger", "log_interval", 1, "one log line per iteration: the harness reads per-iteration step times"),)


def _set_graph_scope(model: Any, scope: Any) -> None:
    """Megatron-Bridge's own setter where it has one (Core 0.18+ keeps the modules in cuda_graph_modules)."""
    try:
        from megatron.bridge.utils.cuda_graph import set_cuda_graph_modules
    except ImportError:
        model.cuda_graph_scope = scope
        return
    set_cuda_graph_modules(model, scope)


def _comm_overlap_config() -> Any:
    """Megatron-Bridge's CommOverlapConfig with every setting left to the model and DDP (no TP overlap)."""
    comm_overlap = importlib.import_module("megatron.bridge.training.comm_overlap")
    return comm_overlap.CommOverlapConfig(tp_comm_overlap=False)


def apply_changes(bridge_cfg: Any, changes: dict[str, Any], *, max_steps: int) -> list[str]:
    """Write the user's and the A/B case's settings onto the recipe's ConfigContainer; return the keys it lacks.

    `changes` holds only what the user's flags and dotted overrides set and what the case itself sets
    (`Case.changes`), by run-config dotted key: everything else keeps the recipe's value, as upstream's
    run_script.py keeps it. The flex backend goes through Megatron-Bridge's `apply_flex_dispatcher_backend`
    (it also sets the dispatcher and turns shared-expert overlap off). A `comm_overlap.*` change on a recipe
    without a comm-overlap config creates one with every other setting unset, as the harness models it.
    """
    missing: list[str] = []
    for key, value in changes.items():
        if key in LAUNCH_KEYS or key.startswith("env_vars."):
            continue
        places = [tuple(key.split(".", 1))] + ([ALSO_WRITES[key]] if key in ALSO_WRITES else [])
        if key.startswith("comm_overlap.") and getattr(bridge_cfg, "comm_overlap", False) is None:
            bridge_cfg.comm_overlap = _comm_overlap_config()  # a recipe without one: as the harness's, all unset
        written = False
        for section, name in places:
            target = getattr(bridge_cfg, section, None)
            if target is None or not hasattr(target, name):
                continue
            if key == "model.cuda_graph_scope":
                _set_graph_scope(target, value)
            else:
                setattr(target, name, value)
            written = True
        if not written:
            missing.append(key)
    backend = changes.get("model.moe_flex_dispatcher_backend")
    if backend is not None:
        flex = importlib.import_module("megatron.bridge.training.flex_dispatcher_backend")
        flex.apply_flex_dispatcher_backend(bridge_cfg.model, backend)
    elif "model.moe_flex_dispatcher_backend" in changes and bridge_cfg.model.moe_token_dispatcher_type == "flex":
        bridge_cfg.model.moe_token_dispatcher_type = "alltoall"  # backend None: the user asked for alltoall
    bridge_cfg.train.train_iters = max_steps
    for section, name, value, _why in JOB_FIXED:
        target = getattr(bridge_cfg, section, None)
        if target is not None and hasattr(target, name):
            setattr(target, name, value)
    return missing


def _enable_profiling(bridge_cfg: Any, start: int, end: int, pytorch: bool = False) -> None:
    profiling = getattr(bridge_cfg, "profiling", None)
    if profiling is None:
        print("warning: this Megatron-Bridge has no profiling config; the run is not profiled", file=sys.stderr)
        return
    for name, value in (("use_nsys_profiler", not pytorch), ("use_pytorch_profiler", pytorch),
                        ("profile_step_start", start), ("profile_step_end", end), ("profile_ranks", [0])):
        if hasattr(profiling, name):
            setattr(profiling, name, value)


def _offline_configs_missing(recipe: str) -> str | None:
    """Offline (HF_HUB_OFFLINE), the recipe's Hugging Face `config.json` must be cached already: Megatron-Bridge would
    retry the download and fail after minutes. The words of the error, or None."""
    from mbridge_epoverlap.harness.hf_configs import hub_cache, missing_offline_configs, offline

    if not offline():
        return None
    missing = missing_offline_configs(recipe)
    if not missing:
        return None
    return (f"the recipe loads {', '.join(missing)}, whose config.json is not in the Hugging Face cache {hub_cache()} "
            "and HF_HUB_OFFLINE is set; download it there first (`huggingface-cli download MODEL_ID config.json`), "
            "point HF_HOME at a cache that has it, or unset HF_HUB_OFFLINE on a node with network access")


def main(argv: Sequence[str] | None = None) -> int:
    import yaml

    from mbridge_epoverlap.recipes.loader import family_of

    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.harness.mbridge_job", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--max-steps", required=True, type=int)
    parser.add_argument("--mixed-precision", default=None)
    parser.add_argument("--tokenizer-type", default=None)
    parser.add_argument("--profile-window", default=None, help="START:END iterations to profile with nsys")
    parser.add_argument("--gpu", default=None, help="target GPU as run_script.py -g spells it (recipe lookup)")
    parser.add_argument("--compute-dtype", default=None, help="run_script.py -c (recipe lookup; default bf16)")
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs of the job (recipe lookup)")
    parser.add_argument("--config-variant", default=None, help="run_script.py -cv")
    parser.add_argument("--use-recipes", action="store_true", help="build the library recipe, not the perf recipe")
    parser.add_argument("--pytorch-profiler", action="store_true",
                        help="profile with the PyTorch profiler (Kineto traces) instead of nsys")
    parser.add_argument("--job-settings", default=None,
                        help="JSON object of the pass-through run_script.py flags for the job")
    parser.add_argument("--changes", type=Path, default=None,
                        help="JSON file: run-config dotted key -> value, the settings the job changes on the recipe")
    args = parser.parse_args(argv)
    run = RunConfig.from_dict(yaml.safe_load(args.config.read_text()))
    missing = _offline_configs_missing(run.recipe)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_USAGE
    try:
        import_bridge()
    except BridgeMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_BRIDGE
    import json

    from mbridge_epoverlap.errors import UsageError

    try:
        recipe = choose_recipe(family_of(run.recipe), run.recipe, run.task, gpu=args.gpu or "h100",
                               compute_dtype=args.compute_dtype, num_gpus=args.num_gpus,
                               config_variant=args.config_variant, use_recipes=args.use_recipes)
        print(f"Megatron-Bridge recipe: {recipe.describe()}", file=sys.stderr)
        bridge_cfg = bridge_recipe(recipe)
    except (LookupError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.job_settings is not None:
        unused = apply_job_settings(bridge_cfg, json.loads(args.job_settings))
        if unused:
            print(f"note: passed to the job but this Megatron-Bridge has no setting for {', '.join(unused)}",
                  file=sys.stderr)
    changes = json.loads(args.changes.read_text()) if args.changes is not None else {}
    missing = apply_changes(bridge_cfg, changes, max_steps=args.max_steps)
    if missing:
        print(f"note: this Megatron-Bridge has no setting for {', '.join(missing)}; kept the recipe's",
              file=sys.stderr)
    if args.mixed_precision is not None and recipe.kind == "library":
        bridge_cfg.mixed_precision = args.mixed_precision  # a performance recipe was chosen by -c: its own stays
    if args.tokenizer_type is not None and getattr(bridge_cfg, "tokenizer", None) is not None:
        bridge_cfg.tokenizer.tokenizer_type = args.tokenizer_type
        if args.tokenizer_type == "NullTokenizer" and hasattr(bridge_cfg.tokenizer, "vocab_size") \
                and run.model.vocab_size is not None:
            bridge_cfg.tokenizer.vocab_size = run.model.vocab_size
    if args.profile_window:
        start, _, end = args.profile_window.partition(":")
        _enable_profiling(bridge_cfg, int(start), int(end), pytorch=args.pytorch_profiler)
    step = importlib.import_module("megatron.bridge.training.gpt_step")
    if run.task == "sft":
        train = importlib.import_module("megatron.bridge.training.finetune").finetune
    else:
        train = importlib.import_module("megatron.bridge.training.pretrain").pretrain
    train(config=bridge_cfg, forward_step_func=step.forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
