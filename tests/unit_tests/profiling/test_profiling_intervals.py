"""Interval algebra: hand cases and a property test against a point-set reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mbridge_epoverlap.profiling.intervals import (
    Intervals,
    clip,
    covered_before,
    in_window,
    intersect,
    intersection_length,
    subtract,
    union,
)


def _u(pairs):
    return union(np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64))


def _pairs(iv: Intervals) -> list[tuple[int, int]]:
    return list(zip(iv.starts.tolist(), iv.ends.tolist(), strict=True))


def test_union_merges_nested_touching_and_drops_empty():
    iv = _u([(10, 20), (0, 5), (12, 15), (20, 30), (5, 5), (40, 41), (7, 6)])
    assert _pairs(iv) == [(0, 5), (10, 30), (40, 41)]
    assert iv.length == 5 + 20 + 1


def test_union_of_nothing():
    assert len(_u([])) == 0 and _u([]).length == 0


def test_intersection_and_difference():
    a, b = _u([(0, 10), (20, 30)]), _u([(5, 25), (28, 40)])
    assert _pairs(intersect(a, b)) == [(5, 10), (20, 25), (28, 30)]
    assert intersection_length(a, b) == intersection_length(b, a) == 12
    assert _pairs(subtract(a, b)) == [(0, 5), (25, 28)]
    assert _pairs(subtract(b, a)) == [(10, 20), (30, 40)]


def test_touching_sets_do_not_intersect():
    a, b = _u([(0, 10)]), _u([(10, 20)])
    assert intersection_length(a, b) == 0
    assert len(intersect(a, b)) == 0


def test_negative_times():
    a, b = _u([(-100, -10), (-5, 5)]), _u([(-50, 0)])
    assert a.length == 100
    assert intersection_length(a, b) == 45


def test_covered_before():
    a = _u([(0, 10), (20, 30)])
    assert covered_before(a, np.array([-5, 0, 5, 15, 25, 100])).tolist() == [0, 0, 5, 10, 15, 20]


def test_clip_and_window_mask():
    s, e = np.array([0, 10, 50, 60, 70]), np.array([20, 15, 55, 60, 90])
    mask = in_window(s, e, 12, 60)
    assert mask.tolist() == [True, True, True, False, False]
    cs, ce = clip(s[mask], e[mask], 12, 60)
    assert cs.tolist() == [12, 12, 50] and ce.tolist() == [20, 15, 55]
    assert in_window(np.array([60]), np.array([60]), 60, 61).tolist() == [True]  # zero-length inside


intervals = st.lists(st.tuples(st.integers(-30, 60), st.integers(0, 25)), max_size=25)


def _points(pairs) -> set[int]:
    return {t for s, d in pairs for t in range(s, s + d)}


def _build(pairs) -> Intervals:
    return union(np.array([s for s, _ in pairs], np.int64), np.array([s + d for s, d in pairs], np.int64))


@settings(max_examples=300, deadline=None)
@given(intervals, intervals, st.integers(-40, 70), st.integers(0, 60))
def test_algebra_matches_point_sets(a_pairs, b_pairs, lo, width):
    a, b = _build(a_pairs), _build(b_pairs)
    pa, pb = _points(a_pairs), _points(b_pairs)
    assert a.length == len(pa)
    assert np.all(a.starts[1:] > a.ends[:-1]) and np.all(a.ends > a.starts)  # normal form
    assert intersection_length(a, b) == len(pa & pb)
    assert intersect(a, b).length == len(pa & pb)
    assert subtract(a, b).length == len(pa - pb)
    assert union(np.concatenate((a.starts, b.starts)), np.concatenate((a.ends, b.ends))).length == len(pa | pb)
    hi = lo + width
    s, e = clip(a.starts, a.ends, lo, hi)
    assert union(s, e).length == len({t for t in pa if lo <= t < hi})
