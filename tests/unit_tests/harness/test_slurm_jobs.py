"""Jobs on a real (private, one-node) Slurm cluster: submit, follow, collect; failures; detached jobs."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.unit_tests.harness.conftest import run_harness

pytestmark = pytest.mark.slurm

TINY_CPU = ("-g", "cpu", "-ng", "2", "--max_steps", "3", "-sl", "64", "--executor", "slurm", "-t", "00:05:00")


def test_cpu_job_runs_and_reports(slurm_cluster, tmp_path):
    out = tmp_path / "slurm" / "run.json"
    done = run_harness(*TINY_CPU, "--results_json", str(out), env=slurm_cluster.env, timeout=240)
    assert done.returncode == 0, done.stderr + slurm_cluster.log_tail()
    data = json.loads(out.read_text())
    assert data["executor"] == "slurm" and data["gpu"] == "cpu" and data["num_gpus"] == 2
    (case,) = data["cases"]
    assert case["name"] == "run" and len(case["step_times_s"]) == 3 and len(case["losses"]) == 3
    assert case["finite_loss"] is True and case["relative"] == 1.0 and case["peak_mem_bytes"] > 0
    assert data["environment"]["machine"]["hostname"]  # filled in on the node
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert re.search(r"\[slurm\] submitted job \d+", done.stderr)
    assert "[job] case run repeat 1: start" in done.stderr  # progress forwarded from the job
    assert "| run |" in done.stdout
    job_dir = out.with_suffix(".slurm")
    assert (job_dir / "job.sbatch").exists() and (job_dir / "runs" / "run_r1.json").exists()


def test_failing_cpu_job(slurm_cluster, tmp_path):
    out = tmp_path / "fail.json"
    done = run_harness(*TINY_CPU, "env_vars.MBRIDGE_EPOVERLAP_FAULT=1:exit:2", "--results_json", str(out),
                       env=slurm_cluster.env, timeout=240)
    assert done.returncode == 1
    assert re.search(r"error: Slurm job \d+ FAILED", done.stderr), done.stderr
    assert "full log:" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() and not out.with_suffix(".md").exists()


def test_gpu_job_without_megatron_bridge(slurm_cluster, tmp_path):
    out = tmp_path / "gpu.json"
    done = run_harness("-g", "h100", "-ng", "2", "-gn", "2", "-ep", "2", "--te_version", "2.9", "--max_steps", "3",
                       "-t", "00:05:00", "--results_json", str(out), env=slurm_cluster.env, timeout=180)
    assert done.returncode == 1
    assert "Megatron-Bridge is not importable" in done.stderr, done.stderr + slurm_cluster.log_tail()
    assert "exit code 3" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_detached_job_leaves_results(slurm_cluster, tmp_path):
    out = tmp_path / "detached.json"
    done = run_harness(*TINY_CPU, "--detach", "--results_json", str(out), env=slurm_cluster.env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"submitted job \d+ \(detached\)", done.stderr)
    assert f"results will appear at {out}" in done.stdout
    deadline = time.monotonic() + 180
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert out.exists(), slurm_cluster.log_tail()
    assert json.loads(out.read_text())["cases"][0]["name"] == "run"
