"""A started process leaves when its supervisor is SIGKILLed (nothing else would end an idle one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# The "supervisor" starts a child that watches it and would otherwise sleep for ten minutes, prints the
# child's pid, and waits; the test SIGKILLs the supervisor.
SUPERVISOR = """
import os, subprocess, sys
env = dict(os.environ, MBRIDGE_EPOVERLAP_SUPERVISOR_PID=str(os.getpid()))  # as launch.base_env sets it
child = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True, env=env)
print(child.pid, flush=True)
child.wait()
"""
CHILD = """
import time
from mbridge_epoverlap.launch.orphan import exit_when_orphaned
exit_when_orphaned(lambda: open(MARK, "w").write("released"), poll_s=0.05)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it has exited all the same.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_a_process_exits_and_releases_when_its_supervisor_is_killed(tmp_path):
    mark = tmp_path / "released"
    child = CHILD.replace("MARK", repr(str(mark)))
    code = f"CHILD = {child!r}\n{SUPERVISOR}"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    supervisor = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    child_pid = int(supervisor.stdout.readline())
    assert _alive(child_pid)
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=30)
    deadline = time.monotonic() + 60
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(child_pid):
        os.kill(child_pid, signal.SIGKILL)
        raise AssertionError("the orphaned process did not exit after its supervisor was killed")
    assert mark.read_text() == "released"
