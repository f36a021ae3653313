"""Argument types shared by every command's argparse parser: one definition of each.

Each raises `argparse.ArgumentTypeError`, so argparse reports the flag and exits 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


def number_above(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: a finite number > `minimum` (>= with `inclusive`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'at least' if inclusive else 'more than'} {minimum:g}")
        return value

    return parse


positive_seconds = number_above(0.0, inclusive=False)
non_negative_seconds = number_above(0.0, inclusive=True)
positive = int_at_least(1)
count = int_at_least(0)

