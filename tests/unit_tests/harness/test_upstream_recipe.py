"""GPU jobs are validated as the recipe Megatron-Bridge builds, from the released wheel's recipe facts.

Without Megatron-Bridge: the fixture (`mbridge_epoverlap/harness/data/bridge_recipe_facts.json`) is complete
for the models the harness maps, the validated config starts from it, and validation and dry run differ from
what the project's own recipe would give. Where the Python 3.12 environment with Megatron-Bridge exists, the
fixture is rebuilt from the real Megatron-Bridge and must equal the committed one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness import recipe_facts
from mbridge_epoverlap.harness.cases import ValidationFailed, build_cases, case_specs
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.hf_configs import HF_MODELS, RELEASED_MODELS
from mbridge_epoverlap.harness.main import main
from mbridge_epoverlap.harness.resolve import resolve
from mbridge_epoverlap.recipes.loader import family_of, load_recipe
from tests.unit_tests.requirements import require_or_skip

REPO = Path(__file__).resolve().parents[3]
WHEEL = json.loads((Path(__file__).parent / "data" / "megatron_bridge_facts.json").read_text())
GPU = ("-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16")
H100_RECIPE = "megatron.bridge.perf_recipes.qwen.qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config"


def resolved(*argv: str):
    return resolve(build_parser().parse_intermixed_args(list(argv)))


def cases_for(ab: str | None, *argv: str):
    r = resolved(*argv, *(("--ab", ab) if ab else ()))
    return build_cases(r, case_specs(ab, r.cfg, r.explicit))


def test_the_fixture_holds_every_recipe_of_the_mapped_models_in_the_released_wheel():
    facts = recipe_facts.load_facts()
    assert (facts["version"], facts["core_version"]) == (WHEEL["version"], "0.19.2")
    for name in HF_MODELS:
        family = family_of(name)
        perf = {n for n in WHEEL["perf_recipes"][family] if n.startswith(f"{name}_")}
        library = {n for n in WHEEL["recipes"].get(family, ())
                   if n in {f"{name}_{t}_config" for t in ("pretrain", "sft")}}
        assert perf and (library or name in RELEASED_MODELS), name  # GLM-5 has no library recipe of that name
        for function in sorted(perf):
            module = f"megatron.bridge.perf_recipes.{family}"
            assert recipe_facts.facts_for(module, function) is not None or \
                recipe_facts.not_built(module, function) is not None, function
        for function in sorted(library):
            module = f"megatron.bridge.recipes.{family}"
            assert recipe_facts.facts_for(module, function) is not None or \
                recipe_facts.not_built(module, function) is not None, function


def test_the_validated_config_is_the_recipe_bridge_builds():
    """Item 0 of issue 23: EP overlap, flex/HybridEP, TE graphs, fusions and tuning are the recipe's, not ours."""
    cfg = resolved(*GPU).cfg
    project = load_recipe("qwen3_30b_a3b")
    values = recipe_facts.facts_for(*H100_RECIPE.rsplit(".", 1))["values"]
    ours = {key: recipe_facts.plain(v) for key, v in recipe_facts.run_config_values(cfg, values).items()}
    assert ours == values
    assert (cfg.comm_overlap.overlap_moe_expert_parallel_comm, project.comm_overlap.overlap_moe_expert_parallel_comm) \
        == (True, False)
    assert (cfg.model.moe_token_dispatcher_type, cfg.model.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert (cfg.model.cuda_graph_impl, cfg.model.moe_permute_fusion, cfg.ddp.grad_reduce_in_fp32) == \
        ("transformer_engine", True, False)
    assert cfg.model.hidden_size == project.model.hidden_size  # the model itself is the same


def test_validation_outcome_follows_the_recipe_not_the_project_recipe():
    """The recipe runs EP overlap: recomputing whole layers is rejected for the job, though the project's recipe
    (overlap off) would accept it; its TE graphs with delayed wgrad need TE 2.10, which TE 2.9 is not."""
    with pytest.raises(ValidationFailed) as exc:
        cases_for(None, *GPU, "--te_version", "2.12", "--recompute_granularity", "full", "--recompute_method",
                  "uniform", "-rl", "1")
    assert "recompute_full" in {violation.rule for violation, _ in exc.value.errors}
    project = load_recipe("qwen3_30b_a3b")
    project.model.recompute_granularity, project.model.recompute_method = "full", "uniform"
    project.model.recompute_num_layers = 1
    env = resolved(*GPU, "--te_version", "2.12").target.env
    assert [v.rule for v in project.validate(env) if v.severity == "error"] == []

    with pytest.raises(ValidationFailed) as exc:
        cases_for("ep_overlap", *GPU, "--te_version", "2.9")
    errors = [(violation.rule, names) for violation, names in exc.value.errors]
    assert errors == [("delay_cuda_graph_te", ["ep_overlap_on_delay_wgrad"])]
    cases, _ = cases_for("ep_overlap", *GPU, "--te_version", "2.9", "--cuda_graph_impl", "none")
    assert len(cases) == 3


def test_the_dry_run_lists_each_change_against_the_recipe(tmp_path, capsys):
    rc = main([*GPU, "--te_version", "2.12", "--moe_a2a_overlap", "false", "--cuda_graph_impl", "none", "--dryrun",
               "--results_json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("#   case run:")]
    for change in ("comm_overlap.overlap_moe_expert_parallel_comm=False (recipe: True)",
                   "model.cuda_graph_impl='none' (recipe: 'transformer_engine')",
                   "model.cuda_graph_scope=[] (recipe: ['moe_router', 'moe_preprocess'])",
                   "model.use_te_rng_tracker=False (recipe: True)"):
        assert change in line, line
    assert "moe_permute_fusion" not in line  # the recipe's, kept
    assert f"validating the job Megatron-Bridge 0.6.2 builds: {H100_RECIPE}" in err
    changes = json.loads((tmp_path / "r.slurm" / "configs" / "run.changes.json").read_text())
    assert changes["model.cuda_graph_scope"] == [] and changes["model.use_te_rng_tracker"] is False


def test_a_library_recipe_is_the_start_with_use_recipes():
    cfg = resolved(*GPU, "--use_recipes").cfg
    values = recipe_facts.facts_for("megatron.bridge.recipes.qwen", "qwen3_30b_a3b_pretrain_config")["values"]
    assert cfg.model.moe_token_dispatcher_type == values["model.moe_token_dispatcher_type"]
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm == values["comm_overlap.overlap_moe_expert_parallel_comm"]


def test_a_gpu_without_a_recipe_of_the_workload_is_a_usage_error():
    """Megatron-Bridge has Qwen3-30B-A3B recipes, none for A100: upstream's lookup stops, and so does the harness."""
    with pytest.raises(UsageError, match="no Megatron-Bridge performance recipe for qwen3_30b_a3b.*has -g b200"):
        resolved("-mr", "qwen3_30b_a3b", "-g", "a100", "-ng", "16")


@pytest.mark.parametrize(("argv", "says"), [
    (("-mr", "mixtral_8x22b", "-g", "h100"), "no Megatron-Bridge performance recipe for mixtral_8x22b"),
])
def test_without_an_upstream_recipe_the_project_recipe_is_validated_and_said(argv, says):
    r = resolved(*argv)
    assert r.upstream.facts is None and any(says in note and "the job will stop" in note for note in r.notes)
    project = load_recipe(argv[1])
    assert r.cfg.model.moe_token_dispatcher_type == project.model.moe_token_dispatcher_type
    assert r.cfg.comm_overlap.overlap_moe_expert_parallel_comm == project.comm_overlap.overlap_moe_expert_parallel_comm


def test_cpu_runs_the_project_recipe():
    r = resolved("-mr", "qwen3_30b_a3b", "-g", "cpu")
    assert r.upstream is None and r.recipe is None
    assert r.cfg.comm_overlap.overlap_moe_expert_parallel_comm is False


@pytest.mark.timeout(600)
def test_the_fixture_is_what_the_real_megatron_bridge_builds(tmp_path):
    """Every recipe rebuilt by the released Megatron-Bridge equals the committed fixture (the generator is
    reproducible)."""
    python = os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON")
    if not python or not Path(python).exists():
        require_or_skip("bridge", "set MBRIDGE_EPOVERLAP_BRIDGE_PYTHON (scripts/setup_bridge_venv.sh builds it)")
    out = tmp_path / "facts.json"
    proc = subprocess.run([python, str(REPO / "scripts" / "extract_bridge_recipe_facts.py"), str(out)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == recipe_facts.FACTS_FILE.read_text()
