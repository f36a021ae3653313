"""Scheduling priority for communication threads on CPU.

On a machine whose cores are all busy computing (every rank runs one compute thread per core), a
collective progresses only when its threads (gloo's transport loop and workers, and the rank's own
communication thread) get a core. At normal priority they wait their turn behind the compute threads,
so an all-to-all that should run under compute stretches out and shows up as wait time. Giving them a
higher priority lets them preempt compute for the short moments they need, which is what a
high-priority communication stream does on a GPU. Needs root (or CAP_SYS_NICE); without it nothing
changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

COMM_THREAD_PREFIXES = ("gloo", "pt_gloo")


def comm_thread_ids(prefixes: tuple[str, ...] = COMM_THREAD_PREFIXES) -> list[int]:
    """Native ids of this process's threads whose name starts with one of `prefixes`."""
    ids = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip().startswith(prefixes):
                ids.append(int(task.name))
    return ids


def raise_comm_priority(nice: int, *, extra_thread_ids: tuple[int, ...] = (),
                        prefixes: tuple[str, ...] = COMM_THREAD_PREFIXES) -> int:
    """Set the nice value of the communication threads (named by `prefixes`, plus `extra_thread_ids`) to
    `nice` (< 0 raises priority); return how many threads changed. Does nothing where not permitted or
    not on Linux."""
    if nice == 0 or not Path("/proc/self/task").is_dir():
        return 0
    changed = 0
    for tid in [*comm_thread_ids(prefixes), *extra_thread_ids]:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            changed += 1
        except OSError as exc:
            logger.debug("cannot renice thread %d: %s", tid, exc)
            break
    return changed
