"""`--window`: a time window or a range of steps, resolved per lane.

Forms:
    START:END        times from the trace origin (the earliest kernel, memory operation or, in CPU
                     traces, op of the file), in ns unless a unit follows: `ns`, `us`, `ms`, `s`,
                     e.g. `1.5s:3s`, `250ms:`, `:2e9`. An empty side is open.
    steps:A:B        from the start of step A to the end of step B, both included; `steps:A` is
                     one step. Steps are `ProfilerStep#N` annotations or NVTX ranges named like
                     `iteration N` / `step N`, taken from the lane's own process when it has
                     them, else from the whole file. On GPU traces these are CPU-side ranges:
                     kernels still running after the last step's range ends are cut off.

Intervals crossing a window edge are clipped to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import numpy as np

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling.classify import step_number
from mbridge_epoverlap.profiling.model import Lane, TraceData

_UNITS = {"": 1, "ns": 1, "us": 1_000, "\u00b5s": 1_000, "ms": 1_000_000, "s": 1_000_000_000}
_TIME = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*(ns|us|\u00b5s|ms|s)?\s*", re.IGNORECASE)
_STEPS = re.compile(r"\s*steps\s*:\s*(\d+)\s*(?::\s*(\d+)\s*)?", re.IGNORECASE)
_FIX = "use START:END in ns or with units (e.g. 1.5s:3s, 200ms:) or steps:A:B (e.g. steps:3:8)"


@dataclass(frozen=True)
class WindowSpec:
    """A parsed `--window` value.

    Attributes:
        text: What the user wrote.
        lo: Start offset from the trace origin (ns), None for open; time windows only.
        hi: End offset (ns), None for open; time windows only.
        steps: (first, last) step numbers, both included; step windows only.
    """

    text: str
    lo: int | None = None
    hi: int | None = None
    steps: tuple[int, int] | None = None

    def to_dict(self) -> dict:
        """JSON form."""
        if self.steps is not None:
            return {"spec": self.text, "steps": list(self.steps)}
        return {"spec": self.text, "start_ns": self.lo, "end_ns": self.hi}


def _time(side: str, text: str) -> int | None:
    if not side.strip():
        return None
    m = _TIME.fullmatch(side)
    if m is None:
        raise UsageError(f"--window {text!r}: cannot read {side.strip()!r} as a time; {_FIX}")
    try:
        value = Decimal(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    except InvalidOperation:
        raise UsageError(f"--window {text!r}: cannot read {side.strip()!r} as a time; {_FIX}") from None
    return int(value.to_integral_value())


def parse_window(text: str | None) -> WindowSpec | None:
    """Parse a `--window` value.

    Raises:
        UsageError: Unreadable value, or an empty or reversed window.
    """
    if text is None:
        return None
    m = _STEPS.fullmatch(text)
    if m:
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if last < first:
            raise UsageError(
                f"--window {text!r}: last step {last} is before first step {first}; write steps:{last}:{first}"
            )
        return WindowSpec(text=text, steps=(first, last))
    if text.strip().lower().startswith("steps"):
        raise UsageError(f"--window {text!r}: steps need numbers, as in steps:3:8 (steps 3 to 8, both included)")
    if text.count(":") != 1:
        raise UsageError(f"--window {text!r}: expected one ':' between start and end; {_FIX}")
    lo_text, hi_text = text.split(":")
    lo, hi = _time(lo_text, text), _time(hi_text, text)
    if lo is not None and hi is not None and hi <= lo:
        raise UsageError(f"--window {text!r}: end is not after start; {_FIX}")
    return WindowSpec(text=text, lo=lo, hi=hi)


def available_steps(data: TraceData) -> list[int]:
    """Step numbers of the trace's step ranges, sorted."""
    return sorted({n for n in (step_number(name) for name in data.ranges.names) if n is not None})


def resolve(spec: WindowSpec | None, data: TraceData, lane: Lane) -> tuple[int | None, int | None]:
    """Absolute `[lo, hi)` bounds (trace clock, ns) of a window for one lane; None is open.

    Raises:
        UsageError: A step window whose steps the trace does not contain.
    """
    if spec is None:
        return None, None
    if spec.steps is None:
        lo = None if spec.lo is None else data.origin_ns + spec.lo
        hi = None if spec.hi is None else data.origin_ns + spec.hi
        return lo, hi
    first, last = spec.steps
    numbers = np.array([step_number(n) if step_number(n) is not None else -1 for n in data.ranges.names], np.int64)
    chosen = (numbers >= first) & (numbers <= last)
    if lane.pid is not None:
        own = chosen & ((data.ranges.pid == lane.pid) | (data.ranges.pid < 0))
        if own.any():  # a process without step ranges of its own follows the file's
            chosen = own
    if not chosen.any():
        have = available_steps(data)
        listed = ", ".join(map(str, have[:20])) + (" ..." if len(have) > 20 else "") if have else "none"
        raise UsageError(
            f"{data.path}: --window {spec.text!r} selects no step ranges (steps found: {listed}); pick steps the "
            "trace holds, or record them with torch.profiler's prof.step() / NVTX ranges named 'iteration N'"
        )
    return int(data.ranges.start[chosen].min()), int(data.ranges.end[chosen].max())
