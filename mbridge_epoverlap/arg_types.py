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


positive = int_at_least(1)
count = int_at_least(0)
