"""Launch a training run as local processes, one per rank: what is training-specific about it.

Each rank is `python -m mbridge_epoverlap.runtime.worker`; `check_layout` rejects a config the ranks would
reject at start-up before any starts. The process supervision itself (sessions, timeout, progress lines,
heartbeats, the failure message naming the rank that caused it, link emulation) is the generic supervisor's,
`mbridge_epoverlap.launch`.

Torch is not imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.rules import global_batch_problem
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.launch import launch_processes
from mbridge_epoverlap.runtime.metrics import RunMetrics


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
        from mbridge_epoverlap.launch.netns import check_can_emulate

        check_can_emulate()
    command = [sys.executable, "-m", "mbridge_epoverlap.runtime.worker", "--config", "{workdir}/config.yaml",
               "--results", "{workdir}/results.json", "--mode", mode, "--max-steps", str(max_steps)]
    if profile_dir is not None:
        command += ["--profile-dir", str(Path(profile_dir).resolve())]
    return launch_processes(world, lambda rank: command, env_vars=cfg.env_vars,
                            files={"config.yaml": cfg.to_yaml()}, emulate_link_gbps=emulate_link_gbps,
                            timeout_s=timeout_s, progress=progress, activity="training")


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
