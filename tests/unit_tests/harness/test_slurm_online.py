"""run_script.py --task serve: the online server as one Slurm job, front end on the first node, workers by rank."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

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


def _worker_pid(rank: int) -> int | None:
    """The pid of the srun-started serving worker of `rank` (its environment's SLURM_PROCID), if it runs."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mbridge_epoverlap.serving.engine.worker_main" in argv and f"SLURM_PROCID={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.slurm
def test_a_lost_srun_worker_ends_the_server_non_zero_and_the_job(slurm_cluster, tmp_path):
    """An srun-started expert worker SIGKILLed (no --elastic): the attention worker tells the front end which
    peer it lost as it leaves, the front end says so, exits non-zero and the job ends, so that whoever watches
    it can start it again."""
    openai = pytest.importorskip("openai")
    done = run_harness(*SERVE, "--results_json", str(tmp_path / "serve.json"), env=slurm_cluster.env, timeout=600)
    assert done.returncode == 0, done.stderr + slurm_cluster.log_tail()
    job_id, port = re.search(r"serving: job (\d+), http://<first node>:(\d+)", done.stdout).groups()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
        answer = client.completions.create(model="qwen3_30b_a3b", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason == "length"  # serving
        expert = _worker_pid(1)
        assert expert is not None, "the expert worker (rank 1) is not running"
        os.kill(expert, signal.SIGKILL)
        _until_job_ends(slurm_cluster, job_id)
        log = next((tmp_path / "serve.slurm").glob("slurm-*.out")).read_text()
        exited = re.search(r"serve: the server exited with (\d+)", log)
        assert exited and exited.group(1) == "1", log
        # The attention worker saw its peer go and said so as it left (else: every one left unasked).
        error = re.search(r"^error: (.*)$", log, re.MULTILINE)
        assert error and ("expert worker 0" in error.group(1) or "left unasked" in error.group(1)), log
    finally:
        subprocess.run(["scancel", job_id], env=slurm_cluster.env, check=False, timeout=30)
    _until_closed(int(port))


def _until_job_ends(cluster, job_id: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=cluster.env, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if not state:
            return
        assert time.monotonic() < deadline, f"job {job_id} still {state} {timeout_s:.0f} s after its worker died"
        time.sleep(1.0)
