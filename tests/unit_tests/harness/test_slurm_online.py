"""run_script.py --task serve: the online server as one Slurm job, front end on the first node, workers by rank."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest

from tests.unit_tests.harness.conftest import run_harness

SERVE = ("--task", "serve", "-ng", "2", "--attn_workers", "1", "--micro_batches", "2", "-gb", "8",
         "--executor", "slurm", "-t", "00:05:00")


def test_dry_run_starts_the_front_end_then_srun_the_workers_from_its_plan(tmp_path):
    done = run_harness(*SERVE, "--dryrun", "--results_json", str(tmp_path / "serve.json"))
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert "#SBATCH --ntasks=2" in script
    assert "ranks 0..0 attention workers, ranks 1..1 expert workers" in script
    front = script.index("mbridge_epoverlap.cli serve -mr")
    workers = script.index("mbridge_epoverlap.serving.engine.worker_main")
    assert front < script.index("srun --ntasks=2") < workers
    assert '--workers-plan "$PLAN"' in script and '--worker-host "$MASTER_IP"' in script
    assert "--attn-workers 1 --expert-workers 1 --micro-batches 2 --max-batch 8" in script


def test_serve_refuses_the_local_executor(tmp_path):
    done = run_harness("--task", "serve", "--executor", "local", "--results_json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "mbridge-epoverlap serve -mr RECIPE --http" in done.stderr


@pytest.mark.slurm
def test_the_server_job_answers_a_completion(slurm_cluster, tmp_path):
    openai = pytest.importorskip("openai")
    done = run_harness(*SERVE, "--results_json", str(tmp_path / "serve.json"), env=slurm_cluster.env, timeout=600)
    assert done.returncode == 0, done.stderr + slurm_cluster.log_tail()
    job = re.search(r"serving: job (\d+), http://<first node>:(\d+)", done.stdout)
    assert job, done.stdout
    job_id, port = job.groups()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        answer = client.completions.create(model="qwen3_30b_a3b", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert 1 <= len(answer.choices[0].model_extra["token_ids"]) <= 4
    finally:
        subprocess.run(["scancel", job_id], env=slurm_cluster.env, check=False, timeout=30)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the job drains and ends
            state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=slurm_cluster.env,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            if not state:
                break
            time.sleep(1.0)
    _until_closed(int(port))


def _until_closed(port: int, timeout_s: float = 60.0) -> None:
    """The server drained and left: nothing listens on its port any more."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        assert time.monotonic() < deadline, f"the server still listens on port {port} after scancel"
        time.sleep(0.5)
