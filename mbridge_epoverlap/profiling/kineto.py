"""PyTorch/Kineto chrome traces (`.json`, `.json.gz`), read as a stream.

GPU traces: complete events (`X`, or `B`/`E` pairs) with `cat` `kernel` are kernels (classified by
name), `gpu_memcpy` and `gpu_memset` are memory operations. On these events `pid` is the GPU and `tid`
the stream; the host process id is taken from the CPU-side `user_annotation` events. A trace without
any GPU activity is analysed as a CPU trace (see `cpu_trace`), which needs a second pass for the
`cpu_op` events.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from mbridge_epoverlap.profiling import cpu_trace
from mbridge_epoverlap.profiling.classify import COMBINE_RANGE, DISPATCH_RANGE, MEMORY, Classifier, step_number
from mbridge_epoverlap.profiling.jsonstream import ScanResult, scan_events
from mbridge_epoverlap.profiling.model import Activity, Lane, Ranges, TraceData
from mbridge_epoverlap.profiling.sources import open_binary, rank_from_filename

FIRST_PASS = ("kernel", "gpu_memcpy", "gpu_memset", "user_annotation")
KERNEL, MEMCPY, MEMSET, ANNOTATION = range(4)


def _rank(header: dict, path: str) -> int | None:
    info = header.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    return rank_from_filename(path)


def _pid_column(res: ScanResult, rows: np.ndarray) -> np.ndarray:
    """The pid value of the selected rows as int64, -1 where it is not an integer."""
    as_int = np.array([v if isinstance(v, int) else -1 for v in res.values] or [-1], np.int64)
    return as_int[res.pid[rows]]


def annotation_ranges(res: ScanResult, rows: np.ndarray) -> Ranges:
    """Dispatch/combine and step ranges among the given annotation rows."""
    wanted = np.array(
        [bool(DISPATCH_RANGE.search(n) or COMBINE_RANGE.search(n) or step_number(n) is not None) for n in res.names]
        or [False],
        dtype=bool,
    )
    rows = rows[wanted[res.name[rows]]]
    return Ranges(
        start=res.start[rows],
        end=res.start[rows] + res.dur[rows],
        pid=_pid_column(res, rows),
        names=[res.names[i] for i in res.name[rows]],
    )


def _host_pid(res: ScanResult, annotations: np.ndarray) -> int | None:
    pids = [p for p in _pid_column(res, annotations).tolist() if p >= 0]
    return Counter(pids).most_common(1)[0][0] if pids else None


def load_kineto(path: str, classifier: Classifier) -> TraceData:
    """Load a Kineto/Chrome trace, streaming it.

    Args:
        path: `.json` or `.json.gz` file (compression is detected from the content).
        classifier: Name rules for kernels and ranges.

    Returns:
        GPU kernels and memory operations per (process, GPU) lane, or, for a trace without GPU
        activity, CPU work per process (see `cpu_trace`).

    Raises:
        UsageError: Not a trace, malformed or truncated.
    """
    with open_binary(path) as fh:
        res = scan_events(fh, path, FIRST_PASS)
    rank = _rank(res.header, path)
    annotations = np.flatnonzero(res.cat == ANNOTATION)
    ranges = annotation_ranges(res, annotations)
    gpu_rows = np.flatnonzero(res.cat != ANNOTATION)
    if gpu_rows.size == 0:
        return cpu_trace.load_cpu_trace(path, classifier, res, rank, ranges)

    host_pid = _host_pid(res, annotations)
    name_kind = np.array(classifier.kinds(res.names), dtype=np.int8)
    cat = res.cat[gpu_rows]
    kind = np.where(cat == KERNEL, name_kind[res.name[gpu_rows]], MEMORY).astype(np.int8)
    device_ids, lane = np.unique(res.pid[gpu_rows], return_inverse=True)
    lanes = [Lane(pid=host_pid, device=res.values[int(d)], rank=rank, source=path) for d in device_ids]
    start = res.start[gpu_rows]
    activity = Activity(start, start + res.dur[gpu_rows], lane.astype(np.int32), kind)
    return TraceData(
        path=path,
        format="kineto",
        kind="gpu",
        origin_ns=int(start.min()),
        lanes=lanes,
        activity=activity,
        ranges=ranges,
    )
