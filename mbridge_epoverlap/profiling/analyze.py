"""Per-device overlap figures of one trace (file or folder of per-rank files), and A/B comparison.

Figures of a lane, all integer nanoseconds after clipping to the window:

* `comm_ns`: length of the union of communication intervals;
* `compute_ns`: length of the union of compute intervals;
* `overlap_ns`: length of the intersection of the two unions;
* `exposed_comm_ns`: `comm_ns - overlap_ns`;
* `active_ns`: length of the union of all work, memory operations included;
* `overlap_pct`: `100 * overlap_ns / comm_ns` (None without communication);
* `nvtx`: union lengths of the process's annotation ranges whose names contain `dispatch` (not
  `pre_dispatch`) and `combine`, and how many such ranges there are.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import numpy as np

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling.classify import COMBINE_RANGE, COMM, COMPUTE, DISPATCH_RANGE, MEMORY, Classifier
from mbridge_epoverlap.profiling.intervals import clip, in_window, intersection_length, union
from mbridge_epoverlap.profiling.model import Lane, TraceData
from mbridge_epoverlap.profiling.sources import expand, is_gzip, sniff
from mbridge_epoverlap.profiling.window import WindowSpec, parse_window, resolve

NS_PER_MS = 1_000_000


@dataclass
class DeviceFigures:
    """Overlap figures of one (process, device) lane, integer ns (see the module docstring).

    Attributes:
        pid: Process id (None when the trace does not record it).
        device: GPU index, "cpu" for CPU traces, None for the all-zero entry of an empty trace.
        rank: Distributed rank when known (Kineto `distributedInfo`, or `rank<N>` in the file name).
        source: File the lane came from.
        kind: "gpu" or "cpu".
        kernels: Compute plus communication kernels (CPU traces: ops, stage ranges, gloo ranges).
        comm_kernels: Communication kernels among them.
        memory_ops: Memcpy/memset operations (in `active_ns` only).
        comm_ns, compute_ns, overlap_ns, exposed_comm_ns, active_ns, overlap_pct: The figures.
        nvtx: `dispatch_ns`, `combine_ns` (union lengths), `ranges`, `dispatch_ranges`, `combine_ranges`.
        window_ns: Absolute `[start, end)` of the window on the trace's clock (None: whole trace).
    """

    pid: int | None
    device: int | str | None
    rank: int | None
    source: str
    kind: str
    kernels: int = 0
    comm_kernels: int = 0
    memory_ops: int = 0
    comm_ns: int = 0
    compute_ns: int = 0
    overlap_ns: int = 0
    exposed_comm_ns: int = 0
    active_ns: int = 0
    overlap_pct: float | None = None
    nvtx: dict = field(default_factory=lambda: {"dispatch_ns": 0, "combine_ns": 0, "ranges": 0})
    window_ns: list[int | None] | None = None

    def to_dict(self) -> dict:
        """JSON form (the keys of the `devices` entries)."""
        return asdict(self)


@dataclass
class TraceReport:
    """Figures of every lane of one trace argument (a file, or a folder of per-rank files).

    Attributes:
        path: The argument as given.
        files: The trace files read.
        format: "nsys", "kineto" or "mixed".
        devices: One entry per (process, device) lane.
        window: The `--window` applied, if any.
        rule: The classification rule, in words.
        notes: Remarks on missing tables, columns or data.
    """

    path: str
    files: list[str]
    format: str
    devices: list[DeviceFigures]
    window: WindowSpec | None = None
    rule: str = ""
    notes: list[str] = field(default_factory=list)

    def totals(self) -> dict:
        """Figures summed over all lanes (overlap share recomputed from the sums)."""
        keys = ("kernels", "comm_kernels", "memory_ops", "comm_ns", "compute_ns", "overlap_ns", "exposed_comm_ns")
        out = {k: sum(getattr(d, k) for d in self.devices) for k in keys}
        out["active_ns"] = sum(d.active_ns for d in self.devices)
        out["overlap_pct"] = _pct(out["overlap_ns"], out["comm_ns"])
        out["devices"] = len(self.devices)
        return out

    def to_dict(self) -> dict:
        """JSON form: `{"path", "files", "format", "window", "rule", "notes", "devices": [...]}`."""
        return {
            "path": self.path,
            "files": self.files,
            "format": self.format,
            "window": self.window.to_dict() if self.window else None,
            "rule": self.rule,
            "notes": self.notes,
            "devices": [d.to_dict() for d in self.devices],
        }


def _pct(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 4) if whole else None


def load_trace(path: str, classifier: Classifier) -> TraceData:
    """Load one trace file of either format (detected from its content)."""
    if sniff(path) == "nsys":
        from mbridge_epoverlap.profiling.nsys import load_nsys

        if is_gzip(path):
            return _load_gzipped_nsys(path, classifier)
        return load_nsys(path, classifier)
    from mbridge_epoverlap.profiling.kineto import load_kineto

    return load_kineto(path, classifier)


def _load_gzipped_nsys(path: str, classifier: Classifier) -> TraceData:
    """SQLite reads only plain files: decompress a `.sqlite.gz` export into a temporary file first."""
    import dataclasses
    import gzip
    import shutil
    import tempfile

    from mbridge_epoverlap.profiling.nsys import load_nsys

    with tempfile.TemporaryDirectory(prefix="mbridge_epoverlap_nsys_") as tmp:
        plain = os.path.join(tmp, os.path.basename(path).removesuffix(".gz") or "trace.sqlite")
        try:
            with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except (OSError, EOFError) as exc:
            raise UsageError(f"{path}: cannot decompress ({exc}); compress the export again") from None
        data = load_nsys(plain, classifier)
    return dataclasses.replace(data, path=path)


def _nvtx(data: TraceData, lane: Lane, lo: int | None, hi: int | None) -> dict:
    r = data.ranges
    out = {"dispatch_ns": 0, "combine_ns": 0, "ranges": 0, "dispatch_ranges": 0, "combine_ranges": 0}
    if not r.names:
        return out
    mine = in_window(r.start, r.end, lo, hi)
    if lane.pid is not None:
        mine &= (r.pid == lane.pid) | (r.pid < 0)
    dispatch = np.array([bool(DISPATCH_RANGE.search(n)) for n in r.names]) & mine
    combine = np.array([bool(COMBINE_RANGE.search(n)) for n in r.names]) & mine
    for label, sel in (("dispatch", dispatch), ("combine", combine)):
        s, e = clip(r.start[sel], r.end[sel], lo, hi)
        out[f"{label}_ns"] = union(s, e).length
        out[f"{label}_ranges"] = int(sel.sum())
    out["ranges"] = int((dispatch | combine).sum())
    return out


def lane_figures(data: TraceData, index: int, window: WindowSpec | None) -> DeviceFigures:
    """Figures of lane `index` of a loaded trace, inside `window`."""
    lane = data.lanes[index]
    lo, hi = resolve(window, data, lane)
    act = data.activity
    rows = np.flatnonzero((act.lane == index) & in_window(act.start, act.end, lo, hi))
    start, end = clip(act.start[rows], act.end[rows], lo, hi)
    kind = act.kind[rows]
    is_comm, is_compute = kind == COMM, kind == COMPUTE
    comm = union(start[is_comm], end[is_comm])
    if data.kind == "cpu" and act.thread is not None:
        from mbridge_epoverlap.profiling.cpu_trace import compute_intervals

        compute = compute_intervals(start, end, kind, act.thread[rows])
    else:
        compute = union(start[is_compute], end[is_compute])
    overlap = intersection_length(comm, compute)
    return DeviceFigures(
        pid=lane.pid,
        device=lane.device,
        rank=lane.rank,
        source=lane.source,
        kind=data.kind,
        kernels=int(is_comm.sum() + is_compute.sum()),
        comm_kernels=int(is_comm.sum()),
        memory_ops=int((kind == MEMORY).sum()),
        comm_ns=comm.length,
        compute_ns=compute.length,
        overlap_ns=overlap,
        exposed_comm_ns=comm.length - overlap,
        active_ns=union(start, end).length,
        overlap_pct=_pct(overlap, comm.length),
        nvtx=_nvtx(data, lane, lo, hi),
        window_ns=None if window is None else [lo, hi],
    )


def trace_figures(data: TraceData, window: WindowSpec | None) -> list[DeviceFigures]:
    """Figures of every lane of a loaded trace; one all-zero entry when it has no work at all."""
    if not data.lanes:
        return [DeviceFigures(pid=None, device=None, rank=None, source=data.path, kind=data.kind)]
    return [lane_figures(data, i, window) for i in range(len(data.lanes))]


def analyze_trace(path: str, comm_regex: str | None = None, window: str | WindowSpec | None = None) -> TraceReport:
    """Analyse a trace file, or a folder of per-rank trace files as one multi-rank report.

    Args:
        path: Nsight Systems SQLite export, Kineto `.json`/`.json.gz`, or a folder of them.
        comm_regex: Extra communication-name pattern (see `Classifier`).
        window: `--window` text (e.g. "1.5s:3s", "steps:3:8") or a parsed `WindowSpec`.

    Returns:
        Per-device figures of every file.

    Raises:
        UsageError: Missing or unreadable input, bad pattern or window.
    """
    classifier = Classifier(comm_regex)
    spec = parse_window(window) if isinstance(window, str) else window
    files = expand(path)
    devices: list[DeviceFigures] = []
    notes: list[str] = []
    formats: set[str] = set()
    for file in files:
        data = load_trace(file, classifier)
        formats.add(data.format)
        devices.extend(trace_figures(data, spec))
        prefix = f"{os.path.basename(file)}: " if len(files) > 1 else ""
        notes.extend(prefix + n for n in data.notes)
    return TraceReport(
        path=path,
        files=files,
        format=formats.pop() if len(formats) == 1 else "mixed",
        devices=devices,
        window=spec,
        rule=classifier.describe(),
        notes=notes,
    )


def _pair(before: float | int | None, after: float | int | None) -> dict:
    return {"before": before, "after": after}


def _ms(ns: int) -> float:
    return round(ns / NS_PER_MS, 3)


def compare(before: TraceReport, after: TraceReport) -> dict:
    """Matched A/B block: the skill card's profile evidence, summed over each trace's devices.

    Returns:
        `{"before", "after", "scope", "kernels", "comm_ns", "comm_ms", "overlap_ns", "overlap_ms",
        "overlap_pct_of_comm", "active_ns", "active_ms", "exposed_comm_ns", "exposed_comm_ms",
        "same_kernel_count", "summary", "card"}`; pairs are `{"before": x, "after": y}`; `card` holds
        the same figures as the skill card's evidence lines.
    """
    a, b = before.totals(), after.totals()
    if a["devices"] != b["devices"]:
        scope = f"sum over devices ({a['devices']} before, {b['devices']} after: not a matched pair)"
    else:
        scope = f"sum over {a['devices']} device(s)"
    out = {
        "before": before.path,
        "after": after.path,
        "scope": scope,
        "kernels": _pair(a["kernels"], b["kernels"]),
        "same_kernel_count": a["kernels"] == b["kernels"],
        "comm_ns": _pair(a["comm_ns"], b["comm_ns"]),
        "comm_ms": _pair(_ms(a["comm_ns"]), _ms(b["comm_ns"])),
        "overlap_ns": _pair(a["overlap_ns"], b["overlap_ns"]),
        "overlap_ms": _pair(_ms(a["overlap_ns"]), _ms(b["overlap_ns"])),
        "overlap_pct_of_comm": _pair(a["overlap_pct"], b["overlap_pct"]),
        "active_ns": _pair(a["active_ns"], b["active_ns"]),
        "active_ms": _pair(_ms(a["active_ns"]), _ms(b["active_ns"])),
        "exposed_comm_ns": _pair(a["exposed_comm_ns"], b["exposed_comm_ns"]),
        "exposed_comm_ms": _pair(_ms(a["exposed_comm_ns"]), _ms(b["exposed_comm_ns"])),
    }
    out["summary"] = _summary(a, b)
    out["card"] = _card(a, b)
    return out


def _pct_text(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.2f} %"


def _change(what: str, before: str, after: str, rose: bool | None) -> str:
    if rose is None:
        return f"{what} stayed at {before}"
    return f"{what} {'rose' if rose else 'fell'} from {before} to {after}"


def _direction(before: int, after: int) -> bool | None:
    return None if before == after else after > before


def _card(a: dict, b: dict) -> dict:
    """The comparison as the skill card's evidence lines (`figures:` entries)."""
    return {
        "comm_concurrent_with_compute": (
            f"{_ms(a['overlap_ns']):,.3f} ms ({_pct_text(a['overlap_pct'])} of comm) -> "
            f"{_ms(b['overlap_ns']):,.3f} ms ({_pct_text(b['overlap_pct'])})"
        ),
        "gpu_active_union": f"{a['active_ns'] / 1e9:,.3f} s -> {b['active_ns'] / 1e9:,.3f} s",
        "exposed_comm": f"{_ms(a['exposed_comm_ns']):,.3f} ms -> {_ms(b['exposed_comm_ns']):,.3f} ms",
        "kernels": f"{a['kernels']:,} -> {b['kernels']:,}",
    }


def _summary(a: dict, b: dict) -> str:
    overlap = _change(
        "communication concurrent with compute",
        f"{_ms(a['overlap_ns']):,.3f} ms ({_pct_text(a['overlap_pct'])} of comm time)",
        f"{_ms(b['overlap_ns']):,.3f} ms ({_pct_text(b['overlap_pct'])})",
        _direction(a["overlap_ns"], b["overlap_ns"]),
    )
    active = _change(
        "the union of active intervals",
        f"{a['active_ns'] / 1e9:,.3f} s",
        f"{b['active_ns'] / 1e9:,.3f} s",
        _direction(a["active_ns"], b["active_ns"]),
    )
    exposed = f"exposed communication {_ms(a['exposed_comm_ns']):,.3f} ms -> {_ms(b['exposed_comm_ns']):,.3f} ms"
    kernels = f"kernels {a['kernels']:,} -> {b['kernels']:,}"
    return f"{overlap}; {active}; {exposed}; {kernels}"


def require_pair(count: int) -> None:
    """Raise the `--compare` usage error unless there are exactly two traces."""
    if count != 2:
        raise UsageError(f"--compare needs exactly two traces (before and after), got {count}; pass two paths")


def compare_or_raise(reports: list[TraceReport]) -> dict:
    """`compare` for exactly two reports, else a UsageError naming the fix."""
    require_pair(len(reports))
    return compare(reports[0], reports[1])
