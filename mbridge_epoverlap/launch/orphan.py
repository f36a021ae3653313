"""A started process leaves when the process that started it is gone.

The supervisor kills its processes when it fails or is interrupted, but not when it is SIGKILLed (or
crashes without cleanup): then its processes are re-parented and, if nothing they wait on times out (an online
server's idle workers wait for requests that will never come), live on. Each rank therefore watches its
supervisor and exits when it is gone: the supervisor need not be its parent (a rank forked by the launcher's
`zygote` is the zygote's child), so the watch holds a pidfd of the supervisor, which no later process can reuse.
Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable

from mbridge_epoverlap.errors import EXIT_FAILED

# Set by the supervisor (`processes.base_env`): a process that starts after the supervisor died already has
# another parent, so the parent at start-up is no witness.
SUPERVISOR_PID_ENV = "MBRIDGE_EPOVERLAP_SUPERVISOR_PID"


def exit_when_orphaned(on_exit: Callable[[], None] | None = None, *, poll_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that, once this process's parent is gone, runs `on_exit` (best effort: release
    what others could trip over, such as shared memory) and exits with `EXIT_FAILED`. The parent is the pid in
    `SUPERVISOR_PID_ENV` when set, else the parent at the call."""
    parent = int(os.environ.get(SUPERVISOR_PID_ENV) or os.getppid())
    try:
        supervisor: int | None = os.pidfd_open(parent)
    except ProcessLookupError:  # gone already
        supervisor = -1
    except (OSError, AttributeError):  # no pidfd here (Linux before 5.3): watch the parent as it is now
        supervisor = None

    def watch() -> None:
        if supervisor is None:
            while os.getppid() == parent:
                time.sleep(poll_s)
        elif supervisor >= 0:
            select.select([supervisor], [], [])  # readable once the supervisor has exited
        print(f"the process that started this one (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        if on_exit is not None:
            with contextlib.suppress(Exception):
                on_exit()
        os._exit(EXIT_FAILED)

    thread = threading.Thread(target=watch, name="orphan-watch", daemon=True)
    thread.start()
    return thread
