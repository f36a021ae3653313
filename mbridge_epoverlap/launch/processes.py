"""Start local processes, one per rank, supervise them, and return what rank 0 wrote: `launch_processes`,
the one launcher of the project (training ranks, serving workers).

Each process runs in its own session (so its whole process group can be killed) with the rendezvous
(`MASTER_ADDR`/`MASTER_PORT`), `RANK`/`WORLD_SIZE`, one intra-op thread, gloo bound to loopback (or, with
`emulate_link_gbps`, to its namespace's shaped interface, `netns`) and the heartbeat directory in its
environment; `ranks.Ranks` supervises them. Torch is not imported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import RunFailedError
from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.launch.orphan import SUPERVISOR_PID_ENV
from mbridge_epoverlap.launch.ranks import DEFAULT_ACTIVITY, Ranks, reserved_listener
from mbridge_epoverlap.launch.signals import interruptible

M2N_HOST_ENV = "MBRIDGE_EPOVERLAP_M2N_HOST"  # read by `comm.m2n.make_communicator` (mooncake's listen address)


COMM_TIMEOUT_ENV = "MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S"  # seconds a collective may take (the ranks read it)


def launch_processes(world: int, command_for: Callable[[int], list[str]], *, env_vars: Mapping[str, Any] | None = None,
                     files: Mapping[str, str] | None = None, emulate_link_gbps: float | None = None,
                     timeout_s: float = 600.0, progress: Callable[[str], None] | None = None,
                     results_name: str = "results.json", on_start: Callable[[list[int]], None] | None = None,
                     rank_names: Mapping[int, str] | None = None,
                     collect: Callable[[Path], dict[str, Any]] | None = None,
                     expendable: Collection[int] = (),
                     respawn: Callable[[int, int], list[str] | None] | None = None,
                     activity: str = DEFAULT_ACTIVITY, emulate_hosts: list[int] | None = None,
                     link: Any = None, rendezvous: tuple[str, int] | None = None) -> dict[str, Any]:
    """Start `world` local processes, supervise them, and return the JSON rank 0 wrote to `results_name`.

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
        emulate_hosts: with `emulate_link_gbps`, the emulated host of each rank: one namespace per host, only
            traffic between hosts crosses the shaped link (None: one namespace per rank). Each rank gets its
            namespace's address in `MBRIDGE_EPOVERLAP_M2N_HOST` (where its M2N endpoints listen), and a
            replacement starts in its rank's namespace.
        link: an `netns.EmulatedLink` the caller created (and removes), used instead of creating one from
            `emulate_link_gbps` and `emulate_hosts`: the caller needed its addresses before the start.
        rendezvous: (address, port) of a store the caller holds: the processes' `MASTER_ADDR`/`MASTER_PORT`
            (None: rank 0 holds it, at loopback or its namespace's address).
        activity: what the processes do, as failure messages name it: "training" says a rank that failed
            after its last heartbeat failed "(after training)", "serving" "(after serving)".

    Raises:
        RunFailedError: a process failed, hung or the run timed out.
    """
    workdir = Path(tempfile.mkdtemp(prefix="mbe-run-"))
    try:
        with interruptible(), contextlib.ExitStack() as stack:
            if link is None and emulate_link_gbps is not None:
                from mbridge_epoverlap.launch.netns import EmulatedLink

                link = stack.enter_context(EmulatedLink(world, emulate_link_gbps, emulate_hosts))
            results = workdir / results_name
            for name, text in (files or {}).items():
                (workdir / name).write_text(text)
            env = base_env(env_vars or {}, workdir, timeout_s)
            if link is not None:
                from mbridge_epoverlap.launch.netns import IFNAME

                env.update(MASTER_ADDR=link.address(0), MASTER_PORT="29500", GLOO_SOCKET_IFNAME=IFNAME)
            reserved: socket.socket | None = None
            if rendezvous is not None:
                env.update(MASTER_ADDR=rendezvous[0], MASTER_PORT=str(rendezvous[1]))
            elif link is None:
                reserved = stack.enter_context(reserved_listener())
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(reserved.getsockname()[1]),
                           GLOO_SOCKET_IFNAME="lo")
            def in_workdir(command: list[str]) -> list[str]:
                return [arg.replace("{workdir}", str(workdir)) for arg in command]

            replace = None
            if respawn is not None:
                def replace(rank: int, generation: int) -> list[str] | None:  # in the rank's namespace, as at start
                    command = respawn(rank, generation)
                    prefix = link.command_prefix(rank) if link is not None else []
                    return None if command is None else prefix + in_workdir(command)

            ranks = stack.enter_context(Ranks(workdir, rank_names, expendable, replace, on_start, activity=activity))
            for rank in range(world):
                prefix = link.command_prefix(rank) if link is not None else []
                command = in_workdir(command_for(rank))
                rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE=str(world))
                if link is not None:  # where a rank's M2N endpoints listen (mooncake): its namespace's address
                    rank_env.setdefault(M2N_HOST_ENV, link.address(rank))
                ranks.start(rank, prefix + command, rank_env, rendezvous=reserved if rank == 0 else None)
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
            return json.loads(results.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(env_vars: Mapping[str, Any], workdir: Path, timeout_s: float) -> dict[str, str]:
    """The environment every process starts with: this one, `env_vars`, one intra-op thread (unless
    `env_vars` says otherwise), a collective timeout of a quarter of `timeout_s` (5..120 s) unless set,
    the heartbeat directory `workdir`, this package on `PYTHONPATH`, and this process's pid as the supervisor's."""
    env = dict(os.environ)
    env.update({k: str(v) for k, v in env_vars.items()})
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = str(env_vars.get(key, "1"))
    env.setdefault(COMM_TIMEOUT_ENV, str(min(120.0, max(5.0, timeout_s / 4))))
    env[hb.DIR_ENV] = str(workdir)
    # The processes import this package from wherever the launcher imported it.
    root = str(Path(__file__).resolve().parents[2])
    entries = (root, *env.get("PYTHONPATH", "").split(os.pathsep))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in entries if p))  # once each, in order
    env["PYTHONUNBUFFERED"] = "1"
    env[SUPERVISOR_PID_ENV] = str(os.getpid())  # who each process watches (`orphan.exit_when_orphaned`)
    return env
