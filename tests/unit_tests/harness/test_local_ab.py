"""End to end on this machine: a tiny `--ab ep_overlap` through the local executor and the reference runtime."""

from __future__ import annotations

import json

from mbridge_epoverlap.harness.results import REQUIRED_CASE_KEYS
from tests.unit_tests.harness.conftest import run_harness

CASES = ["ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"]
TINY = ("-g", "cpu", "-ng", "2", "--max_steps", "3", "-sl", "64")


def test_ep_overlap_ab_locally(tmp_path):
    out = tmp_path / "local" / "ab.json"
    done = run_harness("-m", "qwen", "-mr", "qwen3_30b_a3b", *TINY, "--ab", "ep_overlap", "--stable_window", "2:3",
                       "--results_json", str(out), timeout=240)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert {"recipe", "task", "gpu", "num_gpus", "environment", "cases"} <= set(data)
    assert (data["recipe"], data["gpu"], data["num_gpus"]) == ("qwen3_30b_a3b", "cpu", 2)
    assert [c["name"] for c in data["cases"]] == CASES
    for case in data["cases"]:
        assert set(REQUIRED_CASE_KEYS) <= set(case)
        assert len(case["step_times_s"]) == 3 and len(case["losses"]) == 3
        assert case["stable_window"] == [2, 3] and case["finite_loss"] is True
        assert case["skipped_iters"] == 0 and case["nan_iters"] == 0
        assert case["stable_mean_s"] > 0 and case["relative"] > 0
    base = data["cases"][0]
    assert base["relative"] == 1.0
    for case in data["cases"][1:]:
        assert case["losses"] == base["losses"]  # bitwise: JSON floats round-trip exactly
        assert case["loss_match_baseline"] is True
    assert data["environment"]["machine"]["cpus"] >= 1
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} |" in table for name in CASES) and "bitwise" in table
    assert "| ep_overlap_on |" in done.stdout  # the table is printed too
    assert "[run] ep_overlap_on (case 2/3, repeat 1/1" in done.stderr  # progress on stderr
    assert "Traceback" not in done.stderr


def test_failed_local_run_writes_nothing(tmp_path):
    out = tmp_path / "fail.json"
    done = run_harness(*TINY, "--ab", "ep_overlap", "env_vars.MBRIDGE_EPOVERLAP_FAULT=1:exit:2",
                       "--results_json", str(out), timeout=240)
    assert done.returncode == 1
    assert "ep_overlap_off (case 1/3, repeat 1/1, run 1/3) failed" in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() and not out.with_suffix(".md").exists() and not out.with_suffix(".png").exists()
    assert list(tmp_path.iterdir()) == []
