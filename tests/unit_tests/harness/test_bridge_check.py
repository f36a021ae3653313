"""`--check_with_bridge`: the job's ConfigContainer built and validated by the real Megatron-Bridge on a CPU.

The comparison and the offline model-config cache are tested here without Megatron-Bridge; the check itself
runs where the Python 3.12 environment with Megatron-Bridge exists (`MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`,
built by scripts/setup_bridge_venv.sh), and is skipped elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.harness.bridge_check import BridgeOutcome, disagreements, qwen3_moe_hf_config, write_hf_cache
from mbridge_epoverlap.harness.main import main
from mbridge_epoverlap.recipes.loader import load_recipe
from tests.unit_tests.requirements import require_or_skip

BRIDGE_PYTHON = os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON")


def _case(name: str, overlap: bool, changes: dict | None = None):
    cfg = load_recipe("qwen3_30b_a3b")
    cfg.comm_overlap.overlap_moe_expert_parallel_comm = overlap
    return SimpleNamespace(name=name, cfg=cfg, changes=changes or {})


def test_disagreements_name_the_case_and_the_setting():
    cases = [_case("on", True), _case("off", False)]
    outcomes = [BridgeOutcome("on", True, None, overlap=False, delay_wgrad=False, dispatcher="alltoall"),
                BridgeOutcome("off", False, "AssertionError: no")]
    lines = disagreements(cases, outcomes)
    assert lines == ["case on: Megatron-Bridge runs it differently (overlap: case True, Megatron-Bridge False)",
                     "case off: Megatron-Bridge rejects the job: AssertionError: no"]
    agreeing = [BridgeOutcome("on", True, None, overlap=True, delay_wgrad=False, dispatcher="flex", backend="deepep")]
    assert disagreements(cases[:1], agreeing) == []  # the dispatcher is the recipe's unless the user changed it


def test_the_offline_model_config_is_found_at_every_pinned_revision(tmp_path):
    config = qwen3_moe_hf_config(load_recipe("qwen3_30b_a3b").model)
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (128, 8, 768)
    write_hf_cache(tmp_path, "Qwen/Qwen3-30B-A3B", config, {"abc123"})
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-30B-A3B"
    main_revision = (repo / "refs" / "main").read_text()
    for revision in (main_revision, "abc123"):
        assert json.loads((repo / "snapshots" / revision / "config.json").read_text()) == config


@pytest.fixture
def bridge_python() -> str:
    if not BRIDGE_PYTHON or not Path(BRIDGE_PYTHON).exists():
        require_or_skip("bridge", "set MBRIDGE_EPOVERLAP_BRIDGE_PYTHON (scripts/setup_bridge_venv.sh builds it)")
    return BRIDGE_PYTHON


@pytest.mark.usefixtures("bridge_python")
@pytest.mark.parametrize("gpu", ["h100", "b200", "b300", "gb200", "gb300"])  # the GPUs with qwen3_30b_a3b recipes
def test_the_ab_job_survives_megatron_bridge_and_runs_what_the_report_says(gpu, tmp_path, capsys):
    layout = ["-ng", "16"] if gpu == "h100" else ["-ng", "8", "-ep", "8"]  # Blackwell's recipes are the 8-GPU ones
    rc = main(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", gpu, *layout, "--te_version", "2.12", "--ab",
               "ep_overlap", "--dryrun", "--check_with_bridge", "--results_json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 0, err
    for case, overlap, delay in (("ep_overlap_off", "off", "off"), ("ep_overlap_on", "on", "off"),
                                 ("ep_overlap_on_delay_wgrad", "on", "on")):
        assert f"case {case}: accepted; EP overlap {overlap}, delayed wgrad {delay}" in err


@pytest.mark.usefixtures("bridge_python")
def test_a_disagreement_stops_the_run_before_submission(tmp_path, capsys):
    """A single run that sets no switch: the project's recipe has EP overlap off, Megatron-Bridge's 16-GPU H100
    perf recipe (which the job keeps) has it on, so the report would call the run something it is not."""
    rc = main(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "--te_version", "2.12", "--dryrun",
               "--check_with_bridge", "--results_json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "case run: Megatron-Bridge runs it differently (overlap: case False, Megatron-Bridge True)" in err
    assert "nothing was submitted" in err


def test_a_gpu_the_catalog_cannot_describe_is_not_checked(tmp_path, capsys, monkeypatch):
    """VR200's compute capability is not known here, so its mock would reject every flex backend."""
    monkeypatch.setenv("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON", "/nonexistent/python")
    rc = main(["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "vr200", "-ng", "8", "-ep", "8", "--dryrun",
               "--check_with_bridge", "--results_json", str(tmp_path / "r.json")])
    assert rc == 2 and "does not know the compute capability of vr200" in capsys.readouterr().err
