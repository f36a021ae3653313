"""What a loader hands to the analysis: activity rows and annotation ranges as numpy columns.

Loaders keep one row per kernel (or CPU op) in flat int64/int8/int32 arrays rather than Python
objects, so a trace with half a million kernels costs a few megabytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Lane:
    """One analysed timeline: a (process, device) pair of one trace file.

    Attributes:
        pid: Operating-system process id, or None when the trace does not record it.
        device: GPU index, or "cpu" for a CPU-only trace.
        rank: Distributed rank when the trace or its file name tells it, else None.
        source: File the lane came from.
    """

    pid: int | None
    device: int | str
    rank: int | None
    source: str


@dataclass
class Activity:
    """Work rows: GPU kernels and memory operations, or CPU ops and gloo ranges.

    Attributes:
        start: int64 start times (ns).
        end: int64 end times (ns).
        lane: int32 index into `TraceData.lanes`.
        kind: int8 class code from `classify` (COMPUTE, COMM, MEMORY, COMM_CALL).
        thread: int32 thread index per row for CPU traces (the CPU rule works per thread), else None.
    """

    start: np.ndarray
    end: np.ndarray
    lane: np.ndarray
    kind: np.ndarray
    thread: np.ndarray | None = None

    @classmethod
    def empty(cls) -> Activity:
        """No rows."""
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int8))


@dataclass
class Ranges:
    """Annotation ranges (NVTX or record_function) that matter to the report.

    Only dispatch/combine ranges and step ranges are kept.

    Attributes:
        start: int64 start times (ns); NVTX ranges opened before profiling start below zero.
        end: int64 end times (ns).
        pid: int64 process id per range, -1 when unknown (then it applies to every lane).
        names: Range names, in row order.
    """

    start: np.ndarray
    end: np.ndarray
    pid: np.ndarray
    names: list[str]

    @classmethod
    def empty(cls) -> Ranges:
        """No ranges."""
        return cls(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), [])


@dataclass
class TraceData:
    """One loaded trace file.

    Attributes:
        path: The file.
        format: "nsys" or "kineto".
        kind: "gpu" (kernels) or "cpu" (a CPU-only torch.profiler trace).
        origin_ns: Time zero for `--window START:END` (same clock as the rows).
        lanes: The timelines; `Activity.lane` indexes this list.
        activity: Work rows.
        ranges: Dispatch/combine and step ranges.
        notes: Remarks on missing tables or columns and on rules applied.
    """

    path: str
    format: str
    kind: str
    origin_ns: int
    lanes: list[Lane]
    activity: Activity
    ranges: Ranges
    notes: list[str] = field(default_factory=list)
