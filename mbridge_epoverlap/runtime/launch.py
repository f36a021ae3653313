"""Launch a run as local processes, one per rank, and supervise them.

Each rank is `python -m mbridge_epoverlap.runtime.worker` in its own session (so its whole process group
can be killed), with one intra-op thread, gloo bound to loopback (or, with `emulate_link_gbps`, to its
namespace's shaped interface). The supervisor forwards rank 0's progress lines, enforces the overall
timeout, and when a rank fails gives the others a few seconds to notice before killing them. Failures
name the rank that caused them, using exit codes and the ranks' heartbeats: a rank that exited by itself
or stopped while computing is the cause; ranks that failed inside a collective were waiting for it.

Torch is not imported here.
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
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mbridge_epoverlap.comm.errors import EXIT_COMM
from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.rules import global_batch_problem
from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.runtime import heartbeat as hb
from mbridge_epoverlap.runtime.metrics import RunMetrics
from mbridge_epoverlap.runtime.options import PREFIX

GRACE_S = 5.0  # after one rank fails, how long the others get to exit on their own
_TAIL_LINES = 15


def run_local(cfg: RunConfig, *, max_steps: int, profile_dir: Path | None = None,
              emulate_link_gbps: float | None = None, timeout_s: float = 600.0,
              progress: Callable[[str], None] | None = None) -> RunMetrics:
    """Run `cfg` in `cfg.num_gpus` local processes and return rank 0's metrics.

    Args:
        cfg: a CPU-shrunk, finalized run config (its `env_vars` reach every rank).
        max_steps: iterations to train.
        profile_dir: write one PyTorch profiler chrome trace per rank here.
        emulate_link_gbps: put each rank in its own network namespace behind a link shaped to this rate
            (root only).
        timeout_s: the whole run's limit; collectives time out after a quarter of it (at most 120 s)
            unless `MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S` is set.
        progress: called with each of rank 0's progress lines.

    Raises:
        UsageError: a bad request (no ranks, link emulation without root).
        RunFailedError: a rank failed, hung or the run timed out; the message names the rank and shows
            its last stderr lines.
    """
    payload = launch_ranks(cfg, mode="train", max_steps=max_steps, profile_dir=profile_dir,
                           emulate_link_gbps=emulate_link_gbps, timeout_s=timeout_s, progress=progress)
    return RunMetrics.from_dict(payload, "run_local")


def launch_ranks(cfg: RunConfig, *, mode: str = "train", max_steps: int = 1, profile_dir: Path | None = None,
                 emulate_link_gbps: float | None = None, timeout_s: float = 600.0,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the worker in `mode` ("train" or "check") on `cfg.num_gpus` local ranks; return rank 0's JSON."""
    check_layout(cfg)
    world = cfg.num_gpus
    if max_steps < 1:
        raise UsageError(f"max_steps={max_steps}: need at least one iteration")
    if emulate_link_gbps is not None:
        from mbridge_epoverlap.runtime.netns import check_can_emulate

        check_can_emulate()
    command = [sys.executable, "-m", "mbridge_epoverlap.runtime.worker", "--config", "{workdir}/config.yaml",
               "--results", "{workdir}/results.json", "--mode", mode, "--max-steps", str(max_steps)]
    if profile_dir is not None:
        command += ["--profile-dir", str(Path(profile_dir).resolve())]
    return launch_processes(world, lambda rank: command, env_vars=cfg.env_vars,
                            files={"config.yaml": cfg.to_yaml()}, emulate_link_gbps=emulate_link_gbps,
                            timeout_s=timeout_s, progress=progress)


def launch_processes(world: int, command_for: Callable[[int], list[str]], *, env_vars: Mapping[str, Any] | None = None,
                     files: Mapping[str, str] | None = None, emulate_link_gbps: float | None = None,
                     timeout_s: float = 600.0, progress: Callable[[str], None] | None = None,
                     results_name: str = "results.json", on_start: Callable[[list[int]], None] | None = None,
                     rank_names: Mapping[int, str] | None = None,
                     collect: Callable[[Path], dict[str, Any]] | None = None,
                     expendable: Collection[int] = (),
                     respawn: Callable[[int, int], list[str] | None] | None = None) -> dict[str, Any]:
    """Start `world` local processes, supervise them, and return the JSON rank 0 wrote to `results_name`.

    The one launcher of the project (training ranks, serving workers): each process runs in its own
    session with the rendezvous (`MASTER_ADDR`/`MASTER_PORT`), `RANK`/`WORLD_SIZE`, one intra-op
    thread and the heartbeat directory in its environment; a failure names the rank that caused it.

    Args:
        world: number of processes.
        command_for: rank -> argv; `{workdir}` in an argument is replaced with the run's scratch directory.
        env_vars: extra environment for every process.
        files: name -> text written into the scratch directory before the start.
        emulate_link_gbps: put each rank in its own network namespace behind a shaped link (root only).
        timeout_s: the whole run's limit; collectives time out after a quarter of it (at most 120 s)
            unless `MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S` is set.
        progress: called with each of rank 0's progress lines.
        results_name: the file in the scratch directory that rank 0 writes its JSON results to.
        on_start: called with the process ids once every process started (fault injection in tests).
        rank_names: how failure messages name a rank (e.g. "expert worker 1 (rank 3)"); "rank N" otherwise.
        collect: reads the results from the scratch directory instead of rank 0's `results_name` (every
            rank's file, say); on failure its answer is attached to the error as `partial`.
        expendable: ranks whose failure the run survives (elastic serving's expert workers): their exit,
            whatever its code, is not a failure; the ones that failed are listed under `lost_ranks` in
            `collect`'s answer.
        respawn: `(rank, generation) -> argv or None`: when an expendable rank fails while a rank that is not
            expendable still runs, start this command as replacement `generation` (1, 2, ...) of that rank,
            with the same environment (`{workdir}` replaced; its output in `rank<R>.g<G>.out/.err`); `on_start`
            is called again with its process id. None (or a None answer): no replacement.

    Raises:
        RunFailedError: a process failed, hung or the run timed out.
    """
    workdir = Path(tempfile.mkdtemp(prefix="mbe-run-"))
    try:
        with _interruptible(), contextlib.ExitStack() as stack:
            link = None
            if emulate_link_gbps is not None:
                from mbridge_epoverlap.runtime.netns import IFNAME, EmulatedLink

                link = stack.enter_context(EmulatedLink(world, emulate_link_gbps))
            results = workdir / results_name
            for name, text in (files or {}).items():
                (workdir / name).write_text(text)
            env = _base_env(env_vars or {}, workdir, timeout_s)
            if link is not None:
                env.update(MASTER_ADDR=link.address(0), MASTER_PORT="29500", GLOO_SOCKET_IFNAME=IFNAME)
            else:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
            def in_workdir(command: list[str]) -> list[str]:
                return [arg.replace("{workdir}", str(workdir)) for arg in command]

            replace = None
            if respawn is not None:
                def replace(rank: int, generation: int) -> list[str] | None:
                    command = respawn(rank, generation)
                    return None if command is None else in_workdir(command)

            ranks = stack.enter_context(_Ranks(workdir, rank_names, expendable, replace, on_start))
            for rank in range(world):
                prefix = link.command_prefix(rank) if link is not None else []
                command = in_workdir(command_for(rank))
                ranks.start(rank, prefix + command, dict(env, RANK=str(rank), WORLD_SIZE=str(world),
                                                         LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)))
            if on_start is not None:
                on_start([r.proc.pid for r in ranks.ranks])
            try:
                ranks.supervise(timeout_s=timeout_s, progress=progress)
            except RunFailedError as exc:
                if collect is not None:
                    exc.partial = collect(workdir)  # type: ignore[attr-defined]
                raise
            if collect is not None:
                collected = collect(workdir)
                collected["lost_ranks"] = ranks.lost()
                return collected
            if not results.is_file():
                raise RunFailedError(f"rank 0 finished but wrote no results ({results})")
            import json

            return json.loads(results.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def check_layout(cfg: RunConfig) -> None:
    """Raise UsageError for a config the ranks would reject at start-up (before starting any)."""
    world, m = cfg.num_gpus, cfg.model
    ep, experts = m.expert_model_parallel_size, m.num_moe_experts or 0
    problems = []
    if world < 1:
        problems.append(f"num_gpus={world}: need at least one process")
    elif ep < 1 or world % ep:
        problems.append(f"model.expert_model_parallel_size={ep} does not divide num_gpus={world}")
    if ep >= 1 and experts % ep:
        problems.append(f"model.num_moe_experts={experts} is not divisible by model.expert_model_parallel_size={ep}")
    batch = global_batch_problem(cfg.train.global_batch_size, cfg.train.micro_batch_size, max(world, 1))
    if batch is not None:
        problems.append(batch)
    if problems:
        raise UsageError("; ".join(problems))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env(env_vars: Mapping[str, Any], workdir: Path, timeout_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in env_vars.items()})
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(env_vars.get(key, "1"))
    env.setdefault(PREFIX + "COMM_TIMEOUT_S", str(min(120.0, max(5.0, timeout_s / 4))))
    env[PREFIX + "HEARTBEAT_DIR"] = str(workdir)
    # The ranks import this package from wherever the launcher imported it.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an exception so that cleanup (`finally`) runs."""


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupted(f"received signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]
    out_path: Path
    err_path: Path
    killed: bool = False
    read_pos: int = 0
    generation: int = 0  # 0: the first process of this rank; G: its G-th replacement
    replaced: bool = False


class _Ranks:
    """The rank processes of one run: start, supervise, diagnose, and always kill what is left."""

    def __init__(self, workdir: Path, names: Mapping[int, str] | None = None,
                 expendable: Collection[int] = (), respawn: Callable[[int, int], list[str] | None] | None = None,
                 on_respawn: Callable[[list[int]], None] | None = None) -> None:
        self.workdir = workdir
        self.ranks: list[_Rank] = []
        self.names = dict(names or {})
        self.expendable = frozenset(expendable)
        self.respawn, self.on_respawn = respawn, on_respawn
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

    def __enter__(self) -> _Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()
        for r in self.ranks:
            r.out.close()
            r.err.close()

    def start(self, rank: int, command: list[str], env: dict[str, str], generation: int = 0) -> None:
        name = f"rank{rank}" + (f".g{generation}" if generation else "")
        out_path, err_path = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        out, err = open(out_path, "wb"), open(err_path, "wb")  # noqa: SIM115 - closed in __exit__
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        self.envs[rank] = env
        self.ranks.append(_Rank(rank, proc, out, err, out_path, err_path, generation=generation))

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
            time.sleep(0.05)

    def kill_all(self, *, mark: bool = False) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is still there."""
        live = [r for r in self.ranks if r.proc.poll() is None]
        for r in live:
            r.killed = r.killed or mark
            _signal_group(r.proc.pid, signal.SIGTERM)
        end = time.monotonic() + 2.0
        for r in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=max(0.0, end - time.monotonic()))
        for r in live:
            if r.proc.poll() is None:
                _signal_group(r.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(timeout=5.0)
        for r in self.ranks:  # children a rank may have left in its group
            _signal_group(r.proc.pid, signal.SIGKILL)

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

    def _diagnose(self, *, timed_out: float | None, beats: dict[int, hb.Beat | None] | None = None) -> str:
        beats = beats or self._beats()
        causes, others = [], []
        for r in self.ranks:
            code, beat = r.proc.returncode, beats.get(r.rank)
            where = _where(beat)
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
            causes = [(r, f"{self.name(r.rank)} exited with code {r.proc.returncode} {_where(beats.get(r.rank))}")
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


def _where(beat: hb.Beat | None) -> str:
    if beat is None or beat.state == hb.STARTING:
        return "(during start-up)"
    if beat.state == hb.DONE:
        return "(after training)"
    return f"(iteration {beat.iteration}, step {beat.step}, {beat.state_name})"


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-_TAIL_LINES:])


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
