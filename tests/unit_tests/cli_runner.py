"""Runs `mbridge-epoverlap` in a subprocess, the way a user does, for the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m mbridge_epoverlap.cli ARGS` from the repository root, with a wide terminal."""
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "mbridge_epoverlap.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)
