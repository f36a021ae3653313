"""Differential test with Megatron-Bridge 0.6.2's own config code (and Megatron-Core 0.19.2 under it) as the oracle.

A sample of `mbridge_epoverlap.config.bridge_fuzz`: random configurations go through Bridge's
`CommOverlapConfig` finalize + setup, `validate_flex_dispatcher_backend`, `validate_cuda_graph_configuration`
and the model's finalize on a CPU, and through the validator for the same environment; they must agree
(0 missed, 0 false rejections). Bridge needs Python 3.12, so the sample runs in the environment
`scripts/setup_bridge_venv.sh` builds, named by `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`; without it the test is
skipped. The full run is the `bridge_fuzz` benchmark (`make bench`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.unit_tests.requirements import require_or_skip

REPO = Path(__file__).resolve().parents[3]
PYTHON = os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON")
SAMPLES = 150



@pytest.fixture(autouse=True)
def _bridge_python() -> None:
    if not PYTHON or not Path(PYTHON).exists():
        require_or_skip("bridge", "set MBRIDGE_EPOVERLAP_BRIDGE_PYTHON (scripts/setup_bridge_venv.sh builds it)")


def test_validator_agrees_with_megatron_bridge():
    proc = subprocess.run([PYTHON, "-m", "mbridge_epoverlap.config.bridge_fuzz", "--samples", str(SAMPLES),
                           "--seed", "20261201", "--examples"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=900)
    tally = json.loads(proc.stdout)
    assert (tally["missed"], tally["false"], tally["false_on_object"]) == (0, 0, 0), tally["examples"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Both verdicts must be common, and the new rules exercised, or the test proves nothing.
    assert tally["accepted"] >= SAMPLES // 5 and tally["rejected_by_bridge"] >= SAMPLES // 3, tally
    assert tally["other_rejected"] <= SAMPLES // 20, tally
    assert {"ncclep_needs_flex", "delay_graph_grad_accum", "cuda_graph_local_scoped", "delay_te_grad_reduce"} <= set(
        tally["by_rule"]), tally["by_rule"]
