"""What one run reports, whoever ran it: the reference runtime, a Slurm job, or a parsed training log
(`RunMetrics`), and the model-FLOPs estimate behind a run's TFLOP/s.

It lives with the runtime that produces it; the harness reads and writes it. Torch-free, so the harness can
read and write results without importing torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.flops import model_flops_per_iteration
from mbridge_epoverlap.errors import RunFailedError


@dataclass
class RunMetrics:
    """Per-iteration step times and losses of one run, plus its health counters.

    Attributes:
        step_times_s: seconds per iteration, in iteration order.
        losses: loss per iteration (NaN where the run produced none or a non-finite one).
        skipped_iters, nan_iters: iterations skipped / with a NaN loss, as the trainer counted them.
        peak_mem_bytes: peak memory of the busiest rank (device memory on GPUs, RSS on CPU), or None.
        tflops_per_gpu: model TFLOP/s per GPU as the trainer reported it, or None.
        trace_dir: where a profiled run left its traces.
        iterations: 1-based iteration number of each entry (None: 1, 2, 3, ...). Logs written every
            k iterations have gaps.
        tflops_per_step: per-entry TFLOP/s/GPU when the trainer printed one per step.
        comm_step_s: per iteration, the training thread's time in communication steps (the reference
            runtime measures it; None elsewhere).
        comm_cpu_s: per iteration, CPU time of the ranks' other threads (the reference runtime; None elsewhere).
        schedule_s, stage_s, schedule: the reference runtime's schedule time per iteration, per-stage costs per
            iteration and schedule shape (None elsewhere).
        comm_exposed_by_rank_s, comm_collective_by_rank_s: per rank, per iteration, the training thread's time
            in communication steps less wake-up latency, and the collectives' own time (the reference runtime
            with a communication thread; None elsewhere). See `hidden_share`.
    """

    step_times_s: list[float]
    losses: list[float]
    skipped_iters: int = 0
    nan_iters: int = 0
    peak_mem_bytes: int | None = None
    tflops_per_gpu: float | None = None
    trace_dir: str | None = None
    iterations: list[int] | None = None
    tflops_per_step: list[float] | None = field(default=None)
    comm_step_s: list[float] | None = None
    comm_cpu_s: list[float] | None = None
    schedule_s: list[float] | None = None
    stage_s: dict[str, list[float]] | None = None
    schedule: dict[str, Any] | None = None
    comm_exposed_by_rank_s: list[list[float]] | None = None
    comm_collective_by_rank_s: list[list[float]] | None = None

    def hidden_share(self, first: int, last: int) -> tuple[float, float] | None:
        """(all ranks, worst rank) share of the collectives' time hidden over iterations `first`..`last`
        (1-based, inclusive): 1 - exposed / collective, summed over the ranks, and of the rank that hid least.
        None without per-rank figures or without collective time."""
        exposed, collective = self.comm_exposed_by_rank_s, self.comm_collective_by_rank_s
        if not exposed or not collective:
            return None
        per_rank = [(sum(e[first - 1:last]), sum(c[first - 1:last])) for e, c in zip(exposed, collective, strict=True)]
        total = sum(c for _, c in per_rank)
        if total <= 0 or any(c <= 0 for _, c in per_rank):
            return None
        share = min(1.0, max(0.0, 1.0 - sum(e for e, _ in per_rank) / total))
        return share, min(min(1.0, max(0.0, 1.0 - e / c)) for e, c in per_rank)

    def iteration_numbers(self) -> list[int]:
        return list(self.iterations) if self.iterations is not None else list(range(1, len(self.step_times_s) + 1))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["losses"] = [float_or_none(x) for x in self.losses]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run") -> RunMetrics:
        """From `to_dict()` JSON, as the runtime's rank 0 writes it (extra keys ignored, missing optional ones None).

        Raises:
            RunFailedError: the data has no step times (the run did not produce results).
        """
        try:
            step_times = [float(x) for x in data["step_times_s"]]
            losses = [math.nan if x is None else float(x) for x in data.get("losses", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise RunFailedError(f"{source}: results are missing or malformed ({type(exc).__name__}: {exc})") \
                from None
        if not step_times:
            raise RunFailedError(f"{source}: the run reported no iterations")
        return cls(
            step_times_s=step_times,
            losses=losses,
            skipped_iters=int(data.get("skipped_iters") or 0),
            nan_iters=int(data.get("nan_iters") or 0),
            peak_mem_bytes=None if data.get("peak_mem_bytes") is None else int(data["peak_mem_bytes"]),
            tflops_per_gpu=None if data.get("tflops_per_gpu") is None else float(data["tflops_per_gpu"]),
            trace_dir=data.get("trace_dir"),
            iterations=None if data.get("iterations") is None else [int(i) for i in data["iterations"]],
            tflops_per_step=_floats(data.get("tflops_per_step")),
            comm_step_s=_floats(data.get("comm_step_s")),
            comm_cpu_s=_floats(data.get("comm_cpu_s")),
            schedule_s=_floats(data.get("schedule_s")),
            stage_s=None if data.get("stage_s") is None else {
                str(name): [float(x) for x in series] for name, series in data["stage_s"].items()},
            schedule=None if data.get("schedule") is None else dict(data["schedule"]),
            comm_exposed_by_rank_s=_rows(data.get("comm_exposed_by_rank_s")),
            comm_collective_by_rank_s=_rows(data.get("comm_collective_by_rank_s")),
        )


def _floats(values: Any) -> list[float] | None:
    return None if values is None else [float(x) for x in values]


def _rows(values: Any) -> list[list[float]] | None:
    return None if values is None else [[float(x) for x in row] for row in values]


def float_or_none(value: float) -> float | None:
    """JSON has no NaN/Infinity: non-finite values are written as null."""
    return value if math.isfinite(value) else None


def tflops_per_gpu(cfg: RunConfig, step_times_s: list[float]) -> float | None:
    """Model TFLOP/s per process at the median step time (first iteration left out when there are more)."""
    times = step_times_s[1:] if len(step_times_s) > 1 else step_times_s
    if not times or cfg.num_gpus < 1:
        return None
    median = statistics.median(times)
    if median <= 0:
        return None
    return model_flops_per_iteration(cfg) / median / cfg.num_gpus / 1e12
