"""Argument types shared by every command's argparse parser: one definition of each.

Each raises `argparse.ArgumentTypeError`, so argparse reports the flag and exits 2. Two families with
their own messages: `int_at_least` (and `positive`, `count`) for the serving and tool commands, and the
Megatron-Bridge-compatible ones of the perf harness (`bool_arg`, `integer`, `number`, `positive_int`,
`positive_float`, `none_or`), whose names the generated flag tables show (`scripts/generate_docs.py`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


def bool_arg(text: str) -> bool:
    """`true/false` (also 1/0, yes/no, t/f, y/n), as Megatron-Bridge's run_script accepts."""
    value = text.strip().lower()
    if value in ("true", "1", "t", "yes", "y"):
        return True
    if value in ("false", "0", "f", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def none_or(convert: Callable[[str], T]) -> Callable[[str], T | None]:
    """`convert`, except that `None`/`none`/`null` means None; keeps `convert`'s name for the flag tables."""

    def parse(text: str) -> Any:
        if text.strip() in ("None", "none", "null"):
            return None
        return convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def integer(text: str) -> int:
    """A base-10 integer."""
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def number(text: str) -> float:
    """A number (float)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A base-10 integer >= 1."""
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number > 0."""
    value = number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
