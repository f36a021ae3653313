"""The Megatron-Bridge recipe a GPU job builds, as Megatron-Bridge's run_script.py picks it.

The names are those of the released Megatron-Bridge wheel (`data/megatron_bridge_facts.json`, written by
`scripts/extract_mbridge_facts.py` from the wheel's files, never imported). Mirrors upstream's
`tests/unit_tests/scripts/performance/test_recipe_environment.py` recipe cases (named per test).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness import mbridge_job
from mbridge_epoverlap.harness.bridge_recipes import choose_perf_recipe, library_recipe
from mbridge_epoverlap.recipes import FAMILIES
from mbridge_epoverlap.recipes.bridge_models import BY_NAME

FACTS = json.loads((Path(__file__).parent / "data" / "megatron_bridge_facts.json").read_text())
PERF = [name for names in FACTS["perf_recipes"].values() for name in names]


def pick(model="qwen3_30b_a3b", gpu="h100", dtype="bf16", num_gpus=None, variant=None, task="pretrain"):
    return choose_perf_recipe(PERF, family="qwen", model=model, task=task, gpu=gpu, compute_dtype=dtype,
                              num_gpus=num_gpus, config_variant=variant)


def test_fixture_is_the_released_wheel():
    assert FACTS["version"] == "0.6.2" and len(PERF) > 300


def test_exact_gpu_recipe_takes_precedence_over_canonical_fallback():
    """Mirrors test_exact_gpu_recipe_takes_precedence_over_canonical_fallback."""
    chosen = pick(num_gpus=64)
    assert (chosen.function, chosen.num_gpus) == ("qwen3_30b_a3b_pretrain_64gpu_h100_bf16_config", 64)
    assert chosen.module == "megatron.bridge.perf_recipes.qwen"


@pytest.mark.parametrize(("gpu", "dtype", "count"), [("h100", "bf16", 16), ("h100", "fp8_cs", 16),
                                                      ("b200", "bf16", 8), ("gb200", "bf16", 8)])
def test_missing_exact_gpu_recipe_uses_canonical_family_recipe(gpu, dtype, count):
    """Mirrors test_missing_exact_gpu_recipe_uses_canonical_family_recipe: Megatron-Bridge's default count."""
    chosen = pick(gpu=gpu, dtype=dtype, num_gpus=12)
    assert chosen.num_gpus == count and chosen.function.endswith(f"_{count}gpu_{gpu}_{dtype.replace('_', '')}_config")


def test_largest_count_is_the_default_elsewhere():
    chosen = choose_perf_recipe(PERF, family="qwen", model="qwen3_235b_a22b", task="pretrain", gpu="h100",
                                compute_dtype="bf16", num_gpus=None)
    counts = [int(n.split("gpu_")[0].rsplit("_", 1)[1]) for n in PERF
              if n.startswith("qwen3_235b_a22b_pretrain_") and n.endswith("gpu_h100_bf16_config")]
    assert chosen.num_gpus == max(counts)


def test_config_variant_picks_the_variant_recipe():
    chosen = pick(gpu="gb200", num_gpus=16, variant="dev")
    assert chosen.function == "qwen3_30b_a3b_pretrain_16gpu_gb200_bf16_dev_config"
    assert pick(variant="v1").function == pick().function  # retired labels name the canonical recipe


def test_missing_perf_recipe_family_reports_requested_workload():
    """Mirrors test_missing_perf_recipe_family_reports_requested_workload."""
    with pytest.raises(UsageError, match=r"qwen3_30b_a3b/pretrain/h100/nvfp4/default.*--use_recipes"):
        pick(dtype="nvfp4")


@pytest.mark.parametrize(("family", "model"), [(f, m) for f, names in FAMILIES.items() for m in names
                                               if f in FACTS["recipes"] and m not in BY_NAME])
def test_library_recipes_of_our_models_exist_in_the_release(family, model):
    """--use_recipes builds megatron.bridge.recipes.<family>.<model>_pretrain_config; it must exist upstream for the
    hand-written recipes (the Bridge workloads' library recipes are what the release has: test_bridge_workloads)."""
    recipe = library_recipe(family, model, "pretrain")
    assert recipe.function in FACTS["recipes"][family], (
        f"{recipe.module}.{recipe.function} is not exported by Megatron-Bridge {FACTS['version']}")


def test_choose_recipe_defaults_to_perf_and_library_with_use_recipes():
    kwargs = dict(gpu="h100", compute_dtype=None, num_gpus=16, config_variant=None, perf_names=PERF)
    perf = mbridge_job.choose_recipe("qwen", "qwen3_30b_a3b", "pretrain", use_recipes=False, **kwargs)
    assert perf.function == "qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config" and perf.kind == "performance"
    library = mbridge_job.choose_recipe("qwen", "qwen3_30b_a3b", "pretrain", use_recipes=True, **kwargs)
    assert (library.module, library.function) == ("megatron.bridge.recipes.qwen", "qwen3_30b_a3b_pretrain_config")


def test_job_writes_to_config_sections_the_released_container_has():
    """The job's field names against the released ConfigContainer and CommOverlapConfig (read from source)."""
    container = set(FACTS["config_fields"]["ConfigContainer"])
    sections = {section for section, _ in mbridge_job.JOB_SETTINGS.values()}
    sections |= {"model", "comm_overlap", "train", "ddp", "dataset", "tokenizer", "logger", "profiling",
                 "mixed_precision"}
    assert sections <= container, sorted(sections - container)
    from mbridge_epoverlap.config.comm_overlap import CommOverlapConfig

    ours = {name for name in CommOverlapConfig().to_dict()}
    assert ours <= set(FACTS["config_fields"]["CommOverlapConfig"]), sorted(ours - set(FACTS["config_fields"]
                                                                                     ["CommOverlapConfig"]))


def test_job_settings_are_applied_where_the_container_has_them():
    target = SimpleNamespace(optimizer=SimpleNamespace(lr=1.0), logger=SimpleNamespace(wandb_project=None))
    unused = mbridge_job.apply_job_settings(target, {"lr": 1e-4, "wandb_project_name": "p", "golden_values_path": "g"})
    assert target.optimizer.lr == 1e-4 and target.logger.wandb_project == "p"
    assert unused == ["--golden_values_path"]
