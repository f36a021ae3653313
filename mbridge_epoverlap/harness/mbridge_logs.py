"""Reading Megatron-Bridge / Megatron-LM training logs into `RunMetrics`.

Lines understood (anywhere in a line, so launcher prefixes such as `job/0 ` do not matter):

- Megatron's iteration line: `iteration   12/  50 | ... elapsed time per iteration (ms): 9089.0 | ...
  lm loss: 8.114214E+00 | ... number of skipped iterations:   0 | number of nan iterations:   0 |`
  (skip/NaN counts are per logging interval, so they are summed);
- Megatron-Bridge's throughput line: `Step Time : 9.09s GPU utilization: 663.5MODEL_TFLOP/s/GPU`;
- Megatron's memory report: `memory (MB) | allocated: ... | max allocated: 2345.6 | ...`.

Step times come from the iteration lines (they carry iteration numbers); `Step Time` lines give
TFLOP/s per step, and the step times when a log has no iteration lines. An iteration printed twice
(several ranks, or a restarted job) keeps its last complete record.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from mbridge_epoverlap.runtime.metrics import RunMetrics

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|NaN|inf|-inf)"
ITERATION_RE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUM)
LOSS_RE = re.compile(r"\blm loss:\s*" + _NUM, re.IGNORECASE)
SKIPPED_RE = re.compile(r"number of skipped iterations:\s*(\d+)")
NAN_RE = re.compile(r"number of nan iterations:\s*(\d+)")
STEP_TIME_RE = re.compile(r"Step Time\s*:\s*" + _NUM + r"\s*s\b(?:.*?GPU utilization:\s*" + _NUM
                          + r"\s*MODEL_TFLOP/s/GPU)?")
MAX_ALLOCATED_RE = re.compile(r"memory \(MB\).*?\bmax allocated:\s*" + _NUM)
PEAK_MEM_GB_RE = re.compile(r"Peak Mem(?:ory)?\s*:\s*" + _NUM + r"\s*GB", re.IGNORECASE)


class LogParseError(ValueError):
    """A log holds no training iterations (wrong file, or the job died before the first one)."""


@dataclass
class _Iteration:
    number: int
    elapsed_s: float | None
    loss: float


def _float(text: str) -> float:
    return float(text)  # float() reads nan/NaN/inf/-inf as Megatron prints them


def parse_log_text(text: str, source: str = "log") -> RunMetrics:
    """Parse a training log's text.

    Raises:
        LogParseError: no iteration or step-time line found.
    """
    iterations: dict[int, _Iteration] = {}
    steps: list[tuple[float, float | None]] = []
    skipped = nans = 0
    peak_mb: float | None = None
    for line in text.splitlines():
        it = ITERATION_RE.search(line)
        if it:
            elapsed = ELAPSED_RE.search(line)
            loss = LOSS_RE.search(line)
            record = _Iteration(int(it.group(1)), _float(elapsed.group(1)) / 1000.0 if elapsed else None,
                                _float(loss.group(1)) if loss else math.nan)
            previous = iterations.get(record.number)
            if previous is None or not (math.isnan(record.loss) and not math.isnan(previous.loss)):
                iterations[record.number] = record
            skipped += sum(int(m) for m in SKIPPED_RE.findall(line))
            nans += sum(int(m) for m in NAN_RE.findall(line))
        step = STEP_TIME_RE.search(line)
        if step:
            steps.append((_float(step.group(1)), _float(step.group(2)) if step.group(2) else None))
        mem = MAX_ALLOCATED_RE.search(line)
        if mem:
            peak_mb = max(peak_mb or 0.0, _float(mem.group(1)))
        peak_gb = PEAK_MEM_GB_RE.search(line)
        if peak_gb:
            peak_mb = max(peak_mb or 0.0, _float(peak_gb.group(1)) * 1024.0)
    peak = None if peak_mb is None else int(peak_mb * 1024 * 1024)
    timed = [r for r in sorted(iterations.values(), key=lambda r: r.number) if r.elapsed_s is not None]
    tflops_steps = [tf for _, tf in steps]
    if timed:
        per_step = tflops_steps if len(steps) == len(timed) and all(tf is not None for tf in tflops_steps) else None
        overall = None
        if per_step is None and any(tf is not None for tf in tflops_steps):
            # Unpaired throughput lines: their median after the first (warm-up) step.
            values = [tf for tf in tflops_steps[1:] or tflops_steps if tf is not None]
            overall = statistics.median(values) if values else None
        return RunMetrics(
            step_times_s=[r.elapsed_s for r in timed],  # type: ignore[misc]
            losses=[r.loss for r in timed],
            skipped_iters=skipped, nan_iters=nans, peak_mem_bytes=peak, tflops_per_gpu=overall,
            iterations=[r.number for r in timed], tflops_per_step=per_step,  # type: ignore[arg-type]
        )
    if steps:
        per_step = tflops_steps if all(tf is not None for tf in tflops_steps) else None
        return RunMetrics(
            step_times_s=[t for t, _ in steps], losses=[math.nan] * len(steps),
            skipped_iters=skipped, nan_iters=nans, peak_mem_bytes=peak,
            tflops_per_step=per_step,  # type: ignore[arg-type]
        )
    raise LogParseError(f"{source}: no training iterations found (expected Megatron 'iteration N/ M | ... elapsed "
                        "time per iteration (ms): X' lines or Megatron-Bridge 'Step Time : Xs' lines)")


def parse_log_file(path: str | Path) -> RunMetrics:
    """Parse a log file (undecodable bytes are replaced, as logs mix in binary noise).

    Raises:
        LogParseError: unreadable file or no iterations.
    """
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise LogParseError(f"cannot read log {path}: {exc.strerror or exc}") from None
    return parse_log_text(text, str(path))
