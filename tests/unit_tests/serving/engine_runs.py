"""Helpers of the multi-process serving tests: requests from prompts, and what a run left behind."""

from __future__ import annotations

import glob
import os

from mbridge_epoverlap.serving.workers.requests import Request


def requests_of(prompts):
    """One request per prompt, ids p0, p1, ..."""
    return [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]


def leftovers(pids):
    """(processes among `pids` still alive, shared-memory segments they created that still exist)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive, [p for pid in pids for p in glob.glob(f"/dev/shm/mbe-m2n-{pid}-*")]
