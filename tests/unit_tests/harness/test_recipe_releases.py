"""Recipe facts per Megatron-Bridge release: `--bridge_version main` validates the job against main's recipe.

The main fixture (`data/bridge_recipe_facts_main.json`, extracted from main's source) holds every recipe of the
mapped models that main has, including the ones 0.6.2 lacks; a job for main starts from main's values and the dry
run names the release; where the Python with Megatron-Bridge main exists, the fixture is rebuilt and must equal
the committed one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mbridge_epoverlap.harness import recipe_facts
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.hf_configs import HF_MODELS
from mbridge_epoverlap.harness.main import main
from mbridge_epoverlap.harness.resolve import resolve
from tests.unit_tests.requirements import require_or_skip

REPO = Path(__file__).resolve().parents[3]
B200 = ("-mr", "qwen3_30b_a3b", "-g", "b200", "-ng", "8", "-c", "fp8_mx", "--te_version", "2.12")
QWEN = "megatron.bridge.perf_recipes.qwen"


def resolved(*argv: str):
    return resolve(build_parser().parse_intermixed_args(list(argv)))


def test_each_release_has_its_fixture():
    old, new = recipe_facts.load_facts(release="0.6"), recipe_facts.load_facts(release="main")
    assert (old["version"], old["core_version"], old["release"]) == ("0.6.2", "0.19.2", "0.6")
    assert (new["version"], new["core_version"], new["release"]) == ("0.7.0", "0.20.0", "main")
    assert len(new["commit"]) == 40
    for name in HF_MODELS:  # every mapped model has performance recipes in both
        assert any(n.startswith(f"{name}_") for n in recipe_facts.perf_recipe_names(release="main")), name
    # main's new Qwen3-30B-A3B recipes (#4632): fp8ds on H100 and nvfp4; 0.6.2 has none of them
    added = {"qwen3_30b_a3b_pretrain_16gpu_h100_fp8ds_config", "qwen3_30b_a3b_pretrain_8gpu_b200_nvfp4_config"}
    assert added <= set(recipe_facts.perf_recipe_names(release="main"))
    assert not added & set(recipe_facts.perf_recipe_names(release="0.6"))


def test_a_main_job_is_validated_against_mains_recipe():
    """Qwen3-30B-A3B on B200 fp8mx (#5356): main has TE graphs of attn, moe_router, moe_preprocess and
    moe_hybridep_num_sms=64 where 0.6.2 has the full-iteration graph."""
    main_cfg = resolved(*B200, "--bridge_version", "main").cfg
    old_cfg = resolved(*B200).cfg
    assert (main_cfg.model.cuda_graph_impl, main_cfg.model.cuda_graph_scope) == (
        "transformer_engine", ["attn", "moe_router", "moe_preprocess"])
    assert main_cfg.model.moe_hybridep_num_sms == 64
    assert (main_cfg.comm_overlap.overlap_moe_expert_parallel_comm, main_cfg.comm_overlap.delay_wgrad_compute) == (
        True, True)
    assert old_cfg.model.cuda_graph_impl == "full_iteration" and old_cfg.model.moe_hybridep_num_sms == 32
    h100 = resolved("-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "--bridge_version", "main").cfg
    assert h100.model.moe_permute_fusion_into_hybridep is True  # #5123 on main only
    assert resolved("-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16").cfg.model.moe_permute_fusion_into_hybridep \
        is False


def test_the_dry_run_names_the_release_whose_recipe_it_used(tmp_path, capsys):
    rc = main([*B200, "--bridge_version", "main", "--dryrun", "--results_json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    label = "Megatron-Bridge main (0.7.0 at 067f987df)"
    assert f"validating the job {label} builds: {QWEN}.qwen3_30b_a3b_pretrain_8gpu_b200_fp8mx_config" in err
    assert f"# {label} recipe: {QWEN}.qwen3_30b_a3b_pretrain_8gpu_b200_fp8mx_config" in out
    rc = main([*B200, "--dryrun", "--results_json", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert rc == 0 and "# Megatron-Bridge 0.6.2 recipe: " in out and "validating the job Megatron-Bridge 0.6.2" in err


@pytest.mark.parametrize(("argv", "says"), [
    (("--bridge_version", "0.5"), "--bridge_version 0.5: the validator knows Megatron-Bridge 0.6.x and main"),
    (("--mcore_version", "0.21"), "--mcore_version 0.21: the validator knows the rules of Megatron-Core 0.15"),
    (("model.moe_dispatch_fwd_dtype=mxfp8",), "Megatron-Core main (0.20"),
    (("--bridge_version", "main", "--mcore_version", "0.19", "ddp.megatron_fsdp_version=2"),
     "Megatron-Core 0.20 (Megatron-LM main) introduced it"),
])
def test_releases_and_fields_the_job_cannot_have_are_usage_errors(argv, says, tmp_path, capsys):
    rc = main([*B200, *argv, "--dryrun", "--results_json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err, err


def test_main_rules_stop_a_main_job_before_launch(tmp_path, capsys):
    """Megatron-FSDP v2 under Megatron-Bridge main refuses the MoE recipe (#5395): exit 1, nothing written."""
    rc = main([*B200, "--bridge_version", "main", "ddp.use_megatron_fsdp=true", "ddp.megatron_fsdp_version=2",
               "--dryrun", "--results_json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 1 and "fsdp_v2_moe" in err and "#5395" in err, err


@pytest.mark.timeout(600)
def test_the_main_fixture_is_what_megatron_bridge_main_builds(tmp_path):
    """Qwen3-30B-A3B's recipes rebuilt by Megatron-Bridge main equal the committed fixture's (the whole fixture is
    rebuilt with the command in scripts/extract_bridge_recipe_facts.py; one model keeps the test short)."""
    python = os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON")
    if not python or not Path(python).exists():
        require_or_skip("bridge_main", "set MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON (scripts/setup_bridge_main_venv.sh "
                                       "builds it)")
    out = tmp_path / "facts.json"
    proc = subprocess.run([python, str(REPO / "scripts" / "extract_bridge_recipe_facts.py"), str(out), "--models",
                           "qwen3_30b_a3b"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rebuilt = json.loads(out.read_text())
    committed = recipe_facts.load_facts(release="main")
    head = {k: v for k, v in committed.items() if k not in ("recipes", "not_built")}
    assert {k: v for k, v in rebuilt.items() if k not in ("recipes", "not_built")} == head
    assert rebuilt["not_built"] == {}  # every recipe of the model builds
    assert len(rebuilt["recipes"]) >= 20
    assert rebuilt["recipes"] == {name: committed["recipes"][name] for name in rebuilt["recipes"]}
