"""The processes of one run, one per rank: start them, supervise them, replace expendable ones, and
always kill what is left.

When a rank fails the others get a few seconds (`GRACE_S`) to notice before they are killed. Failures
name the rank that caused them, using exit codes and the ranks' heartbeats (`heartbeat`): a rank that
exited by itself or stopped while computing is the cause; ranks that failed inside a collective were
waiting for it. A message says where each rank was, "(after training)" or "(after serving)": the
supervisor is told what its processes do (`activity`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from mbridge_epoverlap.errors import EXIT_COMM, RunFailedError
from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.launch.signals import signal_group
from mbridge_epoverlap.launch.zygote import ZygoteProcess, zygote_for

GRACE_S = 5.0  # after one rank fails, how long the others get to exit on their own
PROGRESS_POLL_S = 0.05  # how often the supervisor forwards rank 0's progress lines, when it forwards them
# Without progress to forward, the supervisor sleeps until a rank exits (a pidfd per rank wakes it at once), looking
# at the ranks at least this often: waking every 50 ms instead cost an idle server's engine thread CPU for nothing.
IDLE_POLL_S = 1.0
TAIL_LINES = 15  # stderr lines of a failed rank shown in the failure message
DEFAULT_ACTIVITY = "its work"  # what the processes do, when the caller does not say


# Rank 0's inherited listening socket of the rendezvous (read by `comm.store.open_store`): a port picked free and
# closed again can be taken by another run's rank 0 before this one's binds it (two runs at once then share a
# store); a socket that stays bound from the pick to the store's start cannot.
STORE_FD_ENV = "MBRIDGE_EPOVERLAP_STORE_FD"

def _forked(command: list[str], env: dict[str, str], out: IO[bytes], err: IO[bytes],
            inherited: tuple[int, ...]) -> ZygoteProcess | None:
    """`command` forked from this launcher's zygote (`zygote`), or None where it starts as a new interpreter."""
    zygote = zygote_for(command, env)
    if zygote is None:
        return None
    try:
        return zygote.spawn(command, env, stdout=out, stderr=err, pass_fds=inherited)
    except OSError:
        return None


@dataclass
class Rank:
    """One process of a rank (the first, or a replacement) and its output files."""

    rank: int
    proc: subprocess.Popen[bytes] | ZygoteProcess
    out: IO[bytes]
    err: IO[bytes]
    out_path: Path
    err_path: Path
    killed: bool = False
    read_pos: int = 0
    generation: int = 0  # 0: the first process of this rank; G: its G-th replacement
    replaced: bool = False


class Ranks:
    """The rank processes of one run: start, supervise, diagnose, and always kill what is left.

    Args:
        workdir: where each rank's stdout/stderr (`rank<R>.out/.err`) and heartbeat files live.
        names: how failure messages name a rank (e.g. "expert worker 1 (rank 3)"); "rank N" otherwise.
        expendable: ranks whose failure the run survives.
        respawn: `(rank, generation) -> argv or None`, a replacement for a failed expendable rank.
        on_respawn: called with a replacement's process id.
        activity: what the processes do, as failure messages say it ("training": "(after training)").
    """

    def __init__(self, workdir: Path, names: Mapping[int, str] | None = None,
                 expendable: Collection[int] = (), respawn: Callable[[int, int], list[str] | None] | None = None,
                 on_respawn: Callable[[list[int]], None] | None = None, *, activity: str = DEFAULT_ACTIVITY) -> None:
        self.workdir = workdir
        self.ranks: list[Rank] = []
        self.names = dict(names or {})
        self.expendable = frozenset(expendable)
        self.respawn, self.on_respawn = respawn, on_respawn
        self.activity = activity
        self.envs: dict[int, dict[str, str]] = {}

    def lost(self) -> list[int]:
        """Expendable ranks that exited with a failure (the run went on without them, or with a replacement)."""
        return sorted({r.rank for r in self.ranks if r.rank in self.expendable and r.proc.returncode not in (0, None)})

    def _replace_lost(self) -> None:
        """Start replacements for expendable ranks that failed, while the run still has work."""
        if self.respawn is None or not any(r.proc.poll() is None for r in self.ranks if r.rank not in self.expendable):
            return
        for r in list(self.ranks):
            if r.replaced or r.rank not in self.expendable or r.proc.poll() in (None, 0):
                continue
            r.replaced = True
            command = self.respawn(r.rank, r.generation + 1)
            if command is not None:
                self.start(r.rank, command, self.envs[r.rank], generation=r.generation + 1)
                if self.on_respawn is not None:
                    self.on_respawn([self.ranks[-1].proc.pid])

    def name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        for r in self.ranks:
            r.out.close()
            r.err.close()

    def start(self, rank: int, command: list[str], env: dict[str, str], generation: int = 0,
              rendezvous: socket.socket | None = None) -> None:
        """Start `command` as rank `rank` in its own session (so its whole process group can be killed).

        `rendezvous`: the run's store socket, bound and listening (`reserved_listener`), handed to this rank (rank
        0, whose store takes it over: `STORE_FD_ENV`) and closed here: the launcher's copy would only keep the
        port after the rank ends."""
        name = f"rank{rank}" + (f".g{generation}" if generation else "")
        out_path, err_path = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        out, err = open(out_path, "wb"), open(err_path, "wb")  # noqa: SIM115 - closed in __exit__
        inherited, started_env = (), env
        if rendezvous is not None:
            inherited, started_env = (rendezvous.fileno(),), {**env, STORE_FD_ENV: str(rendezvous.fileno())}
        try:
            proc = _forked(command, started_env, out, err, inherited)
            if proc is None:
                proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=started_env,
                                        start_new_session=True, pass_fds=inherited)
        finally:
            if rendezvous is not None:
                rendezvous.close()
        self.envs[rank] = env  # a replacement inherits no rendezvous socket
        self.ranks.append(Rank(rank, proc, out, err, out_path, err_path, generation=generation))

    def supervise(self, *, timeout_s: float, progress: Callable[[str], None] | None) -> None:
        """Return when every rank exited with 0; raise RunFailedError otherwise."""
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while True:
            self._forward_progress(progress)
            self._replace_lost()
            codes = [r.proc.poll() for r in self.ranks]
            if all(c == 0 or (c is not None and r.rank in self.expendable)
                   for r, c in zip(self.ranks, codes, strict=True)):
                self._forward_progress(progress)
                return
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) and r.rank not in self.expendable
                                         for r, c in zip(self.ranks, codes, strict=True)):
                failed_at = now
            if failed_at is not None and (all(c is not None for c in codes) or now - failed_at > GRACE_S):
                self.kill_all(mark=True)
                raise RunFailedError(self._diagnose(timed_out=None))
            if now > deadline:
                beats = self._beats()
                self.kill_all(mark=True)
                raise RunFailedError(self._diagnose(timed_out=timeout_s, beats=beats))
            pause = PROGRESS_POLL_S if progress is not None or failed_at is not None else IDLE_POLL_S
            self._wait_for_exit(min(pause, max(0.0, deadline - now)))

    def _wait_for_exit(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking as soon as a live rank exits (its pidfd turns readable; Linux 5.3 and
        later, else a plain sleep)."""
        fds: list[int] = []
        try:
            for r in self.ranks:
                if r.proc.returncode is None:
                    with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfd_open here
                        fds.append(os.pidfd_open(r.proc.pid))
            if fds:
                select.select(fds, [], [], seconds)
            else:
                time.sleep(min(seconds, PROGRESS_POLL_S))
        finally:
            for fd in fds:
                os.close(fd)

    def kill_all(self, *, mark: bool = False) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is still there."""
        live = [r for r in self.ranks if r.proc.poll() is None]
        for r in live:
            r.killed = r.killed or mark
            signal_group(r.proc.pid, signal.SIGTERM)
        end = time.monotonic() + 2.0
        for r in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=max(0.0, end - time.monotonic()))
        for r in live:
            if r.proc.poll() is None:
                signal_group(r.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(timeout=5.0)
        for r in self.ranks:  # children a rank may have left in its group
            signal_group(r.proc.pid, signal.SIGKILL)

    def _forward_progress(self, progress: Callable[[str], None] | None) -> None:
        if progress is None or not self.ranks:
            return
        r = self.ranks[0]
        try:
            with open(r.out_path, "rb") as f:
                f.seek(r.read_pos)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        r.read_pos += end + 1
        for line in data[:end].decode(errors="replace").splitlines():
            if line.strip():
                progress(line)

    def _beats(self) -> dict[int, hb.Beat | None]:
        return {r.rank: hb.read_beat(hb.heartbeat_path(self.workdir, r.rank)) for r in self.ranks}

    def _where(self, beat: hb.Beat | None) -> str:
        if beat is None or beat.state == hb.STARTING:
            return "(during start-up)"
        if beat.state == hb.DONE:
            return f"(after {self.activity})"
        return f"(iteration {beat.iteration}, step {beat.step}, {beat.state_name})"

    def _diagnose(self, *, timed_out: float | None, beats: dict[int, hb.Beat | None] | None = None) -> str:
        beats = beats or self._beats()
        causes, others = [], []
        for r in self.ranks:
            code, beat = r.proc.returncode, beats.get(r.rank)
            where = self._where(beat)
            if r.killed:
                if beat is not None and beat.state == hb.COMM:
                    others.append(f"{self.name(r.rank)} was killed while waiting in a collective {where}")
                else:
                    causes.append((r, f"{self.name(r.rank)} stopped responding {where} and was killed"))
            elif code == EXIT_COMM:
                others.append(f"{self.name(r.rank)} lost its peers {where} (a collective failed or timed out)")
            elif code is not None and code < 0:
                causes.append((r, f"{self.name(r.rank)} was killed by signal {-code} {where}"))
            elif code not in (0, None):
                causes.append((r, f"{self.name(r.rank)} failed with exit code {code} {where}"))
        if not causes:  # everyone failed in collectives: report them all
            causes = [(r, f"{self.name(r.rank)} exited with code {r.proc.returncode} {self._where(beats.get(r.rank))}")
                      for r in self.ranks if r.proc.returncode not in (0, None) or r.killed]
            others = []
        head = f"run timed out after {timed_out:g} s; " if timed_out is not None else ""
        lines = [head + "; ".join(text for _, text in causes)]
        lines += others
        for r, _ in causes:
            tail = _tail(r.err_path)
            if tail:
                lines.append(f"last stderr lines of {self.name(r.rank)}:\n" + tail)
        return "\n".join(lines)


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-TAIL_LINES:])


@contextlib.contextmanager
def reserved_listener(host: str = "127.0.0.1") -> Iterator[socket.socket]:
    """A TCP socket bound to a free port of `host` and listening (closed on exit): a run's rendezvous port, held
    from its pick until rank 0's store takes it over (`Ranks.start(rendezvous=...)`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(1024)
        yield sock
    finally:
        sock.close()
