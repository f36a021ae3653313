"""Differential test with Megatron-Bridge's own config code (and Megatron-Core under it) as the oracle, for both
releases the validator knows: 0.6.2 on Megatron-Core 0.19.2, and main on Megatron-Core main (0.20).

A sample of `mbridge_epoverlap.config.bridge_fuzz`: random configurations go through Bridge's
`CommOverlapConfig` finalize + setup, `validate_flex_dispatcher_backend`, `validate_cuda_graph_configuration`
and the model's finalize on a CPU (on main also its native-packing step and its Megatron-FSDP v2 contract), and
through the validator for the same environment; they must agree (0 missed, 0 false rejections, the same EP
switches on every accepted config). Bridge needs Python 3.12, so each sample runs in the environment its setup
script builds, named by `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON` (0.6.2) or `MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON` (main);
without it that release's test is skipped. The full run is the `bridge_fuzz` benchmark (`make bench`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.unit_tests.requirements import require_or_skip

REPO = Path(__file__).resolve().parents[3]
SAMPLES = 150
# release -> (variable naming its Python, requirement name, setup script, rules the sample must exercise)
RELEASES = {
    "0.6.2": ("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON", "bridge", "scripts/setup_bridge_venv.sh",
              {"ncclep_needs_flex", "delay_graph_grad_accum", "cuda_graph_local_scoped", "delay_te_grad_reduce",
               "rank_capacity_backend"}),
    "main": ("MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON", "bridge_main", "scripts/setup_bridge_main_venv.sh",
             {"cuda_graph_local_scoped", "delay_te_grad_reduce", "rank_capacity_backend", "a2a_dtype_needs_ncclep",
              "a2a_mxfp8_fused_gemm", "fsdp_v2_moe"}),
}


def _python(release: str) -> str:
    variable, requirement, script, _rules = RELEASES[release]
    python = os.environ.get(variable)
    if not python or not Path(python).exists():
        require_or_skip(requirement, f"set {variable} ({script} builds it)")
    return python


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_validator_agrees_with_megatron_bridge(release):
    proc = subprocess.run([_python(release), "-m", "mbridge_epoverlap.config.bridge_fuzz", "--samples", str(SAMPLES),
                           "--seed", "20261201", "--examples"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=900)
    tally = json.loads(proc.stdout)
    assert tally["release"]["bridge"] == release, tally["release"]
    assert (tally["missed"], tally["false"], tally["false_on_object"], tally["switch_mismatch"]) == (0, 0, 0, 0), \
        tally["examples"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Both verdicts must be common, and the new rules exercised, or the test proves nothing.
    assert tally["accepted"] >= SAMPLES // 5 and tally["rejected_by_bridge"] >= SAMPLES // 3, tally
    assert tally["other_rejected"] <= SAMPLES // 20, tally
    assert RELEASES[release][3] <= set(tally["by_rule"]), tally["by_rule"]
    if release == "main":  # main's own steps were drawn: packing and Megatron-FSDP v2
        assert {"dataset.packing_buffer_size", "ddp.megatron_fsdp_version=2"} <= set(tally["drawn"]), tally["drawn"]


FAMILY_SAMPLES = 40


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_validator_agrees_with_megatron_bridge_on_every_familys_recipes(release):
    """`harness.bridge_family_fuzz`: random EP-overlap changes of each family's own recipes (GPT-OSS, Kimi K2, DeepSeek
    V3/V4, Qwen3 / Qwen3-Next, Nemotron 3, the Qwen VL MoEs, GLM-5) through Bridge's config path on the recipe's own
    provider, and through the validator: 0 missed, 0 false, the same EP switches, in every family."""
    proc = subprocess.run([_python(release), "-m", "mbridge_epoverlap.harness.bridge_family_fuzz", "--samples",
                           str(FAMILY_SAMPLES), "--examples"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=900)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    families = result["families"]
    assert set(families) == {"deepseek", "glm_moe_dsa", "gpt_oss", "kimi", "nemotronh", "qwen", "qwen_vl"}, families
    for family, tally in families.items():
        assert tally["release"]["bridge"] == release
        counts = (tally["tried"], tally["missed"], tally["false"], tally["switch_mismatch"])
        assert counts == (FAMILY_SAMPLES, 0, 0, 0), (family, result.get("examples"))
        assert tally["accepted"] >= 2 and tally["rejected_by_bridge"] - tally["other_rejected"] >= 2, (family, tally)
    assert proc.returncode == 0, proc.stderr[-2000:]
