"""One rank of a run: `python -m mbridge_epoverlap.runtime.worker --config RESOLVED.yaml --max-steps N
--results OUT.json [--profile-dir D] [--mode train|check]`.

Rank and world size come from `RANK`/`WORLD_SIZE` (or Slurm's `SLURM_PROCID`/`SLURM_NTASKS`), the local
rank from `LOCAL_RANK`/`SLURM_LOCALID`, the rendezvous from `MASTER_ADDR`/`MASTER_PORT`. Rank 0 writes the
results JSON (`RunMetrics` for train, the self-check report for check).

Exit codes: 0 done, 1 this rank failed, 2 usage error, 3 a collective failed or timed out (a peer died
or hung): the launcher uses them to name the rank that caused a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

from mbridge_epoverlap.comm.errors import EXIT_COMM
from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from mbridge_epoverlap.launch.orphan import exit_when_orphaned
from mbridge_epoverlap.runtime.options import PREFIX


def rank_and_world(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun-style or Slurm variables."""
    for rank_key, world_key, local_key in (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                                           ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
        if rank_key in env and world_key in env:
            try:
                return int(env[rank_key]), int(env[world_key]), int(env.get(local_key, env[rank_key]))
            except ValueError:
                raise UsageError(f"{rank_key}={env[rank_key]!r} / {world_key}={env[world_key]!r} are not integers") \
                    from None
    raise UsageError("no rank information: set RANK and WORLD_SIZE (or run under srun, which sets SLURM_PROCID "
                     "and SLURM_NTASKS)")


def local_world_size(env: Mapping[str, str], world: int) -> int:
    """Ranks on this node: `LOCAL_WORLD_SIZE` (torchrun, the local launcher), Slurm's tasks per node, or all."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world


def choose_backend(requested: str, *, use_cuda: bool, ranks_on_node: int, gpus: int) -> str:
    """The process-group backend: gloo on CPU; on CUDA NCCL, unless ranks share a GPU, which NCCL refuses.

    Every rank of a node decides from the same inputs, so they all choose alike.
    """
    if not use_cuda:
        if requested == "nccl":
            raise UsageError(f"{PREFIX}BACKEND=nccl needs CUDA; this run is on CPU (use gloo or auto)")
        return "gloo"
    shared = ranks_on_node > gpus
    if requested == "nccl" and shared:
        raise UsageError(f"{PREFIX}BACKEND=nccl with {ranks_on_node} ranks on {gpus} GPU(s): NCCL needs a GPU per "
                         f"rank; use {PREFIX}BACKEND=gloo (or auto) or fewer ranks per node")
    if requested == "auto":
        return "gloo" if shared else "nccl"
    return requested


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.runtime.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="resolved run config (YAML, RunConfig.to_yaml)")
    parser.add_argument("--max-steps", type=int, default=None, help="iterations (default: train.train_iters)")
    parser.add_argument("--results", required=True, type=Path, help="where rank 0 writes the results JSON")
    parser.add_argument("--profile-dir", type=Path, default=None, help="write a chrome trace per rank here")
    parser.add_argument("--mode", choices=("train", "check"), default="train",
                        help="train (default) or check: compare schedules and the dispatcher on this layout")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    import yaml

    from mbridge_epoverlap.config.container import RunConfig

    rank, world, local_rank = rank_and_world(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise UsageError(f"{key} is not set: the ranks need the rendezvous address "
                             "(rank 0's host and a free port)")
    try:
        cfg = RunConfig.from_dict(yaml.safe_load(args.config.read_text()))
    except OSError as exc:
        raise UsageError(f"--config {args.config}: {exc}") from None
    if cfg.num_gpus != world:
        raise UsageError(f"the config is for {cfg.num_gpus} processes but WORLD_SIZE is {world}")

    import torch

    from mbridge_epoverlap.comm.alltoall import CommContext
    from mbridge_epoverlap.comm.groups import build_groups, init_distributed
    from mbridge_epoverlap.runtime.options import RuntimeOptions
    from mbridge_epoverlap.runtime.train import RankContext, train

    options = RuntimeOptions.from_env()
    # One intra-op thread per rank unless told otherwise: ranks share the cores, and overlap needs a
    # core's worth of room for the communication thread.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    use_cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise UsageError(f"{PREFIX}DEVICE=cuda but CUDA is not available to this process")
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
    else:
        gpus, device = 0, torch.device("cpu")
    backend = choose_backend(options.backend, use_cuda=use_cuda, ranks_on_node=local_world_size(os.environ, world),
                             gpus=gpus)
    init_distributed(rank, world, backend=backend, timeout_s=options.comm_timeout_s)
    # On CPU the backward all-to-alls may get a channel of their own (thread and process group): a collective
    # that waits for a late peer then holds up only its own direction. GPUs keep one side stream.
    two_channels = options.comm_channels == 2 and not use_cuda and cfg.model.expert_model_parallel_size > 1
    groups = build_groups(cfg.model.expert_model_parallel_size, backward_channel=two_channels)
    comm = CommContext.for_device(device, options.comm_timeout_s)
    comm_backward = CommContext.for_device(device, options.comm_timeout_s) if two_channels else None
    ctx = RankContext(groups=groups, comm=comm, device=device, options=options, comm_backward=comm_backward)
    if not use_cuda:
        from mbridge_epoverlap.comm.priority import raise_comm_priority

        own = tuple(c.thread_native_id for c in (comm, comm_backward) if c is not None and c.thread_native_id)
        raise_comm_priority(options.comm_nice, extra_thread_ids=own)

    def progress(line: str) -> None:
        print(line, flush=True)

    if args.mode == "check":
        from mbridge_epoverlap.runtime.check import run_checks

        report = run_checks(cfg, ctx)
        payload = report if rank == 0 else None
    else:
        max_steps = args.max_steps if args.max_steps is not None else cfg.train.train_iters
        metrics = train(cfg, ctx, max_steps=max_steps, profile_dir=args.profile_dir, progress=progress)
        payload = metrics.to_dict() if rank == 0 else None
    if payload is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.results.with_suffix(args.results.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(args.results)
    import torch.distributed as dist

    dist.destroy_process_group()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    exit_when_orphaned()
    try:
        return run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except Exception as exc:
        from mbridge_epoverlap.comm.errors import CommError

        traceback.print_exc()
        code = EXIT_COMM if isinstance(exc, CommError) else EXIT_FAILED
        print(f"rank failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # After a failed collective, tearing down the process group can block on the lost peer: leave now.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
