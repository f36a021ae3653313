"""Profile analyzer: communication/compute overlap from Nsight Systems and Kineto traces.

Public API (imported lazily so `import mbridge_epoverlap.profiling` stays free of numpy):

    analyze_trace(path, comm_regex=None, window=None) -> TraceReport
    compare(before: TraceReport, after: TraceReport) -> dict
    TraceReport.to_dict(), DeviceFigures.to_dict()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mbridge_epoverlap.profiling.analyze import DeviceFigures, TraceReport, analyze_trace, compare

__all__ = ["DeviceFigures", "TraceReport", "analyze_trace", "compare"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mbridge_epoverlap.profiling import analyze

        return getattr(analyze, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
