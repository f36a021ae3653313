"""Slurm executor: write the job directory, submit with `sbatch --parsable`, follow the job, read results.

Following polls `scontrol show job` (then `squeue`, then `sacct`, whichever answers), forwards the job's
progress lines, and gives up once the job has waited in the queue for its time limit or run past it.
The job itself builds the results JSON as its last step, so a detached job leaves the same results.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.harness.cases import Case
from mbridge_epoverlap.harness.executors.slurm_script import MARKER, JobShape, ScriptOptions, render_script
from mbridge_epoverlap.harness.experiment import Experiment

Progress = Callable[[str], None]
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                 "STAGE_OUT", "SIGNALING", "REQUEUE_HOLD", "REQUEUE_FED"}
QUEUED_STATES = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED"}
PROGRESS_LINE_RE = re.compile(r"\biteration\s+\d+\s*/\s*\d+|\berror\b", re.IGNORECASE)
ERROR_LINE_RE = re.compile(r"(^|\s)(error:|\w*Error\b|\w*Exception\b)", re.IGNORECASE)
GRACE_S = 60.0
COMMAND_TIMEOUT_S = 30.0


@dataclass
class JobFiles:
    """The written job directory."""

    job_dir: Path
    script: Path
    plan: Path
    script_text: str


@dataclass
class JobStatus:
    state: str | None
    exit_code: str | None = None
    reason: str | None = None


@dataclass
class SlurmExecutor:
    """Runs an experiment as one Slurm job.

    Attributes:
        options: sbatch settings and paths.
        shape: tasks and nodes.
        detach: return right after submission.
        poll_s: longest wait between status polls (the first polls come sooner).
        progress: receives one line per event (stderr in the CLI).
    """

    options: ScriptOptions
    shape: JobShape
    detach: bool = False
    poll_s: float = 2.0
    progress: Progress = field(default=lambda line: None)

    def prepare(self, exp: Experiment, cases: list[Case]) -> JobFiles:
        """Write configs, plan and sbatch script into a clean job directory."""
        job_dir = self.options.job_dir
        for sub in ("configs", "runs", "traces"):
            shutil.rmtree(job_dir / sub, ignore_errors=True)  # stale outputs must never pass for new ones
        (job_dir / "configs").mkdir(parents=True, exist_ok=True)
        (job_dir / "runs").mkdir(parents=True, exist_ok=True)
        for case in cases:
            (job_dir / "configs" / f"{case.name}.yaml").write_text(case.cfg.to_yaml())
            if exp.gpu != "cpu":  # what the Megatron-Bridge job changes on the recipe it builds
                (job_dir / "configs" / f"{case.name}.changes.json").write_text(
                    json.dumps(case.changes, indent=2, sort_keys=True))
        for record in exp.cases:
            record.config_path = str(job_dir / "configs" / f"{record.name}.yaml")
        plan = job_dir / "plan.json"
        exp.save(plan)
        text = render_script(exp, cases, self.shape, self.options)
        script = job_dir / "job.sbatch"
        script.write_text(text)
        script.chmod(0o755)
        return JobFiles(job_dir, script, plan, text)

    def submit(self, files: JobFiles) -> str:
        """Submit the script; return the job id.

        Raises:
            RunFailedError: no sbatch on PATH, or sbatch rejected the job.
        """
        sbatch = require_tool("sbatch")
        proc = _run([sbatch, "--parsable", str(files.script)], cwd=files.job_dir)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"
            raise RunFailedError(f"sbatch rejected the job: {detail}")
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise RunFailedError(f"sbatch returned {proc.stdout.strip()!r}, not a job id")
        return job_id

    def run(self, exp: Experiment, files: JobFiles) -> dict[str, Any] | None:
        """Submit and, unless detached, follow the job and return the results it wrote.

        Raises:
            RunFailedError: submission failed, the job failed, or it outlived the follow bound.
        """
        job_id = self.submit(files)
        log = files.job_dir / f"slurm-{job_id}.out"
        if self.detach:
            self.progress(f"[slurm] submitted job {job_id} (detached); log {log}")
            return None
        self.progress(f"[slurm] submitted job {job_id}; log {log}")
        status = self.follow(job_id, log)
        results_path = Path(exp.results_json)
        if status.state == "COMPLETED" and results_path.is_file():
            return json.loads(results_path.read_text())
        raise RunFailedError(self.failure_message(job_id, status, log, results_path))

    def follow(self, job_id: str, log: Path) -> JobStatus:
        """Poll until the job leaves the queue; forward its progress lines."""
        limit = float(self.options.time_limit.seconds)
        submitted = time.monotonic()
        started: float | None = None
        offset = 0
        polls = 0
        last_state: str | None = None
        while True:
            status = job_status(job_id)
            offset = self._forward(log, offset)
            state = status.state
            if state != last_state and state is not None:
                reason = f" ({status.reason})" if status.reason and status.reason != "None" else ""
                self.progress(f"[slurm] job {job_id} {state}{reason}")
                last_state = state
            if state is None or state not in ACTIVE_STATES:
                break
            now = time.monotonic()
            if state in QUEUED_STATES:
                if now - submitted > limit + GRACE_S:
                    raise RunFailedError(
                        f"Slurm job {job_id} is still {state} after {int(now - submitted)} s (its time limit); "
                        f"it keeps its place in the queue and writes its results when it runs (scancel {job_id} "
                        "to drop it)")
            else:
                started = started or now
                if now - started > limit + GRACE_S:
                    raise RunFailedError(f"Slurm job {job_id} is still {state} {int(now - started)} s after it "
                                         f"started, past its time limit {self.options.time_limit.text}; see {log}")
            # Quick first polls catch jobs that fail at once; then settle at poll_s.
            time.sleep(min(self.poll_s, 0.5 * 2 ** min(polls, 6)))
            polls += 1
        self._forward(log, offset)
        return status

    def _forward(self, log: Path, offset: int) -> int:
        """Print the job log's new progress lines; return the new offset."""
        try:
            with log.open("rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
        except OSError:
            return offset
        end = chunk.rfind(b"\n")
        if end < 0:
            return offset
        for raw in chunk[: end + 1].decode(errors="replace").splitlines():
            line = raw.strip()
            if line.startswith(MARKER):
                self.progress("[job] " + line[len(MARKER):].strip())
            elif PROGRESS_LINE_RE.search(line) and len(line) < 300:
                self.progress("[job]   " + line)
        return offset + end + 1

    def failure_message(self, job_id: str, status: JobStatus, log: Path, results_path: Path) -> str:
        """Why job `job_id` gave no results: its Slurm state and exit code and the log's last error line."""
        state = status.state or "ended (no longer known to Slurm)"
        exit_code = f", exit code {status.exit_code}" if status.exit_code else ""
        detail = last_error_line(log)
        if status.state == "COMPLETED":
            return f"Slurm job {job_id} completed but wrote no results at {results_path}; see {log}"
        where = f": {detail}" if detail else ""
        return f"Slurm job {job_id} {state}{exit_code}{where}; full log: {log}"


def job_shape(num_tasks: int, per_node: int, *, gpus: bool) -> JobShape:
    """Nodes and tasks for `num_tasks` ranks, `per_node` to a node.

    Raises:
        UsageError: ranks that do not fill whole nodes (nodes would hold different numbers of ranks).
    """
    if num_tasks > per_node and num_tasks % per_node:
        raise UsageError(f"-ng {num_tasks} is not a multiple of -gn {per_node}: Slurm nodes would hold different "
                         "numbers of ranks; change -ng or -gn")
    return JobShape(num_tasks=num_tasks, tasks_per_node=min(per_node, num_tasks), gpus=gpus)


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RunFailedError(f"{name} not found on PATH: --executor slurm needs the Slurm client tools (sbatch, "
                             "squeue, scontrol) on this machine; run on a login node, or use -g cpu --executor local")
    return path


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=COMMAND_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RunFailedError(f"{' '.join(cmd[:2])} did not answer within {COMMAND_TIMEOUT_S:.0f} s") from None
    except OSError as exc:
        raise RunFailedError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None


def job_status(job_id: str) -> JobStatus:
    """The job's state from scontrol, else squeue, else sacct; state None when nobody knows the job."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        proc = _run([scontrol, "show", "job", "-o", job_id])
        if proc.returncode == 0 and "JobState=" in proc.stdout:
            fields = dict(item.split("=", 1) for item in proc.stdout.split() if "=" in item)
            return JobStatus(fields.get("JobState"), fields.get("ExitCode"), fields.get("Reason"))
    squeue = shutil.which("squeue")
    if squeue:
        proc = _run([squeue, "-h", "-j", job_id, "-o", "%T|%r"])
        if proc.returncode == 0 and proc.stdout.strip():
            state, _, reason = proc.stdout.strip().splitlines()[0].partition("|")
            return JobStatus(state, None, reason or None)
    sacct = shutil.which("sacct")
    if sacct:
        proc = _run([sacct, "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
        if proc.returncode == 0 and proc.stdout.strip():
            state, _, code = proc.stdout.strip().splitlines()[0].partition("|")
            return JobStatus(state.split()[0] if state else None, code or None)
    return JobStatus(None)


def last_error_line(log: Path, max_len: int = 400) -> str | None:
    """The most telling line of a failed job's log: its last error line, else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    errors = [line for line in lines if ERROR_LINE_RE.search(line) and not line.startswith("Traceback")]
    pick = errors[-1] if errors else (lines[-1] if lines else None)
    if pick is None:
        return None
    return pick if len(pick) <= max_len else pick[: max_len - 3] + "..."
