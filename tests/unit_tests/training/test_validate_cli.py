"""`mbridge-epoverlap validate`: exit codes, JSON contract, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.unit_tests.cli_runner import run_cli


def test_default_recipe_is_valid():
    result = run_cli("validate")
    assert result.returncode == 0, result.stderr
    assert "qwen3_30b_a3b" in result.stdout and "valid" in result.stdout


def test_errors_exit_1_with_every_violation_in_json():
    result = run_cli("validate", "--json", "--gpu", "gb200", "--te-version", "2.6", "--mcore-version", "0.16.1",
                     "comm_overlap.overlap_moe_expert_parallel_comm=true", "comm_overlap.delay_wgrad_compute=true",
                     "model.expert_model_parallel_size=1", "model.bf16=false",
                     "model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=deepep",
                     "model.recompute_granularity=selective", "model.recompute_modules=[moe]")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] is False
    by_rule = {v["rule"]: v for v in report["violations"]}
    assert {"ep_size", "precision", "flex_backend_gpu", "delay_te_grad_reduce", "recompute_moe"} <= set(by_rule)
    assert by_rule["recompute_moe"]["severity"] == "error"  # Megatron-Bridge rejects it on every core release
    assert all(set(v) == {"rule", "message", "fix", "severity"} for v in report["violations"])
    assert report["environment"]["gpu_name"] == "NVIDIA GB200"


def test_warnings_only_exit_0():
    result = run_cli("validate", "--json", "--gpu", "h100", "--te-version", "2.9", "--mcore-version", "0.15",
                     "comm_overlap.overlap_moe_expert_parallel_comm=true", "comm_overlap.delay_wgrad_compute=true",
                     "model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[moe_router]",
                     "model.use_te_rng_tracker=true")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] is True and report["warnings"] == 1


@pytest.mark.parametrize("args", [
    ("foo",), ("a.b=",), ("model.num_layer=3",), ("--recipe", "nope"), ("--te-version", "x.y"),
    ("model.num_layers=abc",), ("--gpu", "v100"), ("--task", "finetune"), ("--no-such-flag",),
])
def test_usage_errors_exit_2_without_traceback(args):
    result = run_cli("validate", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()


def test_list_rules_json():
    result = run_cli("validate", "--list-rules", "--json")
    assert result.returncode == 0
    ids = {row["rule"] for row in json.loads(result.stdout)}
    assert {"ep_size", "delay_graph_attn_bias", "layout_world_size"} <= ids


def test_package_import_is_light():
    code = ("import sys, mbridge_epoverlap, mbridge_epoverlap.config; "
            "print(sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.parametrize(("bridge", "code", "severity"), [("0.6.2", 1, "error"), ("main", 0, "warning")])
def test_bridge_version_decides_flex_without_backend(bridge, code, severity):
    result = run_cli("validate", "--json", "--gpu", "h100", "--bridge-version", bridge,
                     "model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=null")
    assert result.returncode == code, result.stderr
    report = json.loads(result.stdout)
    assert report["environment"]["bridge_version"] == bridge
    assert [(v["rule"], v["severity"]) for v in report["violations"]] == [("flex_without_backend", severity)]


def test_list_rules_says_which_release_brings_each_rule():
    result = run_cli("validate", "--list-rules", "--json")
    rows = {row["rule"]: row for row in json.loads(result.stdout)}
    assert "Megatron-Core >= 0.19" in rows["ncclep_offload_expert_fc1"]["versions"]
    assert all(row["versions"] for row in rows.values())
