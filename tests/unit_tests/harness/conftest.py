"""Fixtures of the harness tests: a private one-node Slurm cluster, and helpers to run the harness.

The cluster (munge with its own key and socket, slurmctld + slurmd, state in a temp folder, free
ports) serves only these tests: clients reach it through SLURM_CONF. It needs root and Debian's
slurm-wlm + munge (`scripts/setup_system_deps.sh`, run by `make test`); without them the tests that
use it skip with the reason. Teardown cancels its jobs and stops the daemons it started, by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit_tests.requirements import require_or_skip

REPO = Path(__file__).resolve().parents[3]
RUN_SCRIPT = REPO / "scripts" / "performance" / "run_script.py"
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "scancel", "srun")
READY_TIMEOUT_S = 45.0
FAKE_GPUS = 2  # count-only GPU gres, so GPU-target job scripts (with --gpus-per-node) can be scheduled


@dataclass
class SlurmCluster:
    """A running private cluster."""

    root: Path
    conf: Path
    node: str

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stop(pid: int | None, timeout_s: float = 10.0) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_for(predicate, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def _write_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> Path:
    munge_socket = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=epoverlap-test",
        f"SlurmctldHost={node}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"AuthInfo=socket={munge_socket}",
        "CredType=cred/munge",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        "GresTypes=gpu",
        f"NodeName={node} CPUs={os.cpu_count() or 1} RealMemory={_memory_mb()} Gres=gpu:{FAKE_GPUS} State=UNKNOWN",
        f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    # Count-only GPU gres is not accepted for "gpu"; plain files stand in for the device nodes
    # (task/none confines nothing, so nobody opens them).
    for index in range(FAKE_GPUS):
        (root / "fake-gpu" / f"gpu{index}").touch()
    files = f"{root / 'fake-gpu'}/gpu[0-{FAKE_GPUS - 1}]"
    (root / "gres.conf").write_text(f"AutoDetect=off\nNodeName={node} Name=gpu File={files}\n")
    return conf


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A one-node Slurm cluster for this test session (skips where it cannot be started)."""
    if os.geteuid() != 0:
        require_or_skip("slurm", "the private Slurm cluster needs root (slurmd runs jobs as root here)")
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        require_or_skip("slurm", f"Slurm/munge binaries missing: {', '.join(missing)} "
                                 "(scripts/setup_system_deps.sh installs them)")
    root = Path(tempfile.mkdtemp(prefix="epoverlap-slurm-"))
    for sub in ("state", "spool", "log", "munge", "fake-gpu"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = _write_conf(root, node, *_free_ports(2))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(root, conf, node)
    munge_socket = root / "munge" / "munge.socket"
    try:
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={munge_socket}",
                        f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
                        f"--seed-file={root / 'munge' / 'seed'}"], check=True, timeout=30, capture_output=True)
        subprocess.run(["slurmctld", "-c", "-i"], env=env, check=True, timeout=30, capture_output=True)
        subprocess.run(["slurmd", "-c"], env=env, check=True, timeout=30, capture_output=True)

        def idle() -> bool:
            proc = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
            return proc.returncode == 0 and proc.stdout.strip() == "idle"

        if not _wait_for(idle, READY_TIMEOUT_S):
            pytest.fail(f"private Slurm node did not become idle within {READY_TIMEOUT_S:.0f} s\n{cluster.log_tail()}")
        yield cluster
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"starting the private Slurm cluster failed: {' '.join(exc.cmd[:1])}: "
                    f"{(exc.stderr or b'').decode(errors='replace')}\n{cluster.log_tail()}")
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=10, check=False)
        _wait_for(lambda: not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True,
                                             timeout=10).stdout.strip(), 15.0)
        _stop(_pid(root / "slurmd.pid"))
        _stop(_pid(root / "slurmctld.pid"))
        _stop(_pid(root / "munge" / "munged.pid"))
        if not os.environ.get("EPOVERLAP_KEEP_SLURM"):
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def run_harness(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                timeout: float = 180.0) -> Completed:
    """`python scripts/performance/run_script.py ARGS` as a user would run it (a separate process)."""
    proc = subprocess.run([sys.executable, str(RUN_SCRIPT), *args], capture_output=True, text=True,
                          env=env if env is not None else dict(os.environ), cwd=cwd or REPO, timeout=timeout)
    return Completed(proc.returncode, proc.stdout, proc.stderr)


