"""Small arithmetic the rules and the CPU shrinker share for their fix suggestions."""

from __future__ import annotations


def largest_divisor(n: int, limit: int | None = None, above: int = 0) -> int:
    """The largest divisor of `n` that is <= `limit` (default `n`) and > `above`; `above + 1` if none is."""
    top = n if limit is None else min(n, limit)
    return next((d for d in range(top, above, -1) if n % d == 0), above + 1)
