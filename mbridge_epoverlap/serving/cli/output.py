"""How the serving commands print a result: JSON on stdout, or a two-column table."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_result(result: dict[str, Any], as_json: bool, table: Any) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        table(result)


def fmt(value: Any, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)




def print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
