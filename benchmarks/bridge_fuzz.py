"""The validator against Megatron-Bridge 0.6.2's own config code: random configurations, disagreements by rule.

Runs `mbridge_epoverlap.config.bridge_fuzz` in the Python 3.12 environment that has Megatron-Bridge
(`scripts/setup_bridge_venv.sh`; `--python` or `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON` names its interpreter) and
prints its counts: configurations tried, accepted, rejected by Bridge, missed and false rejections, and
the validator's errors by rule on the rejected ones.

    python benchmarks/bridge_fuzz.py --python .bridge-venv/bin/python            # 2000 configurations
    python benchmarks/bridge_fuzz.py --python .bridge-venv/bin/python --quick --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON"),
                        help="the Python 3.12 interpreter with Megatron-Bridge installed")
    parser.add_argument("--samples", type=int, default=None, help="configurations (default 2000, --quick 300)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--quick", action="store_true", help="300 configurations")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON only")
    args = parser.parse_args()
    if not args.python:
        parser.error("give --python (or set MBRIDGE_EPOVERLAP_BRIDGE_PYTHON); scripts/setup_bridge_venv.sh builds it")
    samples = args.samples or (300 if args.quick else 2000)
    proc = subprocess.run([args.python, "-m", "mbridge_epoverlap.config.bridge_fuzz", "--samples", str(samples),
                           "--seed", str(args.seed), "--examples"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if not proc.stdout.strip():
        sys.stderr.write(proc.stderr[-4000:])
        return 1
    tally = json.loads(proc.stdout)
    if args.json:
        print(json.dumps(tally))
    else:
        print(f"{tally['tried']} configurations: {tally['accepted']} accepted, {tally['rejected_by_bridge']} rejected "
              f"by Megatron-Bridge ({tally['other_rejected']} for reasons not modelled); missed {tally['missed']}, "
              f"false rejections {tally['false']} (on the built object {tally['false_on_object']})")
        for rule, count in tally["by_rule"].items():
            print(f"  {rule:<36} {count}")
        for line in tally.get("examples", [])[:10]:
            print(f"  {line}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
