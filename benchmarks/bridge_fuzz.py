"""The validator against Megatron-Bridge's own config code, per release: random configurations, disagreements by rule.

Runs `mbridge_epoverlap.config.bridge_fuzz` in each Python 3.12 environment that has a Megatron-Bridge release
the validator knows: 0.6.2 (`scripts/setup_bridge_venv.sh`; `--python` or `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`) and
main (`scripts/setup_bridge_main_venv.sh`; `--main-python` or `MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON`), and prints
each one's counts: configurations tried, accepted, rejected by Bridge, missed and false rejections, EP switches
that differ, and the validator's errors by rule on the rejected ones.

    python benchmarks/bridge_fuzz.py --python .bridge-venv/bin/python --main-python .bridge-main-venv/bin/python
    python benchmarks/bridge_fuzz.py --python .bridge-venv/bin/python --quick --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_release(python: str, samples: int, seed: int) -> tuple[int, dict[str, Any] | None, str]:
    """(exit status, the tally, stderr) of one environment's fuzz."""
    proc = subprocess.run([python, "-m", "mbridge_epoverlap.config.bridge_fuzz", "--samples", str(samples),
                           "--seed", str(seed), "--examples"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if not proc.stdout.strip():
        return 1, None, proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout), ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON"),
                        help="the Python 3.12 interpreter with Megatron-Bridge 0.6.2 installed")
    parser.add_argument("--main-python", default=os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON"),
                        help="the Python 3.12 interpreter with Megatron-Bridge main (optional)")
    parser.add_argument("--samples", type=int, default=None, help="configurations (default 2000, --quick 300)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--quick", action="store_true", help="300 configurations")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON only")
    args = parser.parse_args()
    pythons = {name: python for name, python in (("0.6.2", args.python), ("main", args.main_python)) if python}
    if not pythons:
        parser.error("give --python and/or --main-python (or set MBRIDGE_EPOVERLAP_BRIDGE_PYTHON / "
                     "MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON); scripts/setup_bridge_venv.sh and "
                     "scripts/setup_bridge_main_venv.sh build them")
    samples = args.samples or (300 if args.quick else 2000)
    status, releases = 0, {}
    for name, python in pythons.items():
        code, tally, errors = run_release(python, samples, args.seed)
        if tally is None:
            sys.stderr.write(f"{name}: {errors}")
            return 1
        status = status or code
        releases[tally["release"]["bridge"]] = tally
    if args.json:
        print(json.dumps({"releases": releases}))
        return status
    for name, tally in releases.items():
        print(f"Megatron-Bridge {name} on Megatron-Core {tally['release']['core']}: {tally['tried']} configurations, "
              f"{tally['accepted']} accepted, {tally['rejected_by_bridge']} rejected by Megatron-Bridge "
              f"({tally['other_rejected']} for reasons not modelled); missed {tally['missed']}, false rejections "
              f"{tally['false']} (on the built object {tally['false_on_object']}), EP switches differing "
              f"{tally['switch_mismatch']}")
        for rule, count in tally["by_rule"].items():
            print(f"  {rule:<36} {count}")
        for line in tally.get("examples", [])[:10]:
            print(f"  {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
