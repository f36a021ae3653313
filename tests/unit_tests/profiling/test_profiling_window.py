"""`--window` parsing."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.profiling.window import parse_window


@pytest.mark.parametrize(
    ("text", "lo", "hi"),
    [
        ("1000:2000", 1000, 2000),
        ("1.5s:3s", 1_500_000_000, 3_000_000_000),
        ("250ms:", 250_000_000, None),
        (":2e9", None, 2_000_000_000),
        ("10us:20\u00b5s", 10_000, 20_000),
        (" 1 ms : 2 MS ", 1_000_000, 2_000_000),
    ],
)
def test_time_windows(text, lo, hi):
    spec = parse_window(text)
    assert (spec.lo, spec.hi, spec.steps) == (lo, hi, None)


def test_step_windows():
    assert parse_window("steps:3:8").steps == (3, 8)
    assert parse_window("STEPS:5").steps == (5, 5)
    assert parse_window(None) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("3s:1s", "end is not after start"),
        ("abc:1", "cannot read 'abc' as a time"),
        ("1:2:3", "expected one ':'"),
        ("10", "expected one ':'"),
        ("steps:8:3", "last step 3 is before first step 8"),
        ("steps:a:b", "steps need numbers"),
        ("1h:2h", "cannot read '1h'"),
    ],
)
def test_bad_windows(text, message):
    with pytest.raises(UsageError, match=message):
        parse_window(text)
