"""Interval algebra on integer nanoseconds, vectorised with numpy.

Every set of intervals is reduced to an `Intervals` value: sorted, pairwise disjoint, non-empty
half-open intervals `[start, end)`. Union, intersection, difference and clipping all return that
normal form, so lengths are exact integer sums and never count a nanosecond twice (summing kernel
durations would: concurrent kernels overlap each other).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_I64 = np.int64


@dataclass(frozen=True)
class Intervals:
    """Disjoint, sorted, non-empty half-open intervals.

    Attributes:
        starts: int64 array of interval starts, strictly increasing.
        ends: int64 array of interval ends; `starts[i] < ends[i] < starts[i + 1]`.
    """

    starts: np.ndarray
    ends: np.ndarray

    @property
    def length(self) -> int:
        """Total covered length in nanoseconds."""
        return int((self.ends - self.starts).sum()) if self.starts.size else 0

    def __len__(self) -> int:
        return int(self.starts.size)

    @classmethod
    def empty(cls) -> Intervals:
        """The empty set."""
        return cls(np.empty(0, _I64), np.empty(0, _I64))


def union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """Union of arbitrary intervals (any order, nested, touching or empty).

    Sorts by start, keeps a running maximum of the ends and cuts a new interval wherever a start
    lies beyond everything seen so far. Touching intervals (`end == next start`) are merged.

    Args:
        starts: Interval starts (ns).
        ends: Interval ends (ns); intervals with `end <= start` are dropped.

    Returns:
        The union in normal form.
    """
    s = np.asarray(starts, dtype=_I64)
    e = np.asarray(ends, dtype=_I64)
    keep = e > s
    if not keep.all():
        s, e = s[keep], e[keep]
    if s.size == 0:
        return Intervals.empty()
    # Stable sort is a timsort for int64: near-linear on the nearly sorted streams traces hold.
    order = np.argsort(s, kind="stable")
    s = s[order]
    reach = np.maximum.accumulate(e[order])
    cuts = np.flatnonzero(s[1:] > reach[:-1]) + 1
    first = np.concatenate(([0], cuts))
    last = np.concatenate((cuts - 1, [s.size - 1]))
    return Intervals(s[first], reach[last])


def covered_before(a: Intervals, t: np.ndarray) -> np.ndarray:
    """Length of `a` that lies before each time in `t` (the cumulative measure of `a`)."""
    t = np.asarray(t, dtype=_I64)
    if len(a) == 0:
        return np.zeros(t.shape, dtype=_I64)
    before = np.concatenate(([0], np.cumsum(a.ends - a.starts)))
    idx = np.searchsorted(a.starts, t, side="right") - 1
    safe = np.maximum(idx, 0)
    partial = np.minimum(t, a.ends[safe]) - a.starts[safe]
    return np.where(idx >= 0, before[safe] + partial, 0)


def intersection_length(a: Intervals, b: Intervals) -> int:
    """Length of `a` intersected with `b`, without building the intersection.

    For every interval of the smaller set, the covered length of the other set between its start
    and end is a difference of two cumulative-measure look-ups (binary searches).
    """
    if len(a) == 0 or len(b) == 0:
        return 0
    if len(a) < len(b):
        a, b = b, a
    return int((covered_before(a, b.ends) - covered_before(a, b.starts)).sum())


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """Intersection of two interval sets in normal form."""
    if len(a) == 0 or len(b) == 0:
        return Intervals.empty()
    times = np.concatenate((a.starts, a.ends, b.starts, b.ends))
    steps = np.concatenate(
        (
            np.ones(len(a), np.int8),
            -np.ones(len(a), np.int8),
            np.ones(len(b), np.int8),
            -np.ones(len(b), np.int8),
        )
    )
    # At equal times closings sort first, so touching intervals do not make empty pieces.
    order = np.lexsort((steps, times))
    times = times[order]
    depth = np.cumsum(steps[order], dtype=np.int64)
    # Each set is disjoint, so depth 2 means "inside both"; the piece ends at the next event.
    opened = np.flatnonzero(depth == 2)
    starts, ends = times[opened], times[opened + 1]
    keep = ends > starts
    return Intervals(starts[keep], ends[keep])


def subtract(a: Intervals, b: Intervals) -> Intervals:
    """The part of `a` not covered by `b`."""
    if len(a) == 0 or len(b) == 0:
        return a
    lo = min(int(a.starts[0]), int(b.starts[0])) - 1
    hi = max(int(a.ends[-1]), int(b.ends[-1])) + 1
    gaps = Intervals(np.concatenate(([lo], b.ends)), np.concatenate((b.starts, [hi])))
    keep = gaps.ends > gaps.starts
    return intersect(a, Intervals(gaps.starts[keep], gaps.ends[keep]))


def clip(starts: np.ndarray, ends: np.ndarray, lo: int | None, hi: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Clip raw intervals to the window `[lo, hi)`; `None` leaves that side open.

    Intervals left empty by the clip are kept (with `end <= start`); `union` drops them.
    """
    s = np.asarray(starts, dtype=_I64)
    e = np.asarray(ends, dtype=_I64)
    if lo is not None:
        s = np.maximum(s, lo)
    if hi is not None:
        e = np.minimum(e, hi)
    return s, e


def in_window(starts: np.ndarray, ends: np.ndarray, lo: int | None, hi: int | None) -> np.ndarray:
    """Mask of the intervals that touch `[lo, hi)`; a zero-length one counts if its instant is inside."""
    s = np.asarray(starts, dtype=_I64)
    e = np.maximum(np.asarray(ends, dtype=_I64), s + 1)
    mask = np.ones(s.shape, dtype=bool)
    if lo is not None:
        mask &= e > lo
    if hi is not None:
        mask &= s < hi
    return mask
