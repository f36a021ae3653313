"""What a run reports (`CaseMetrics`) and the model-FLOPs estimate behind its TFLOP/s.

Torch-free, so the harness can read and write results without importing torch.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.flops import model_flops_per_iteration


@dataclass
class CaseMetrics:
    """One run's results, as rank 0 reports them.

    Attributes:
        step_times_s: wall time of each iteration (slowest rank), seconds.
        losses: loss of each iteration, mean over all ranks and micro-batches.
        skipped_iters: iterations whose optimizer step was skipped (non-finite gradients).
        nan_iters: iterations whose loss was NaN or infinite.
        peak_mem_bytes: highest peak memory of any rank (RSS high-water mark on CPU,
            `torch.cuda.max_memory_allocated` on GPU).
        tflops_per_gpu: model TFLOP/s per process at the median step time (first iteration excluded when
            there are more), or None when not computable.
        trace_dir: folder with one PyTorch profiler chrome trace per rank, or None.
        comm_step_s: per iteration, the time the training thread spent in communication steps (issuing
            all-to-alls and waiting for them), mean over ranks: the communication the schedule left exposed.
        comm_cpu_s: per iteration, the CPU time of the rank's other threads (gloo's and the communication
            thread on CPU), mean over ranks: on CPU, the work of moving the bytes, which overlap cannot hide
            from cores that all compute.
        schedule_s: per iteration, the wall time of the schedule itself (forward and backward of every
            micro-batch; the rest of a step is gradient reduction and the optimizer), slowest rank.
        stage_s: per range name of the schedule (`attn`, `dispatch.issue`, `dispatch.wait`, ...; a COMM stage's
            bare name is the collective's own time on the communication thread), per iteration, the mean
            duration of one occurrence, slowest rank per entry: the stage costs the simulator predicts from.
        schedule: the schedule's shape: micro_batches, layers, overlap, delay_wgrad.
    """

    step_times_s: list[float]
    losses: list[float]
    skipped_iters: int
    nan_iters: int
    peak_mem_bytes: int
    tflops_per_gpu: float | None
    trace_dir: str | None
    comm_step_s: list[float] | None = None
    comm_cpu_s: list[float] | None = None
    schedule_s: list[float] | None = None
    stage_s: dict[str, list[float]] | None = None
    schedule: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaseMetrics:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def tflops_per_gpu(cfg: RunConfig, step_times_s: list[float]) -> float | None:
    """Model TFLOP/s per process at the median step time (first iteration left out when there are more)."""
    times = step_times_s[1:] if len(step_times_s) > 1 else step_times_s
    if not times or cfg.num_gpus < 1:
        return None
    median = statistics.median(times)
    if median <= 0:
        return None
    return model_flops_per_iteration(cfg) / median / cfg.num_gpus / 1e12
