"""After a profiled A/B: read every case's traces with the profile analyzer and add its figures to the case.

`comm_hidden_pct` is the share of communication time that overlaps compute, summed over every rank's lane;
`exposed_comm_per_iter_s` the communication time left exposed, per lane and per profiled iteration. These
are the skill card's method (interval unions, never summed kernel time), done by the tool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TRACE_FIELDS = ("comm_hidden_pct", "exposed_comm_per_iter_s")


def trace_figures(trace_dir: str, iterations: int) -> dict[str, Any]:
    """The two figures for one case's trace folder, or `trace_error` when it cannot be read."""
    from mbridge_epoverlap.errors import UsageError
    from mbridge_epoverlap.profiling.analyze import analyze_trace

    try:
        report = analyze_trace(trace_dir)
    except UsageError as exc:
        return {"comm_hidden_pct": None, "exposed_comm_per_iter_s": None, "trace_error": str(exc)}
    totals = report.totals()
    lanes = max(totals["devices"], 1)
    exposed = totals["exposed_comm_ns"] / 1e9 / lanes / max(iterations, 1)
    return {"comm_hidden_pct": totals["overlap_pct"], "exposed_comm_per_iter_s": exposed}


def add_trace_figures(results: dict[str, Any]) -> dict[str, Any]:
    """Add the figures to every case of `results` that has a trace folder on disk (in place; returned)."""
    iterations = int(results.get("max_steps") or 1)
    for case in results["cases"]:
        trace_dir = case.get("trace_dir")
        if trace_dir and Path(trace_dir).exists():
            case.update(trace_figures(trace_dir, iterations))
    return results
