"""Nsight Systems SQLite exports (`nsys export --type sqlite`), any schema version seen so far.

Exports carry a table only when it has data, and older ones lack columns (`globalPid`,
`greenContextId`, ...), so every table and column is looked up before use.

Speed: each needed column is pulled with one `group_concat` per block of rows and parsed by numpy,
which avoids one Python tuple per kernel; names are classified once per distinct string id.
"""

from __future__ import annotations

import sqlite3
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling.classify import (
    COMBINE_RANGE,
    COMPUTE,
    DISPATCH_RANGE,
    MEMORY,
    Classifier,
    step_number,
)
from mbridge_epoverlap.profiling.model import Activity, Lane, Ranges, TraceData
from mbridge_epoverlap.profiling.sources import rank_from_filename

KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
MEMORY_TABLES = ("CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
NVTX_TABLE = "NVTX_EVENTS"
NVTX_RANGE_TYPES = (59, 60)  # push/pop and start/end ranges; 34 (marks) have no length
_BLOCK_ROWS = 1 << 21  # rows per group_concat, bounds the size of one concatenated string


def _connect(path: str) -> sqlite3.Connection:
    # Read-only and immutable: fixture folders are read-only, and a finished export never changes.
    uri = Path(path).resolve().as_uri() + "?mode=ro&immutable=1"
    return sqlite3.connect(uri, uri=True)


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in con.execute(f'PRAGMA table_info("{table}")')}


def _parse_ints(text: str | None, rows: int) -> np.ndarray:
    if not text:
        return np.empty(0, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = np.fromstring(text, dtype=np.int64, sep=",")
    if values.size != rows:  # numpy stops quietly at a non-integer; redo strictly (ValueError if not ints)
        values = np.array([int(v) for v in text.split(",")], dtype=np.int64)
    return values


def _fetch(con: sqlite3.Connection, table: str, exprs: list[str]) -> list[np.ndarray]:
    """Integer expressions over every row of `table` as numpy arrays (the expressions handle NULLs)."""
    lo, hi, rows = con.execute(f'SELECT min(rowid), max(rowid), count(*) FROM "{table}"').fetchone()
    if lo is None:
        return [np.empty(0, np.int64) for _ in exprs]
    # Blocks of row ids bound the size of one concatenated string; sparse ids get a single pass.
    dense = hi - lo < 4 * rows + _BLOCK_ROWS
    blocks = [(b, b + _BLOCK_ROWS) for b in range(lo, hi + 1, _BLOCK_ROWS)] if dense else [(lo, hi + 1)]
    concat = ", ".join(f"group_concat({e})" for e in exprs)
    # Rows without a start or end cannot be placed on the timeline; skipping them keeps columns aligned.
    sql = (
        f'SELECT count(*), {concat} FROM "{table}" '
        "WHERE rowid >= ? AND rowid < ? AND start IS NOT NULL AND end IS NOT NULL"
    )
    parts: list[list[np.ndarray]] = [[] for _ in exprs]
    for first, stop in blocks:
        count, *texts = con.execute(sql, (first, stop)).fetchone()
        for slot, text in zip(parts, texts, strict=True):
            slot.append(_parse_ints(text, count))
    return [np.concatenate(p) for p in parts]


def _lane_expr(cols: set[str]) -> str:
    """SQL for the lane key `(pid + 1) << 20 | device`, pid -1 when unknown; one column instead of two."""
    device = "(ifnull(deviceId, 0) & 1048575)" if "deviceId" in cols else "0"
    if "globalPid" not in cols:
        return device
    return f"(CASE WHEN globalPid IS NULL THEN 0 ELSE ((globalPid >> 24) & 16777215) + 1 END) * 1048576 + {device}"


def _pid_from_global(global_ids: np.ndarray) -> np.ndarray:
    return np.where(global_ids < 0, -1, (global_ids >> 24) & 0xFFFFFF)


def _kernel_kinds(con: sqlite3.Connection, ids: np.ndarray, classifier: Classifier) -> np.ndarray:
    """Per-row class from the name's string id; each distinct name is classified once."""
    if ids.size == 0:
        return np.empty(0, np.int8)
    top = int(ids.max())
    dense = 0 <= top < (1 << 26)  # string ids are small and dense in practice: use a lookup table
    present = np.flatnonzero(np.bincount(ids[ids >= 0], minlength=top + 1)) if dense else np.unique(ids[ids >= 0])
    wanted = [int(i) for i in present]
    names: dict[int, str] = {}
    for start in range(0, len(wanted), 900):  # SQLite's bound-parameter limit
        chunk = wanted[start : start + 900]
        marks = ",".join("?" * len(chunk))
        names.update(con.execute(f"SELECT id, value FROM StringIds WHERE id IN ({marks})", chunk).fetchall())
    kinds = np.array([classifier.kind(names.get(i) or "") for i in wanted] or [COMPUTE], np.int8)
    if dense:
        lut = np.full(top + 2, COMPUTE, np.int8)  # the last slot serves id -1 (no name)
        lut[present] = kinds[: present.size]
        return lut[ids]
    pos = np.clip(np.searchsorted(present, ids), 0, max(present.size - 1, 0))
    hit = (ids >= 0) & (present.size > 0) & (present[pos] == ids)
    return np.where(hit, kinds[pos], COMPUTE).astype(np.int8)


def _report_range(name: str) -> bool:
    return bool(DISPATCH_RANGE.search(name) or COMBINE_RANGE.search(name) or step_number(name) is not None)


def _nvtx_ranges(
    con: sqlite3.Connection, tables: set[str], notes: list[str], keep: Callable[[str], bool] | None = _report_range
) -> Ranges:
    """NVTX push/pop and start/end ranges; with the default `keep`, only those the report uses."""
    if NVTX_TABLE not in tables:
        notes.append("no NVTX_EVENTS table: dispatch/combine and step ranges unavailable")
        return Ranges.empty()
    cols = _columns(con, NVTX_TABLE)
    if not {"start", "end"} <= cols:
        notes.append("NVTX_EVENTS lacks start/end columns: ranges ignored")
        return Ranges.empty()
    sources = []
    join = ""
    if "text" in cols:
        sources.append("n.text")
    if "textId" in cols and "StringIds" in tables:
        sources.append("s.value")
        join = " LEFT JOIN StringIds s ON s.id = n.textId"
    if not sources:
        return Ranges.empty()
    name = sources[0] if len(sources) == 1 else f"COALESCE({', '.join(sources)})"
    tid = "n.globalTid" if "globalTid" in cols else "NULL"
    where = "n.end IS NOT NULL AND n.start IS NOT NULL"
    if "eventType" in cols:
        where += f" AND n.eventType IN {NVTX_RANGE_TYPES}"
    if keep is _report_range:
        # LIKE is case-insensitive for ASCII: a cheap pre-filter before the exact Python rules.
        where += (
            " AND (label LIKE '%dispatch%' OR label LIKE '%combine%' OR label LIKE '%step%' OR label LIKE '%iter%')"
        )
    sql = f"SELECT n.start, n.end, {tid}, {name} AS label FROM {NVTX_TABLE} n{join} WHERE {where}"
    rows = [r for r in con.execute(sql) if r[3] is not None and (keep is None or keep(r[3]))]
    if not rows:
        return Ranges.empty()
    start = np.array([r[0] for r in rows], np.int64)
    end = np.array([r[1] for r in rows], np.int64)
    gtid = np.array([-1 if r[2] is None else r[2] for r in rows], np.int64)
    return Ranges(start, end, _pid_from_global(gtid), [r[3] for r in rows])


def read_nvtx(path: str, keep: Callable[[str], bool] | None = None) -> Ranges:
    """All NVTX ranges of an export (names resolved through `text` or `textId`), optionally filtered.

    Args:
        path: The `.sqlite` export.
        keep: Predicate on the range name; None keeps every range.

    Returns:
        The ranges; empty when the export has no NVTX table.
    """
    con = _connect(path)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        return _nvtx_ranges(con, tables, [], keep)
    except sqlite3.DatabaseError as exc:
        raise UsageError(
            f"{path}: not a readable SQLite export ({exc}); pass an `nsys export --type sqlite` file"
        ) from None
    finally:
        con.close()


def load_nsys(path: str, classifier: Classifier) -> TraceData:
    """Load an Nsight Systems SQLite export.

    Args:
        path: The `.sqlite` file.
        classifier: Name rules for kernels.

    Returns:
        Kernels (and memcpy/memset rows) per (process, device) lane, plus dispatch/combine and
        step NVTX ranges.

    Raises:
        UsageError: The file is not an SQLite database or has no kernel table.
    """
    try:
        con = _connect(path)
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    except sqlite3.DatabaseError as exc:
        raise UsageError(
            f"{path}: not a readable SQLite database ({exc}); pass an `nsys export --type sqlite` file"
        ) from None
    try:
        return _load(con, path, tables, classifier)
    except (sqlite3.DatabaseError, ValueError) as exc:
        raise UsageError(
            f"{path}: damaged or unsupported SQLite export ({exc}); export again with `nsys export --type sqlite`"
        ) from None
    finally:
        con.close()


def _load(con: sqlite3.Connection, path: str, tables: set[str], classifier: Classifier) -> TraceData:
    if KERNEL_TABLE not in tables:
        raise UsageError(
            f"{path}: no {KERNEL_TABLE} table, so the export holds no GPU kernels; profile with "
            "`nsys profile --trace=cuda,nvtx ...` and export again with `nsys export --type sqlite`"
        )
    notes: list[str] = []
    cols = _columns(con, KERNEL_TABLE)
    if not {"start", "end"} <= cols:
        raise UsageError(f"{path}: {KERNEL_TABLE} has no start/end columns; this is not an Nsight Systems export")
    # The demangled name carries the namespace (`deep_ep::...`) that the short name drops.
    name_exprs = [c for c in ("demangledName", "shortName") if c in cols]
    has_strings = "StringIds" in tables
    if not name_exprs or not has_strings:
        notes.append("kernel names unavailable: every kernel counted as compute")
    if "globalPid" not in cols:
        notes.append("no globalPid column: process id unknown")
    if name_exprs and has_strings:
        name = name_exprs[0] if len(name_exprs) == 1 else f"COALESCE({', '.join(name_exprs)})"
        exprs = ["start", "end", _lane_expr(cols), f"ifnull({name}, -1)"]
        start, end, key, name_ids = _fetch(con, KERNEL_TABLE, exprs)
        kind = _kernel_kinds(con, name_ids, classifier)
    else:
        start, end, key = _fetch(con, KERNEL_TABLE, ["start", "end", _lane_expr(cols)])
        kind = np.full(start.size, COMPUTE, np.int8)

    starts, ends, keys, kinds = [start], [end], [key], [kind]
    for table in MEMORY_TABLES:
        if table not in tables:
            continue
        mcols = _columns(con, table)
        if not {"start", "end"} <= mcols:
            continue
        ms, me, mk = _fetch(con, table, ["start", "end", _lane_expr(mcols)])
        starts.append(ms)
        ends.append(me)
        keys.append(mk)
        kinds.append(np.full(ms.size, MEMORY, np.int8))

    key = np.concatenate(keys)
    # Few distinct lanes: find them with a cheap strided probe plus an exact check, not a full sort.
    uniq = np.unique(key[:: max(1, key.size // 4096)]) if key.size else key
    lane = np.searchsorted(uniq, key)
    if key.size and not np.array_equal(uniq[np.minimum(lane, uniq.size - 1)], key):
        uniq = np.unique(key)
        lane = np.searchsorted(uniq, key)
    pids = {int(k >> 20) - 1 for k in uniq}
    rank = rank_from_filename(path) if len(pids) == 1 else None
    lanes = [
        Lane(pid=None if (k >> 20) - 1 < 0 else int(k >> 20) - 1, device=int(k & 0xFFFFF), rank=rank, source=path)
        for k in uniq
    ]
    activity = Activity(np.concatenate(starts), np.concatenate(ends), lane.astype(np.int32), np.concatenate(kinds))
    origin = int(activity.start.min()) if activity.start.size else 0
    return TraceData(
        path=path,
        format="nsys",
        kind="gpu",
        origin_ns=origin,
        lanes=lanes,
        activity=activity,
        ranges=_nvtx_ranges(con, tables, notes),
        notes=notes,
    )
