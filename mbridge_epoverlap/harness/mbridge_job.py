"""GPU job entry point: train one case with Megatron-Bridge from a resolved config.

Started once per GPU (`python -m mbridge_epoverlap.harness.mbridge_job --config CASE.yaml ...`) with
RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment. It builds Megatron-Bridge's own
recipe for the model, writes every setting of the resolved config that Megatron-Bridge has onto it
(model provider, comm_overlap, train, ddp), logs every iteration, and calls Megatron-Bridge's
`pretrain`/`finetune`. The training log is what the harness reads back (`mbridge_logs`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.errors import EXIT_NO_BRIDGE

# Megatron-Bridge recipe function names tried per task, in order ({name} is our recipe name).
RECIPE_FUNCTIONS = {
    "pretrain": ("{name}_pretrain_config",),
    "sft": ("{name}_sft_config", "{name}_finetune_config"),
}
TRAIN_FIELDS = ("global_batch_size", "micro_batch_size")


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


def bridge_recipe(family: str | None, name: str, task: str) -> Any:
    """Megatron-Bridge's ConfigContainer for our recipe name, found in `megatron.bridge.recipes.<family>`."""
    modules = [f"megatron.bridge.recipes.{family}"] if family else []
    modules.append("megatron.bridge.recipes")
    tried = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            tried.append(f"{module_name} (not importable)")
            continue
        for pattern in RECIPE_FUNCTIONS[task]:
            function = getattr(module, pattern.format(name=name), None)
            if callable(function):
                return function()
            tried.append(f"{module_name}.{pattern.format(name=name)}")
    raise LookupError(f"no Megatron-Bridge recipe for {name!r} ({task}); tried {', '.join(tried)}")


def apply_run_config(bridge_cfg: Any, run: RunConfig, *, max_steps: int, mixed_precision: str | None,
                     tokenizer_type: str | None) -> list[str]:
    """Write the resolved settings onto a Megatron-Bridge ConfigContainer; return the keys it has no place for.

    Attribute names are shared with Megatron-Core/Megatron-Bridge, so each setting is copied by name.
    `comm_overlap` fields left None keep Megatron-Bridge's defaults, as they mean "unset".
    """
    missing: list[str] = []
    model = bridge_cfg.model
    for name, value in run.model.to_dict().items():
        if (name, value) in (("cuda_graph_scope", []), ("moe_flex_dispatcher_backend", None)):
            continue  # "no scope" / "no flex backend": Megatron-Bridge's own defaults say the same
        if hasattr(model, name):
            setattr(model, name, value)
        else:
            missing.append(f"model.{name}")
    for name, value in run.comm_overlap.to_dict().items():
        if value is None:
            continue
        if hasattr(bridge_cfg.comm_overlap, name):
            setattr(bridge_cfg.comm_overlap, name, value)
        else:
            missing.append(f"comm_overlap.{name}")
    for name in TRAIN_FIELDS:
        setattr(bridge_cfg.train, name, getattr(run.train, name))
    bridge_cfg.train.train_iters = max_steps
    for name, value in vars(run.ddp).items():
        if hasattr(bridge_cfg.ddp, name):
            setattr(bridge_cfg.ddp, name, value)
    dataset = getattr(bridge_cfg, "dataset", None)
    if dataset is not None and hasattr(dataset, "sequence_length"):
        dataset.sequence_length = run.model.seq_length
    if mixed_precision is not None:
        bridge_cfg.mixed_precision = mixed_precision
    if tokenizer_type is not None and getattr(bridge_cfg, "tokenizer", None) is not None:
        bridge_cfg.tokenizer.tokenizer_type = tokenizer_type
        if tokenizer_type == "NullTokenizer" and hasattr(bridge_cfg.tokenizer, "vocab_size"):
            bridge_cfg.tokenizer.vocab_size = run.model.vocab_size
    logger = getattr(bridge_cfg, "logger", None)
    if logger is not None and hasattr(logger, "log_interval"):
        logger.log_interval = 1  # one log line per iteration: the harness needs per-iteration step times
    return missing


def _enable_profiling(bridge_cfg: Any, start: int, end: int) -> None:
    profiling = getattr(bridge_cfg, "profiling", None)
    if profiling is None:
        print("warning: this Megatron-Bridge has no profiling config; the run is not profiled", file=sys.stderr)
        return
    for name, value in (("use_nsys_profiler", True), ("profile_step_start", start), ("profile_step_end", end),
                        ("profile_ranks", [0])):
        if hasattr(profiling, name):
            setattr(profiling, name, value)


def main(argv: Sequence[str] | None = None) -> int:
    import yaml

    from mbridge_epoverlap.config.recipes import family_of

    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.harness.mbridge_job", description=__doc__)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--max-steps", required=True, type=int)
    parser.add_argument("--mixed-precision", default=None)
    parser.add_argument("--tokenizer-type", default=None)
    parser.add_argument("--profile-window", default=None, help="START:END iterations to profile with nsys")
    args = parser.parse_args(argv)
    try:
        import_bridge()
    except BridgeMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_BRIDGE
    run = RunConfig.from_dict(yaml.safe_load(args.config.read_text()))
    try:
        bridge_cfg = bridge_recipe(family_of(run.recipe), run.recipe, run.task)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    missing = apply_run_config(bridge_cfg, run, max_steps=args.max_steps, mixed_precision=args.mixed_precision,
                               tokenizer_type=args.tokenizer_type)
    if missing:
        print(f"note: this Megatron-Bridge has no setting for {', '.join(missing)}; kept its defaults",
              file=sys.stderr)
    if run.model.moe_token_dispatcher_type == "flex":
        # Megatron-Bridge's apply step also configures the flex backend's buffers, so call it rather
        # than leaving only the two fields set (setting the backend alone does not enable flex).
        flex = importlib.import_module("megatron.bridge.training.flex_dispatcher_backend")
        flex.apply_flex_dispatcher_backend(bridge_cfg.model, run.model.moe_flex_dispatcher_backend)
    if args.profile_window:
        start, _, end = args.profile_window.partition(":")
        _enable_profiling(bridge_cfg, int(start), int(end))
    step = importlib.import_module("megatron.bridge.training.gpt_step")
    if run.task == "sft":
        train = importlib.import_module("megatron.bridge.training.finetune").finetune
    else:
        train = importlib.import_module("megatron.bridge.training.pretrain").pretrain
    train(config=bridge_cfg, forward_step_func=step.forward_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
