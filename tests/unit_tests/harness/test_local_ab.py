"""End to end on this machine: a tiny `--ab ep_overlap` through the local executor and the reference runtime."""

from __future__ import annotations

import json
import os

from mbridge_epoverlap.harness.results import REQUIRED_CASE_KEYS
from mbridge_epoverlap.machine import CPU_FLAGS_ENV
from tests.unit_tests.harness.conftest import run_harness

CASES = ["ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"]
TINY = ("-g", "cpu", "-ng", "2", "--max_steps", "3", "-sl", "64")


def test_ep_overlap_ab_locally(tmp_path):
    """As on a CPU without native bf16: the runtime computes in fp32, and the cases must still agree bitwise.
    -pyp true (Megatron-Bridge's flag) records Kineto traces on -g cpu; the analyzer reads them into the table."""
    out = tmp_path / "local" / "ab.json"
    done = run_harness("-m", "qwen", "-mr", "qwen3_30b_a3b", *TINY, "--ab", "ep_overlap", "--stable_window", "2:3",
                       "-pyp", "true", "--results_json", str(out), env={**os.environ, CPU_FLAGS_ENV: "avx avx2 fma"},
                       timeout=240)
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
    assert data["environment"]["machine"]["cpu_flags"] == ["avx2"]
    assert data["environment"]["compute_dtype"]["dtype"] == "fp32"
    assert all(case["launch_env"]["MBRIDGE_EPOVERLAP_DTYPE"] == "fp32" for case in data["cases"])
    assert "computes in fp32" in done.stderr and "computed in fp32" in done.stdout
    for case in data["cases"]:  # the runtime timed every step and collective, and the simulator replayed them
        assert case["schedule"]["micro_batches"] >= 1 and case["schedule_time_s"] > 0
        assert {"attn", "experts_wgrad", "dispatch", "dispatch.issue", "dispatch.wait"} <= set(case["stage_costs_s"])
        assert case["predicted"]["step_s"] > 0 and 0 <= case["predicted"]["hidden_upper_bound"] <= 1
        # Each rank's own account of exposed and collective time gives the measured hidden share.
        assert 0 <= case["comm_hidden_worst_rank"] <= case["comm_hidden"] <= 1
        assert case["predicted"]["measured_hidden_fraction"] == case["comm_hidden"]
    assert base["comm_hidden"] < 0.5  # without overlap every collective is waited for right after its issue
    for case in data["cases"]:  # the traces, read by the analyzer
        assert case["trace_dir"] and 0 <= case["comm_hidden_pct"] <= 100, case
        assert case["exposed_comm_per_iter_s"] > 0
    assert data["cases"][1]["comm_hidden_pct"] > base["comm_hidden_pct"]
    assert "### Simulator against the measurement" in done.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} |" in table for name in CASES) and "bitwise" in table
    assert "comm hidden % (trace)" in table and "exposed comm / iter (trace)" in table
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
