"""The differential fuzz on each family's own recipes: random EP-overlap overrides of Megatron-Bridge's recipes,
judged by Bridge's config path and by the validator.

`config.bridge_fuzz` draws small GPT configs; a family's recipe carries what those never have: a hybrid Mamba
provider (Nemotron 3), linear attention (Qwen3-Next, Qwen3.5), a vision-language provider (Qwen VL), MLA with
sparse attention (GLM-5), attention biases and sinks (GPT-OSS), hyper-connections (DeepSeek-V4). Here each case
starts from a copy of one of the workload's performance recipes as the installed Megatron-Bridge builds it (from the
offline configs of `hf_configs`), keeps its model, and changes a random subset of the settings the EP-overlap rules
read (the same draws as `config.fuzz.random_config`: dispatcher and backend, precision, PP/VPP, recompute, MTP
layers, shared-expert overlap, CUDA graphs, fusions and biases; an EP size that divides the experts) plus the
comm-overlap switches, GPU and Transformer Engine version. Bridge judges it with `bridge_fuzz.config_path_verdict`
on the recipe's own provider class; the validator judges the same provider object before Bridge touches it.

Run it where Megatron-Bridge is installed (`python -m mbridge_epoverlap.harness.bridge_family_fuzz --samples 40`);
its last line is a JSON tally per family; it exits 1 on any missed or false verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from mbridge_epoverlap.config.bridge_fuzz import (
    GPUS,
    SWITCHES,
    TE_VERSIONS,
    Case,
    Release,
    Tally,
    config_path_verdict,
    installed_release,
    validator_errors,
    validator_switches,
)

# Model dimensions of random_config's draw: the recipe's own are kept.
DIMENSIONS = frozenset({"num_layers", "hidden_size", "num_attention_heads", "num_moe_experts", "moe_ffn_hidden_size",
                        "pipeline_dtype", "attention_dropout", "hidden_dropout", "moe_grouped_gemm",
                        "moe_shared_expert_intermediate_size", "expert_model_parallel_size"})
RECIPES_PER_WORKLOAD = 3


def family_recipes(families: list[str] | None = None, per_workload: int = RECIPES_PER_WORKLOAD
                   ) -> dict[str, list[tuple[str, Any]]]:
    """Family -> [(recipe name, built ConfigContainer)]: up to `per_workload` performance recipes of each workload
    Megatron-Bridge has recipes for (bf16 ones first), built under no GPU mock."""
    import importlib

    from mbridge_epoverlap.harness.hf_configs import (
        HF_MODELS,
        hf_models,
        pinned_revisions,
        write_hf_cache,
    )
    from mbridge_epoverlap.harness.mbridge_job import installed_perf_recipe_names
    from mbridge_epoverlap.recipes.bridge_models import recipe_parts
    from mbridge_epoverlap.recipes.loader import family_of

    home = Path(os.environ["HF_HOME"])
    names = installed_perf_recipe_names()
    built: dict[str, list[tuple[str, Any]]] = {}
    for workload in sorted(HF_MODELS):
        family = family_of(workload)
        if families is not None and family not in families:
            continue
        module = importlib.import_module(f"megatron.bridge.perf_recipes.{family}")
        for model_id, config, code in hf_models(workload):
            write_hf_cache(home, model_id, config, pinned_revisions(model_id), code)
        mine = [(parts["precision"] != "bf16", n) for n in names
                if (parts := recipe_parts(n)) and parts["model"] == workload and hasattr(module, n)]
        for _not_bf16, name in sorted(mine)[:per_workload]:  # bf16 recipes first, then in name order
            try:
                container = getattr(module, name)()
            except Exception as exc:  # noqa: BLE001 - a recipe that cannot build here is reported, not fuzzed
                print(f"not built: {name}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                continue
            built.setdefault(family, []).append((name, container))
    return built


def random_overrides(rng: random.Random, model: Any, release: Release) -> dict[str, Any]:
    """A random subset of the EP-overlap settings, drawn as `config.fuzz.random_config` draws them, for `model`."""
    import torch

    from mbridge_epoverlap.config.fuzz import random_config

    drawn = {key: value for key, value in random_config(rng, release.core_minor, torch.bfloat16).items()
             if key not in DIMENSIONS and hasattr(model, key)}
    keep = {key: value for key, value in drawn.items() if rng.random() < 0.4}
    experts = getattr(model, "num_moe_experts", None) or 0
    if rng.random() < 0.6:
        keep["expert_model_parallel_size"] = rng.choice([ep for ep in (1, 2, 4, 8) if experts and experts % ep == 0]
                                                        or [1])
    if "cuda_graph_impl" in keep or "cuda_graph_scope" in keep or "cuda_graph_modules" in keep:
        for key in ("cuda_graph_impl", "cuda_graph_scope", "cuda_graph_modules"):
            if key in drawn:
                keep[key] = drawn[key]  # a graph setting comes whole (impl and scope together)
        keep["use_te_rng_tracker"] = drawn["cuda_graph_impl"] != "none"
    if "moe_token_dispatcher_type" in keep and keep["moe_token_dispatcher_type"] == "flex":
        keep["moe_flex_dispatcher_backend"] = rng.choice(["deepep", "hybridep", "ncclep", None])
    return keep


def recipe_case(rng: random.Random, container: Any, release: Release) -> tuple[Case, dict[str, Any]]:
    """(the case, the model overrides) of one random change of a recipe."""
    # Half the cases keep the recipe's model as shipped and change only the switches, so both verdicts are common.
    overrides = random_overrides(rng, container.model, release) if rng.random() < 0.5 else {}
    recipe_comm = getattr(container, "comm_overlap", None)
    comm = {}
    for key in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "overlap_grad_reduce"):
        kept = getattr(recipe_comm, key, None) if recipe_comm is not None else None
        comm[key] = kept if rng.random() < 0.4 else rng.choice(SWITCHES)
    ddp_reduce = bool(getattr(getattr(container, "ddp", None), "overlap_grad_reduce", False))
    case = Case(overrides, comm, ddp_reduce if rng.random() < 0.5 else rng.random() < 0.5, rng.choice(GPUS),
                rng.choice(TE_VERSIONS))
    return case, overrides


def _model_copy(container: Any, overrides: dict[str, Any]) -> Any:
    model = copy.deepcopy(container.model)
    for key, value in overrides.items():
        setattr(model, key, value)
    return model


def compare_family(recipes: list[tuple[str, Any]], samples: int, rng: random.Random, release: Release,
                   examples: list[str]) -> Tally:
    """`samples` random changes of a family's recipes, judged by Bridge and the validator."""
    import torch

    torch_version = torch.__version__.split("+")[0]
    tally = Tally(release={"bridge": release.bridge, "core": release.core})
    for index in range(samples):
        name, container = recipes[index % len(recipes)]
        case, overrides = recipe_case(rng, container, release)
        tally.tried += 1
        seen = _model_copy(container, overrides)  # the validator's view, before Bridge's set-up changes it
        rejection, built = config_path_verdict(lambda container=container, overrides=overrides:
                                               _model_copy(container, overrides), case)
        errors = validator_errors(case, seen, torch_version, release)
        where = f"{name} #{index} {overrides} comm={case.comm} gpu={case.gpu} te={case.te_version}"
        if rejection is None:
            tally.accepted += 1
            if errors:
                tally.false += 1
                tally.false_by_rule.update(errors)
                examples.append(f"false: validator {errors}; Bridge accepts {where}")
            ours = validator_switches(case, seen, torch_version, release)
            theirs = (bool(built.overlap_moe_expert_parallel_comm), bool(built.delay_wgrad_compute))
            if ours != theirs:
                tally.switch_mismatch += 1
                examples.append(f"switches: validator {ours}, Bridge {theirs}; {where}")
            continue
        if tally.count_rejection(rejection, errors) == "missed":
            examples.append(f"missed: Bridge says {rejection[:200]!r}; {where}")
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.harness.bridge_family_fuzz",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40, help="cases per family")
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--families", default=None, help="comma-separated families (default: every Bridge family)")
    parser.add_argument("--examples", action="store_true", help="print each disagreement")
    args = parser.parse_args(argv)
    from mbridge_epoverlap.config.bridge_cpu import install_fake_te, set_te_version

    install_fake_te()
    set_te_version("2.12.0")
    os.environ.update(HF_HOME=tempfile.mkdtemp(prefix="mbridge-family-fuzz-"), HF_HUB_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", WORLD_SIZE="1",
                      MEGATRON_CONFIG_LOCK_DIR=tempfile.mkdtemp(prefix="mbridge-lock-"))
    release = installed_release()
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}
    examples: list[str] = []
    bad = 0
    with contextlib.redirect_stdout(sys.stderr):  # the libraries log to stdout; it carries the JSON only
        recipes = family_recipes(args.families.split(",") if args.families else None)
        wanted = args.families.split(",") if args.families else sorted(recipes)
        for family in wanted:
            if family not in recipes:
                print(f"error: no recipes of family {family!r} were built; families: {', '.join(sorted(recipes))}",
                      file=sys.stderr)
                return 2
            tally = compare_family(recipes[family], args.samples, rng, release, examples)
            bad += tally.missed + tally.false + tally.switch_mismatch
            results[family] = {"recipes": [name for name, _ in recipes[family]], **tally.to_dict()}
    out: dict[str, Any] = {"families": results}
    if args.examples:
        out["examples"] = examples[:60]
    # One line, the last: a library's logging handler may hold the real stdout and write before it.
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
