"""`scripts/gpu_smoke.py`, the prepared check for a GPU machine, rehearsed on CPU (this machine has no GPU).

The rehearsal runs every step the GPU run does (self-check, A/B, profile) with real gloo ranks, so the
script cannot rot between the rare sessions that have a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_smoke.py"
pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280)


def test_rehearsal_on_cpu_passes_every_step(tmp_path):
    done = _run("--out", str(tmp_path), "--device", "cpu", "--tiny", "--steps", "3", "--timeout", "120")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [summary[s]["passed"] for s in ("self_check", "ab", "profile")] == [True, True, True]
    assert summary["self_check"]["failures"] == []
    cases = summary["ab"]["cases"]
    assert list(cases) == ["ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"]
    assert cases["ep_overlap_on"]["losses"] == cases["ep_overlap_off"]["losses"]
    assert summary["profile"]["comm_ms"] > 0
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
    assert "| ep_overlap_on |" in done.stdout and "all steps passed" in done.stdout


def test_cuda_requested_without_a_gpu_is_a_usage_error(tmp_path):
    done = _run("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "CUDA is not available here" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    assert _run("--out", str(tmp_path), "--procs", "1").returncode == 2
