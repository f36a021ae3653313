"""Every MoE workload of Megatron-Bridge's perf recipes through `run_script.py`: GPT-OSS, Kimi K2, DeepSeek-V3/V4,
Qwen3 / Qwen3-Next, Nemotron 3, the Qwen VL MoEs and GLM-5.

The wheel's own inventory of recipe names (`data/megatron_bridge_facts.json`, read from the released wheel's files,
never imported) is the list to cover; the recipe facts (`bridge_recipe_facts*.json`, built by the real
Megatron-Bridge) are what each job starts from. Every performance config of every workload is resolved as
upstream's run_script.py resolves it (`-mr` found across families), and its job must be the recipe itself and pass
validation as shipped, except where the recipe cannot start at all (named here, each with Megatron's reason).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness import recipe_facts
from mbridge_epoverlap.harness.bridge_recipes import FLAG_PRECISION
from mbridge_epoverlap.harness.cases import ValidationFailed, build_cases, case_specs
from mbridge_epoverlap.harness.flags import COMPUTE_DTYPES, build_parser
from mbridge_epoverlap.harness.main import main
from mbridge_epoverlap.harness.resolve import resolve
from mbridge_epoverlap.recipes import FAMILIES, RECIPES
from mbridge_epoverlap.recipes.bridge_models import BY_NAME, recipe_parts, reference_recipe
from mbridge_epoverlap.recipes.loader import family_of

WHEEL = json.loads((Path(__file__).parent / "data" / "megatron_bridge_facts.json").read_text())
# The wheel's families of dense models (Llama) and video diffusion (Wan): not EP-overlap workloads.
NOT_MOE_FAMILIES = {"llama", "wan"}
VERSIONS = ("--te_version", "2.12", "--torch_version", "2.7")
# Shipped configs that cannot start at their own GPU count, with the check that stops them (Megatron-Core's
# parallel_state: world size divisible by EP x ETP x PP; its batch check: GBS a multiple of MBS x DP), and the
# recipes the 0.6.2 wheel cannot build (its perf_recipes/nemotronh/te_quant.cfg is not packaged).
CANNOT_START = {
    "layout_expert_parallel": {
        "deepseek_v3_pretrain_64gpu_h100_bf16_config", "deepseek_v3_pretrain_64gpu_h100_fp8cs_config",
        *(f"deepseek_v3_pretrain_128gpu_vr200_{p}_config" for p in ("bf16", "fp8cs", "fp8mx", "nvfp4")),
        *(f"qwen3_235b_a22b_pretrain_64gpu_{g}_{p}_config" for g, p in (
            ("gb200", "fp8cs"), ("gb200", "fp8mx"), ("gb200", "nvfp4"), ("gb200", "nvfp4_full_iteration"),
            ("gb300", "bf16"), ("gb300", "fp8cs"), ("gb300", "fp8mx"), ("gb300", "nvfp4"),
            ("gb300", "nvfp4_full_iteration")))},
    "layout_batch": {"nemotronh_56b_pretrain_256gpu_b200_bf16_config",
                     "nemotronh_56b_pretrain_256gpu_gb300_bf16_config"},
}
# On 0.6.2 only: DeepSeek-V4 Pro's recipe recomputes its mHC hyper-connections, a module Megatron-Core 0.19 does
# not know (Bridge's own check of the job stops there too; main's Core knows it).
CANNOT_START_062 = {"recompute_modules_known": {"deepseek_v4_pro_pretrain_256gpu_gb300_fp8mx_config"}}
GRAPHLESS_CLEARED = {"model.use_te_rng_tracker", "model.cuda_graph_scope"}
NOT_BUILT_062 = {f"nemotron_3_super_pretrain_64gpu_{gpu}_nvfp4_config" for gpu in ("b200", "b300", "gb200", "gb300",
                                                                                   "vr200")}


def resolved(*argv: str):
    return resolve(build_parser().parse_intermixed_args(list(argv)))


def _workloads_of(names: list[str]) -> set[str]:
    return {parts["model"] for name in names if (parts := recipe_parts(name))}


def test_every_moe_workload_of_the_wheel_is_a_recipe_of_its_family():
    """The issue's table: 18 MoE workloads (and the dense hybrid nemotronh_56b) in seven families."""
    found = {family: _workloads_of(names) for family, names in WHEEL["perf_recipes"].items()
             if family not in NOT_MOE_FAMILIES}
    assert sum(len(workloads) for workloads in found.values()) == 21
    for family, workloads in found.items():
        assert workloads <= set(FAMILIES[family]), (family, workloads - set(FAMILIES[family]))
        for workload in workloads:
            assert workload in RECIPES and family_of(workload) == family


@pytest.mark.parametrize("release", ["0.6", "main"])
def test_every_config_is_in_the_facts_or_named_as_not_buildable(release):
    facts = recipe_facts.load_facts(release=release)
    names = set(recipe_facts.perf_recipe_names(release=release))
    if release == "0.6":  # the wheel's own inventory is the list to cover
        wheel = {name for family, found in WHEEL["perf_recipes"].items() if family not in NOT_MOE_FAMILIES
                 for name in found if recipe_parts(name)}
        assert wheel == names
        assert {key.rpartition(".")[2] for key in facts["not_built"] if ".perf_recipes." in key} == NOT_BUILT_062
    assert len(names) > 300
    for name in names:
        family = family_of(recipe_parts(name)["model"])
        key = f"megatron.bridge.perf_recipes.{family}.{name}"
        assert key in facts["recipes"] or key in facts["not_built"], key


def _argv(name: str, release: str) -> list[str]:
    parts = recipe_parts(name)
    argv = ["-mr", parts["model"], "--task", parts["task"], "-g", parts["gpu"], "-ng", parts["count"], "-c",
            FLAG_PRECISION[parts["precision"]], *VERSIONS]
    if parts["variant"] != "default":
        argv += ["-cv", parts["variant"]]
    return argv + (["--bridge_version", "main"] if release == "main" else [])


@pytest.mark.parametrize("release", ["0.6", "main"])
def test_every_shipped_config_is_the_job_and_passes_validation_as_shipped(release):
    """Each config's job is upstream's recipe (the same function, every value of its facts), and the validator
    accepts it unchanged, except the configs that cannot start (`CANNOT_START`, each with its rule)."""
    tally: Counter[str] = Counter()
    rejected: dict[str, set[str]] = {}
    for name in recipe_facts.perf_recipe_names(release=release):
        parts = recipe_parts(name)
        if FLAG_PRECISION[parts["precision"]] not in COMPUTE_DTYPES:
            continue  # fp8ds (main): upstream's -c has no value for it either
        if release == "0.6" and name in NOT_BUILT_062:
            with pytest.raises(UsageError, match="cannot build .*te_quant.cfg"):
                resolved(*_argv(name, release))
            continue
        r = resolved(*_argv(name, release))
        assert r.upstream.recipe.function == name
        facts = r.upstream.facts["values"]
        # Upstream's run_script.py clears the RNG tracker and graph modules of a config without graphs (as the
        # harness does), and a value the run config cannot hold is said in a note: neither is compared.
        kept = set(facts) - set(r.upstream.skipped) - (GRAPHLESS_CLEARED if r.cfg.model.cuda_graph_impl == "none"
                                                       else set())
        ours = recipe_facts.run_config_values(r.cfg, kept)
        assert {key: recipe_facts.plain(value) for key, value in ours.items()} == \
            {key: facts[key] for key in kept}, name
        try:
            build_cases(r, case_specs(None, r.cfg, r.explicit))
        except ValidationFailed as exc:
            for violation, _names in exc.errors:
                rejected.setdefault(violation.rule, set()).add(name)
            continue
        tally[parts["model"]] += 1
    names = set(recipe_facts.perf_recipe_names(release=release))
    expected = {rule: found & names for rule, found in CANNOT_START.items()}  # main lacks a few of them
    assert rejected == (expected | CANNOT_START_062 if release == "0.6" else expected)
    assert len(tally) == (20 if release == "0.6" else 21) and sum(tally.values()) > 270, tally  # V4 Pro: one config


def test_lookup_ignores_a_family_that_is_not_the_workloads(capsys):
    """Upstream finds -mr across families; -m qwen -mr qwen3_vl_30b_a3b builds the qwen_vl recipe."""
    r = resolved("-m", "qwen", "-mr", "qwen3_vl_30b_a3b", "-g", "h100", "-ng", "16", *VERSIONS)
    assert r.upstream.recipe.module == "megatron.bridge.perf_recipes.qwen_vl"
    assert any("found there by -mr" in note for note in r.notes)


@pytest.mark.parametrize(("argv", "says"), [
    (("-m", "llama3",), "unknown model family 'llama3' (-m); known: dbrx, deepseek, glm_moe_dsa, gpt_oss, kimi"),
    (("-mr", "gpt_oss_120", "-g", "h100"), "unknown recipe 'gpt_oss_120'"),
    (("-mr", "gpt_oss_120b", "-g", "a100", "--dryrun"), "gpt_oss_120b pretrain has -g b200, b300, gb200, gb300, h100"),
    (("-mr", "glm52", "-g", "h100", "--dryrun"), "glm52 has --task sft"),
    (("-mr", "kimi_k2", "-g", "h100", "-c", "nvfp4", "--dryrun"), "kimi_k2 pretrain on h100 has -c bf16"),
    (("-mr", "qwen3_30b_a3b", "-g", "h100", "-cv", "nope", "--dryrun"), "on h100 bf16 has -cv default, dev"),
    (("-mr", "nemotron_3_super", "-g", "b200", "-c", "nvfp4", "--dryrun"), "cannot build"),
])
def test_a_config_upstream_lacks_exits_2_naming_what_exists(argv, says, capsys, tmp_path):
    rc = main([*argv, "--results_json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, err
    assert "Traceback" not in err and not (tmp_path / "r.json").exists()


def test_list_config_variants_lists_every_config_of_the_workload(capsys):
    assert main(["-mr", "gpt_oss_120b", "--list_config_variants"]) == 0
    lines = capsys.readouterr().out.splitlines()
    wheel = [n for n in WHEEL["perf_recipes"]["gpt_oss"] if recipe_parts(n)["model"] == "gpt_oss_120b"]
    assert lines[0].startswith("# Megatron-Bridge 0.6.2: 13 performance config(s) of gpt_oss_120b")
    assert len(wheel) == 13
    assert "--task pretrain -g gb200 -ng 64 -c bf16 -cv ncclep" in lines
    assert main(["-mr", "gpt_oss_120b", "-g", "h100", "-c", "bf16", "--list_config_variants"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["--task pretrain -g h100 -ng 64 -c bf16"]


@pytest.mark.parametrize("workload", sorted(BY_NAME))
def test_the_project_recipe_is_the_reference_recipes_model(workload):
    """A Bridge workload's project recipe carries its reference recipe's model (what -g cpu shrinks)."""
    cfg = RECIPES[workload]("pretrain")
    key = reference_recipe(BY_NAME[workload])
    values = recipe_facts.facts_for(*key.rsplit(".", 1))["values"]
    for field in ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "expert_model_parallel_size", "hybrid_layer_pattern", "mtp_num_layers"):
        assert getattr(cfg.model, field) == values.get(f"model.{field}", getattr(cfg.model, field)), (key, field)
    assert cfg.num_gpus == int(recipe_parts(key.rpartition(".")[2])["count"])


@pytest.mark.parametrize(("workload", "says"), [
    ("nemotron_3_nano", "the hybrid stack (23 Mamba-2, 23 MoE, 6 attention of 52 layers) runs as attention + MoE"),
    ("qwen3_next_80b_a3b", "the gated DeltaNet linear-attention layers (36 of 48 layers) run as softmax attention"),
    ("qwen3_vl_30b_a3b", "the vision tower is left out"),
    ("deepseek_v4_flash", "hyper-connections (several residual streams) run as one residual stream"),
    ("glm52", "the DeepSeek Sparse Attention layers run as softmax attention"),
    ("gpt_oss_120b", "linear-layer biases are left out"),
    ("kimi_k2", "multi-latent attention runs as standard multi-head attention"),
])
def test_cpu_runs_say_what_stands_in_for_layers_the_runtime_lacks(workload, says):
    r = resolved("-mr", workload, "-g", "cpu", "-ng", "2")
    assert any(says in note for note in r.notes), r.notes
    m = r.cfg.model
    assert (m.hybrid_layer_pattern, m.experimental_attention_variant) == (None, None)
    assert not m.enable_hyper_connections
    assert m.expert_model_parallel_size == 2 and m.num_moe_experts % 2 == 0


def test_a_dense_workload_is_refused_on_cpu_with_the_reason(capsys):
    assert main(["-mr", "nemotronh_56b", "-g", "cpu", "-ng", "2", "--dryrun"]) == 2
    assert "nemotronh_56b is not a MoE model" in capsys.readouterr().err


def test_ep_overlap_on_a_hybrid_stack_is_refused_before_submission(capsys, tmp_path):
    """Nemotron 3's recipes keep overlap off; turning it on fails at the first step upstream (no build_schedule_plan
    on MambaModel), so the dry run refuses it and names the rule."""
    rc = main(["-mr", "nemotron_3_nano", "-g", "h100", "-ng", "16", *VERSIONS, "--moe_a2a_overlap", "true", "--dryrun",
               "--results_json", str(tmp_path / "r.json")])
    assert rc == 1 and "[hybrid_stack]" in capsys.readouterr().err


def test_validate_checks_a_bridge_workload_for_the_core_its_recipe_was_built_with(capsys):
    """`validate -mr kimi_k2` (the issue's command) works; Nemotron 3.5 Lightning with overlap breaks two rules: its
    hybrid stack and its two MTP layers, checked for Megatron-Core 0.19 (the release of its recipe's fields)."""
    from mbridge_epoverlap.cli import main as cli_main

    versions = ["-g", "h100", "--te-version", "2.12", "--torch-version", "2.7"]
    assert cli_main(["validate", "-mr", "kimi_k2", *versions]) == 0
    capsys.readouterr()
    rc = cli_main(["validate", "-mr", "nemotron_3_5_lightning", *versions,
                   "comm_overlap.overlap_moe_expert_parallel_comm=true", "--json"])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert rc == 1 and {v["rule"] for v in report["violations"]} == {"hybrid_stack", "mtp_layers"}
    assert "checked for its Megatron-Core 0.19.2" in err


@pytest.mark.parametrize("workload", sorted(set(BY_NAME) - {"nemotronh_56b"}))
def test_the_cpu_ab_of_every_moe_workload_validates(workload):
    """`-g cpu --ab ep_overlap` builds its three cases for every MoE workload: the recipe's recompute (which EP overlap
    refuses on a GPU for Qwen3-Next, Nemotron 3, GLM-5) is left out on the CPU and said."""
    r = resolved("-mr", workload, "-g", "cpu", "-ng", "2", "--ab", "ep_overlap")
    cases, _ = build_cases(r, case_specs("ep_overlap", r.cfg, r.explicit))
    assert [c.name for c in cases] == ["ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"]
    recipe = RECIPES[workload]("pretrain").model
    if recipe.recompute_granularity is not None or recipe.recompute_modules:
        assert any("activation recompute" in note for note in r.notes), r.notes
        assert r.cfg.model.recompute_modules is None


def test_the_users_own_recompute_is_kept_on_cpu():
    r = resolved("-mr", "qwen3_next_80b_a3b", "-g", "cpu", "-ng", "2", "--ab", "ep_overlap",
                 "model.recompute_modules=[moe]")
    with pytest.raises(ValidationFailed) as exc:
        build_cases(r, case_specs("ep_overlap", r.cfg, r.explicit))
    assert {violation.rule for violation, _names in exc.value.errors} == {"recompute_moe"}
