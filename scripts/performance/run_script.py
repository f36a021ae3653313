#!/usr/bin/env python3
"""Perf harness front door, with Megatron-Bridge's run_script.py flags; see `--help`.

Runs from a checkout without installing: the repository root goes on sys.path when the package is
not importable.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import mbridge_epoverlap  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mbridge_epoverlap.harness.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog=Path(sys.argv[0]).name))
