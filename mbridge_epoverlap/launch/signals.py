"""Signals the supervisor handles: SIGTERM/SIGHUP turned into an exception (so cleanup runs), a signal sent
to a whole process group (a process and whatever it started), and a started server stopped as its user would
(SIGTERM, then SIGKILL to its group)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an exception so that cleanup (`finally`) runs."""


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise `Interrupted` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted(f"received signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to the process group led by `pid`; a group that is gone (or not ours) is ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one owned by another user counts: signalling it is merely refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_gracefully(proc: subprocess.Popen[Any], grace_s: float) -> int | None:
    """SIGTERM `proc` (a server drains on it), and SIGKILL its process group (started with
    `start_new_session=True`) if it has not exited within `grace_s`; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode
