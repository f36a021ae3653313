"""What one run reports, whoever ran it: the reference runtime, a Slurm job, or a parsed training log."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

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
        )


def _floats(values: Any) -> list[float] | None:
    return None if values is None else [float(x) for x in values]


def float_or_none(value: float) -> float | None:
    """JSON has no NaN/Infinity: non-finite values are written as null."""
    return value if math.isfinite(value) else None
