"""The process supervisor: start local processes, one per rank, watch them, name the one that failed, and
leave no process or network namespace behind. The training runtime (`runtime.launch`), the serving engine
(`serving.engine.run`) and the M2N benchmark (`comm.m2n.bench`) all start their processes here. Torch-free.

- `processes`: `launch_processes`, the one launcher: scratch directory, base environment, rendezvous
  port, optional link emulation, results; `free_port` for a port someone else binds later.
- `ranks`: `Ranks`, the processes of one run: start (rank 0 with the rendezvous socket `reserved_listener`
  holds for it), supervise, replace expendable ones, kill, and the failure message that names the rank that
  caused it.
- `zygote`: a process that imported torch once and forks each rank started as `python -m` (its session, files,
  environment and title as a new interpreter's), so a rank does not pay torch's import; `ranks` uses it.
- `heartbeat`: the tiny per-rank status file a process writes and the supervisor reads, to tell a hung
  rank from one waiting for it.
- `netns`: an emulated inter-node link, one network namespace per rank (or per emulated host) behind a
  shaped bridge (root only).
- `signals`: SIGTERM/SIGHUP turned into an exception so cleanup runs; signals to whole process groups.
- `orphan`: `exit_when_orphaned`, a started process leaves when its supervisor is gone (even SIGKILLed).
"""

from mbridge_epoverlap.launch.processes import base_env, free_port, launch_processes
from mbridge_epoverlap.launch.ranks import Ranks, reserved_listener

__all__ = ["Ranks", "base_env", "free_port", "launch_processes", "reserved_listener"]
