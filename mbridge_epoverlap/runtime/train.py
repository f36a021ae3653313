"""The training loop of one rank: mock data, the schedule, gradient reduction, optimizer, measurements.

The schedule comes from the model config: plain 1F1B when `overlap_moe_expert_parallel_comm` is off,
combined 1F1B (forward of one micro-batch interleaved with backward of the previous) when it is on, with
expert weight gradients delayed into the dispatch-backward window when `delay_wgrad_compute` is on.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mbridge_epoverlap.comm.alltoall import CommContext, all_reduce
from mbridge_epoverlap.comm.groups import ParallelGroups
from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.cpu_precision import choose_cpu_precision
from mbridge_epoverlap.config.rules import global_batch_problem
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.moe.model import MoEGPT
from mbridge_epoverlap.runtime.data import mock_micro_batches
from mbridge_epoverlap.runtime.executor import ScheduleExecutor
from mbridge_epoverlap.runtime.metrics import RunMetrics, tflops_per_gpu
from mbridge_epoverlap.runtime.optim import (
    Optimizer,
    attach_main_grads,
    grads_finite,
    reduce_main_grads,
    zero_main_grads,
)
from mbridge_epoverlap.runtime.options import Fault, RuntimeOptions
from mbridge_epoverlap.runtime.ranges import Ranges
from mbridge_epoverlap.schedule.program import Step, is_communicating
from mbridge_epoverlap.schedule.training_orders import one_f_one_b


@dataclass
class RankContext:
    """What one rank runs with: its groups, communication settings, device and options.

    `comm_backward`: the communication context of the backward all-to-alls, which then run in
    `groups.ep_backward_group` (None: they share `comm` and `groups.ep_group`).
    """

    groups: ParallelGroups
    comm: CommContext
    device: torch.device
    options: RuntimeOptions
    comm_backward: CommContext | None = None

    @property
    def comm_channels(self) -> int:
        """Communication channels the all-to-alls use: 2 with a backward channel, else 1."""
        return 2 if self.comm_backward is not None and self.groups.ep_backward_group is not None else 1


def resolve_dtype(cfg: RunConfig, options: RuntimeOptions, device: torch.device | None = None) -> torch.dtype:
    """`MBRIDGE_EPOVERLAP_DTYPE` if set; else bf16 when the config says bf16 (or fp16, which runs as bf16
    here), except on a CPU without native bf16, where it is fp32 (`config.cpu_precision`)."""
    if options.dtype is not None:
        return torch.float32 if options.dtype == "fp32" else torch.bfloat16
    low = bool(cfg.model.bf16 or cfg.model.fp16)
    if low and (device is None or device.type == "cpu"):
        low = choose_cpu_precision(True).dtype == "bf16"
    return torch.bfloat16 if low else torch.float32


def num_micro_batches(cfg: RunConfig, world: int) -> int:
    """global_batch_size / (micro_batch_size * data-parallel size); every rank is data parallel here."""
    problem = global_batch_problem(cfg.train.global_batch_size, cfg.train.micro_batch_size, world)
    if problem is not None:
        raise UsageError(problem)
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * world)


def schedule_for(cfg: RunConfig, micro_batches: int, *, paired_edges: bool = True,
                 split_expert_wgrad: bool = False) -> list[Step]:
    """The 1F1B step list the model config asks for (`paired_edges`, `split_expert_wgrad`: see `one_f_one_b`)."""
    return one_f_one_b(micro_batches, cfg.model.num_layers, overlap=cfg.model.overlap_moe_expert_parallel_comm,
                       delay_wgrad=cfg.model.delay_wgrad_compute, paired_edges=paired_edges,
                       split_expert_wgrad=split_expert_wgrad)


def build_model(cfg: RunConfig, ctx: RankContext, dtype: torch.dtype) -> MoEGPT:
    """The rank's model, initialized from the seed, with fp32 gradient buffers."""
    g = ctx.groups
    backward = (g.ep_backward_group, ctx.comm_backward) if ctx.comm_channels == 2 else None
    model = MoEGPT(cfg.model, ep_size=g.ep_size, ep_rank=g.ep_rank, ep_group=g.ep_group, comm=ctx.comm, dtype=dtype,
                   device=ctx.device, backward_channel=backward)
    model.init_parameters(cfg.train.seed)
    attach_main_grads(model)
    return model


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def inject_fault(fault: Fault | None, rank: int, iteration: int) -> None:
    """The test hook of `MBRIDGE_EPOVERLAP_FAULT`: fail this rank at the start of `iteration`."""
    if fault is None or fault.rank != rank or fault.iteration != iteration:
        return
    print(f"rank {rank}: injected fault '{fault.mode}' at iteration {iteration}", file=sys.stderr, flush=True)
    if fault.mode == "exit":
        os._exit(17)
    if fault.mode == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at iteration {iteration}")
    while True:  # hang: compute-side, outside any collective
        time.sleep(3600)


def train(cfg: RunConfig, ctx: RankContext, *, max_steps: int, profile_dir: Path | None = None,
          progress: Callable[[str], None] | None = None) -> RunMetrics:
    """Train `max_steps` iterations; every rank returns the same `RunMetrics` (global values).

    Args:
        cfg: the (CPU-shrunk, finalized) run config.
        ctx: groups, communication context, device and options of this rank.
        max_steps: iterations to run.
        profile_dir: write a PyTorch profiler chrome trace per rank there (iteration 1 is left out as
            warm-up when there is more than one).
        progress: called on rank 0 with one line per iteration.
    """
    if max_steps < 1:
        raise UsageError(f"max_steps={max_steps}: need at least one iteration")
    g, device = ctx.groups, ctx.device
    dtype = resolve_dtype(cfg, ctx.options, device)
    micro_batches = num_micro_batches(cfg, g.world)
    steps = schedule_for(cfg, micro_batches, paired_edges=ctx.options.paired_edges,
                         split_expert_wgrad=ctx.options.split_expert_wgrad)
    model = build_model(cfg, ctx, dtype)
    optimizer = Optimizer(model, kind=ctx.options.optimizer, lr=cfg.train.lr)
    beat = hb.Heartbeat(hb.heartbeat_path(ctx.options.heartbeat_dir, g.rank) if ctx.options.heartbeat_dir else None)
    iteration = 0

    def on_step(index: int, step: Step) -> None:
        beat.beat(iteration, index, hb.COMM if is_communicating(step) else hb.COMPUTE)

    executor = ScheduleExecutor(model, ranges=Ranges(use_nvtx=device.type == "cuda"), on_step=on_step)
    profiler = _profiler(device) if profile_dir is not None else None
    step_times, losses, skipped, nans = [], [], 0, 0
    comm_step_s: list[float] = []
    comm_cpu_s: list[float] = []
    comm_account: list[tuple[float, float]] = []
    schedule_s: list[float] = []
    stage_s: dict[str, list[float]] = {}
    profiling = False
    try:
        for iteration in range(1, max_steps + 1):
            if profiler is not None and iteration == min(2, max_steps):
                profiler.start()
                profiling = True
            beat.beat(iteration, 0, hb.OTHER)
            inject_fault(ctx.options.fault, g.rank, iteration)
            batches = mock_micro_batches(
                seed=cfg.train.seed, iteration=iteration, dp_rank=g.rank, num_micro_batches=micro_batches,
                micro_batch_size=cfg.train.micro_batch_size, seq_length=cfg.model.seq_length,
                vocab_size=cfg.model.vocab_size, device=device,
            )
            _sync(device)
            start = time.perf_counter()
            process_cpu, own_cpu = time.process_time(), time.thread_time()
            with torch.profiler.record_function(f"iteration {iteration}"):
                mb_losses = executor.run(steps, batches, loss_scale=1.0 / micro_batches)
                beat.beat(iteration, len(steps), hb.COMM)
                with torch.profiler.record_function("grad_allreduce"):
                    reduce_main_grads(model, g, ctx.comm)
                # One small all-reduce: the summed loss and whether any rank saw a non-finite gradient.
                local_bad = 0.0 if grads_finite(model) else 1.0
                stats = torch.stack([torch.stack(mb_losses).sum() / micro_batches,
                                     torch.tensor(local_bad, device=device)]).to(device=device, dtype=torch.float64)
                all_reduce(stats, g.world_group, ctx.comm, what="loss all-reduce")
                beat.beat(iteration, len(steps), hb.OTHER)
                if stats[1].item() > 0:
                    skipped += 1
                else:
                    with torch.profiler.record_function("optimizer"):
                        optimizer.step()
                zero_main_grads(model)
            _sync(device)
            step_times.append(time.perf_counter() - start)
            # CPU of every other thread of this rank (on CPU: gloo's threads and the communication thread).
            comm_cpu_s.append(max(0.0, (time.process_time() - process_cpu) - (time.thread_time() - own_cpu)))
            comm_step_s.append(executor.comm_step_s)
            comm_account.append(executor.comm_account())
            schedule_s.append(executor.run_s)
            for name, durations in executor.step_s.items():
                stage_s.setdefault(name, []).append(sum(durations) / len(durations))
            loss = float(stats[0].item()) / g.world
            nans += 0 if math.isfinite(loss) else 1
            losses.append(loss)
            if progress is not None and g.rank == 0:
                progress(f"iteration {iteration}/{max_steps} | loss {loss:.6f} | step {step_times[-1]:.3f} s")
        beat.beat(iteration, 0, hb.DONE)
        if profiler is not None and profile_dir is not None:
            profiler.stop()
            profiling = False
            profile_dir.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(profile_dir / f"rank{g.rank}.json"))
    finally:
        if profiling and profiler is not None:
            with contextlib.suppress(Exception):  # failing already; keep the original error
                profiler.stop()
        beat.close()
    # Slowest rank's time per iteration and highest peak memory, gathered once at the end.
    times = torch.tensor(step_times, dtype=torch.float64, device=device)
    peak = torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
    all_reduce(times, g.world_group, ctx.comm, op=dist.ReduceOp.MAX, what="step-time all-reduce")
    all_reduce(peak, g.world_group, ctx.comm, op=dist.ReduceOp.MAX, what="memory all-reduce")
    step_times = [float(t) for t in times.tolist()]
    comm = torch.tensor([comm_step_s, comm_cpu_s], dtype=torch.float64, device=device)
    all_reduce(comm, g.world_group, ctx.comm, what="communication-time all-reduce")
    comm_step_s, comm_cpu_s = (comm / g.world).tolist()
    # Each rank's own exposed and collective time per iteration: the hidden share is a per-rank quantity (the
    # element-wise maximum of stage costs below mixes ranks that stall in different places).
    by_rank = torch.zeros((g.world, 2, len(comm_account)), dtype=torch.float64, device=device)
    by_rank[g.rank] = torch.tensor(comm_account, dtype=torch.float64, device=device).t()
    all_reduce(by_rank, g.world_group, ctx.comm, what="communication-account all-reduce")
    exposed_by_rank, collective_by_rank = by_rank[:, 0].tolist(), by_rank[:, 1].tolist()
    # Per-stage costs and the schedule's own time of the slowest rank (every rank runs the same steps): step
    # times are the slowest rank's too, and a collective ends when its last rank joined it.
    names = sorted(stage_s)
    costs = torch.tensor([schedule_s] + [stage_s[n] for n in names], dtype=torch.float64, device=device)
    all_reduce(costs, g.world_group, ctx.comm, op=dist.ReduceOp.MAX, what="stage-time all-reduce")
    rows = costs.tolist()
    return RunMetrics(
        step_times_s=step_times, losses=losses, skipped_iters=skipped, nan_iters=nans,
        peak_mem_bytes=int(peak.item()), tflops_per_gpu=tflops_per_gpu(cfg, step_times),
        trace_dir=str(profile_dir) if profile_dir is not None else None,
        comm_step_s=comm_step_s, comm_cpu_s=comm_cpu_s, schedule_s=rows[0],
        comm_exposed_by_rank_s=exposed_by_rank, comm_collective_by_rank_s=collective_by_rank,
        stage_s=dict(zip(names, rows[1:], strict=True)),
        schedule={"micro_batches": micro_batches, "layers": cfg.model.num_layers,
                  "overlap": bool(cfg.model.overlap_moe_expert_parallel_comm),
                  "delay_wgrad": bool(cfg.model.delay_wgrad_compute),
                  "paired_edges": ctx.options.paired_edges, "comm_channels": ctx.comm_channels,
                  "split_expert_wgrad": ctx.options.split_expert_wgrad},
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profiler(device: torch.device) -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        # Collectives are issued from the communication thread; record that thread too.
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # older torch
        return torch.profiler.profile(activities=activities)
    return torch.profiler.profile(activities=activities, experimental_config=config)
