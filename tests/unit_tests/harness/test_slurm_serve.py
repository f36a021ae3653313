"""run_script.py --task serve_bench: the sbatch script places roles by rank; the one-node cluster runs it."""

from __future__ import annotations

import json

import pytest

from tests.unit_tests.harness.conftest import run_harness

SERVE = ("--task", "serve_bench", "-ng", "2", "--attn_workers", "1", "--micro_batches", "2", "-gb", "4", "-ms", "3",
         "--executor", "slurm", "-t", "00:05:00")


def test_dry_run_shows_the_script_with_roles_by_rank(tmp_path):
    out = tmp_path / "serve.json"
    done = run_harness(*SERVE, "--dryrun", "--results_json", str(out))
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert "#SBATCH --ntasks=2" in script
    assert "ranks 0..0 attention workers, ranks 1..1 expert workers" in script
    assert "srun --ntasks=2" in script and "mbridge_epoverlap.serving.engine.worker_main" in script
    assert "mbridge_epoverlap.serving.engine.collect" in script
    plan = json.loads((tmp_path / "serve.slurm" / "plan.json").read_text())
    assert plan["attn_workers"] == 1 and plan["expert_workers"] == 1 and plan["micro_batches"] == 2
    assert not out.exists()


def test_bad_serving_layout_exits_2(tmp_path):
    done = run_harness("--task", "serve_bench", "-ng", "2", "--attn_workers", "2", "--dryrun",
                       "--results_json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "--attn_workers 2 leaves no expert worker" in done.stderr


@pytest.mark.slurm
def test_serve_bench_job_runs_on_the_cluster(slurm_cluster, tmp_path):
    out = tmp_path / "serve.json"
    done = run_harness(*SERVE, "--results_json", str(out), env=slurm_cluster.env, timeout=300)
    assert done.returncode == 0, done.stderr + slurm_cluster.log_tail()
    result = json.loads(out.read_text())
    assert result["matches_reference"] is True
    assert result["mode"] == "disaggregated" and result["generated_tokens"] == 4 * 3
