"""CPU-only torch.profiler traces (gloo runs), where communication is CPU work too.

The rule, applied per process (one lane per pid, device "cpu"):

* communication: every complete event whose name the classifier marks as communication, on any
  thread; in practice the `gloo:*` `user_annotation` ranges gloo records on its worker threads
  (`pt_gloo_runloop`) for the time it moves data;
* compute: `cpu_op` events, plus `user_annotation` ranges named after a compute stage
  (`attention`, `router`, `permute`, `experts`, `mlp`, `post`, `wgrad`, ...), on each thread minus
  the time that same thread spends inside communication ranges (ops nested in a gloo range belong to
  the transfer). Ranges named after dispatch/combine or a step are containers, not compute;
* neither: `c10d::*` / `record_param_comms` calls that issue or wait for a collective. They count
  towards the active union only.

`kernels` then counts communication events plus compute ops and stage ranges.
"""

from __future__ import annotations

import numpy as np

from mbridge_epoverlap.profiling.classify import (
    COMBINE_RANGE,
    COMM,
    COMM_CALL,
    COMM_CALL_PREFIX,
    COMPUTE,
    COMPUTE_STAGE,
    DISPATCH_RANGE,
    Classifier,
    step_number,
)
from mbridge_epoverlap.profiling.intervals import Intervals, subtract, union
from mbridge_epoverlap.profiling.jsonstream import ScanResult, scan_events
from mbridge_epoverlap.profiling.model import Activity, Lane, Ranges, TraceData
from mbridge_epoverlap.profiling.sources import open_binary

_SKIP = -1


def _annotation_kind(name: str, classifier: Classifier) -> int:
    if classifier.is_comm(name):
        return COMM
    if DISPATCH_RANGE.search(name) or COMBINE_RANGE.search(name) or step_number(name) is not None:
        return _SKIP
    return COMPUTE if COMPUTE_STAGE.search(name) else _SKIP


def _op_kind(name: str, classifier: Classifier) -> int:
    if classifier.is_comm(name):
        return COMM
    if COMM_CALL_PREFIX.match(name):
        return COMM_CALL
    return _SKIP if step_number(name) is not None else COMPUTE


def _rows(res: ScanResult, kinds: list[int]) -> tuple[np.ndarray, ...]:
    per_name = np.array(kinds or [_SKIP], np.int8)
    kind = per_name[res.name] if res.name.size else np.empty(0, np.int8)
    keep = kind != _SKIP
    pid = np.array([res.values[i] for i in res.pid[keep]], dtype=object)
    tid = np.array([res.values[i] for i in res.tid[keep]], dtype=object)
    return res.start[keep], res.start[keep] + res.dur[keep], kind[keep], pid, tid


def load_cpu_trace(
    path: str, classifier: Classifier, first: ScanResult, rank: int | None, ranges: Ranges
) -> TraceData:
    """Build CPU-trace rows from the first pass (annotations) and a second pass for `cpu_op` events.

    Args:
        path: The trace file.
        classifier: Name rules.
        first: Annotation events from the first pass.
        rank: Rank of the trace, if known.
        ranges: Dispatch/combine and step ranges already taken from `first`.
    """
    with open_binary(path) as fh:
        ops = scan_events(fh, path, ("cpu_op",))
    parts = [
        _rows(first, [_annotation_kind(n, classifier) for n in first.names]),
        _rows(ops, [_op_kind(n, classifier) for n in ops.names]),
    ]
    start, end, kind, pid, tid = (np.concatenate(col) for col in zip(*parts, strict=True))
    notes = ["no GPU activity: analysed as a CPU trace (comm = gloo:/nccl ranges, compute = CPU ops per thread)"]
    if start.size == 0:
        return TraceData(path, "kineto", "cpu", 0, [], Activity.empty(), ranges, notes)
    pid_list, tid_list = pid.tolist(), tid.tolist()
    pids = sorted(set(pid_list), key=str)
    lane_of = {p: i for i, p in enumerate(pids)}
    pairs = list(zip(pid_list, tid_list, strict=True))
    threads = {t: i for i, t in enumerate(sorted(set(pairs), key=str))}
    lanes = [Lane(pid=p if isinstance(p, int) else None, device="cpu", rank=rank, source=path) for p in pids]
    activity = Activity(
        start=start,
        end=end,
        lane=np.array([lane_of[p] for p in pid_list], np.int32),
        kind=kind.astype(np.int8),
        thread=np.array([threads[pt] for pt in pairs], np.int32),
    )
    return TraceData(path, "kineto", "cpu", int(start.min()), lanes, activity, ranges, notes)


def compute_intervals(start: np.ndarray, end: np.ndarray, kind: np.ndarray, thread: np.ndarray) -> Intervals:
    """Union over threads of (that thread's compute) minus (that thread's communication)."""
    pieces_s: list[np.ndarray] = []
    pieces_e: list[np.ndarray] = []
    for t in np.unique(thread[kind == COMPUTE]):
        mine = thread == t
        comp = union(start[mine & (kind == COMPUTE)], end[mine & (kind == COMPUTE)])
        comm = mine & (kind == COMM)
        if comm.any():
            comp = subtract(comp, union(start[comm], end[comm]))
        pieces_s.append(comp.starts)
        pieces_e.append(comp.ends)
    if not pieces_s:
        return Intervals.empty()
    return union(np.concatenate(pieces_s), np.concatenate(pieces_e))
