"""The model-FLOPs estimate behind a run's TFLOP/s; a run reports `harness.metrics.RunMetrics`.

Torch-free, so the harness can read and write results without importing torch.
"""

from __future__ import annotations

import statistics

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.flops import model_flops_per_iteration


def tflops_per_gpu(cfg: RunConfig, step_times_s: list[float]) -> float | None:
    """Model TFLOP/s per process at the median step time (first iteration left out when there are more)."""
    times = step_times_s[1:] if len(step_times_s) > 1 else step_times_s
    if not times or cfg.num_gpus < 1:
        return None
    median = statistics.median(times)
    if median <= 0:
        return None
    return model_flops_per_iteration(cfg) / median / cfg.num_gpus / 1e12
