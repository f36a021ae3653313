"""Output of `mbridge-epoverlap profile`: the JSON document and the human-readable tables."""

from __future__ import annotations

import json
import os
import sys
from typing import TextIO

from mbridge_epoverlap.profiling.analyze import NS_PER_MS, TraceReport


def to_json_dict(reports: list[TraceReport], comparison: dict | None = None) -> dict:
    """The `--json` document: `{"traces": [...], "comparison": {...}}` (comparison only with --compare)."""
    doc: dict = {"traces": [r.to_dict() for r in reports]}
    if comparison is not None:
        doc["comparison"] = comparison
    return doc


def write_json(reports: list[TraceReport], comparison: dict | None, out: TextIO) -> None:
    """Write the JSON document."""
    json.dump(to_json_dict(reports, comparison), out, indent=2)
    out.write("\n")


def _ms(ns: int) -> str:
    return f"{ns / NS_PER_MS:,.3f}"


def _where(d) -> str:
    parts = []
    if d.rank is not None:
        parts.append(f"rank {d.rank}")
    if d.pid is not None:
        parts.append(f"pid {d.pid}")
    return ", ".join(parts) or "-"


def write_table(reports: list[TraceReport], comparison: dict | None, out: TextIO | None = None) -> None:
    """Print one table per trace (times in ms) and, with a comparison, a before/after table."""
    from rich.console import Console
    from rich.table import Table

    out = out or sys.stdout
    width = None if out.isatty() else 200  # keep columns whole when piped
    console = Console(file=out, width=width, highlight=False)
    for report in reports:
        title = report.path
        if report.window is not None:
            title += f"  (window {report.window.text})"
        table = Table(title=title, title_justify="left")
        for col in ("file", "where", "device", "kernels", "comm ms", "compute ms", "overlap ms", "exposed ms"):
            table.add_column(col, justify="left" if col in ("file", "where") else "right")
        for col in ("active ms", "overlap %", "dispatch ms", "combine ms"):
            table.add_column(col, justify="right")
        for d in report.devices:
            table.add_row(
                os.path.basename(d.source),
                _where(d),
                "-" if d.device is None else str(d.device),
                f"{d.kernels:,}",
                _ms(d.comm_ns),
                _ms(d.compute_ns),
                _ms(d.overlap_ns),
                _ms(d.exposed_comm_ns),
                _ms(d.active_ns),
                "-" if d.overlap_pct is None else f"{d.overlap_pct:.2f}",
                _ms(d.nvtx.get("dispatch_ns", 0)),
                _ms(d.nvtx.get("combine_ns", 0)),
            )
        console.print(table)
        console.print(f"[dim]{report.rule}[/dim]")
        for note in report.notes:
            console.print(f"[dim]note: {note}[/dim]")
    if comparison is not None:
        table = Table(title="before -> after", title_justify="left")
        for col in ("metric", "before", "after"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        rows = (
            ("comm overlapped with compute (ms)", "overlap_ms", "{:,.3f}"),
            ("  as share of comm time (%)", "overlap_pct_of_comm", "{:.2f}"),
            ("exposed comm (ms)", "exposed_comm_ms", "{:,.3f}"),
            ("comm union (ms)", "comm_ms", "{:,.3f}"),
            ("active union (ms)", "active_ms", "{:,.3f}"),
            ("kernels", "kernels", "{:,}"),
        )
        for label, key, fmt in rows:
            pair = comparison[key]
            table.add_row(label, *("-" if pair[s] is None else fmt.format(pair[s]) for s in ("before", "after")))
        console.print(table)
        console.print(comparison["summary"])
        console.print(f"[dim]{comparison['scope']}[/dim]")
