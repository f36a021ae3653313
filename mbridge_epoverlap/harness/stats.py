"""Statistics of an A/B: stable windows, medians across repeats, bitwise loss comparison."""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.runtime.metrics import RunMetrics


@dataclass(frozen=True)
class Window:
    """1-based inclusive iteration range."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    def contains(self, iteration: int) -> bool:
        return self.start <= iteration <= self.end

    def to_list(self) -> list[int]:
        return [self.start, self.end]


def parse_window(text: str) -> Window:
    """`START:END` (1-based, inclusive, START <= END)."""
    start, sep, end = text.partition(":")
    try:
        window = Window(int(start), int(end))
    except ValueError:
        raise UsageError(f"--stable_window {text!r} is not START:END (1-based iterations, e.g. 3:8)") from None
    if not sep or window.start < 1 or window.end < window.start:
        raise UsageError(f"--stable_window {text!r}: need 1 <= START <= END, e.g. 3:8")
    return window


def clip_window(window: Window, max_steps: int) -> tuple[Window, str | None]:
    """The window limited to the iterations a run has, and a warning when it had to change."""
    end = min(window.end, max_steps)
    start = min(window.start, end)
    clipped = Window(start, end)
    if clipped == window:
        return window, None
    return clipped, (f"stable window {window} does not fit --max_steps {max_steps}; using {clipped} "
                     f"(early iterations include warm-up; run more steps for a stable comparison)")


def median_by_iteration(runs: Sequence[RunMetrics]) -> tuple[list[int], list[float]]:
    """Iteration numbers and the per-iteration median step time across repeats."""
    by_iter: dict[int, list[float]] = {}
    for run in runs:
        for it, t in zip(run.iteration_numbers(), run.step_times_s, strict=False):
            by_iter.setdefault(it, []).append(t)
    iterations = sorted(by_iter)
    return iterations, [statistics.median(by_iter[it]) for it in iterations]


def window_mean(iterations: Sequence[int], values: Sequence[float], window: Window) -> float | None:
    """Mean of the values whose iteration lies in the window, or None when none does."""
    selected = [v for it, v in zip(iterations, values, strict=False) if window.contains(it) and math.isfinite(v)]
    return statistics.fmean(selected) if selected else None


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def loss_mismatches(baseline: Sequence[float], other: Sequence[float]) -> list[int]:
    """1-based positions where two loss curves are not bitwise equal (a length difference counts too)."""
    length = max(len(baseline), len(other))
    out = []
    for i in range(length):
        if i >= len(baseline) or i >= len(other) or bits(baseline[i]) != bits(other[i]):
            out.append(i + 1)
    return out


def max_abs_diff(baseline: Sequence[float], other: Sequence[float]) -> float | None:
    diffs = [abs(a - b) for a, b in zip(baseline, other, strict=False) if math.isfinite(a) and math.isfinite(b)]
    return max(diffs) if diffs else None


def all_finite(values: Sequence[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def overlap_ceiling(baseline_s: float, wait_s: float, cpu_s: float) -> float:
    """Best speedup overlap can give when the all-to-alls' CPU work competes with compute for every core.

    Hiding every communication wait of the baseline (`wait_s` per iteration) takes at most that much off
    its step (`baseline_s`), but the CPU work of moving the bytes (`cpu_s`, the communication threads' CPU
    time) must still run on cores that are all computing.
    """
    return baseline_s / (baseline_s - wait_s + cpu_s)
