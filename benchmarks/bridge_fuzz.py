"""The validator against Megatron-Bridge's own config code, per release: random configurations, disagreements by rule.

Runs `mbridge_epoverlap.config.bridge_fuzz` in each Python 3.12 environment that has a Megatron-Bridge release
the validator knows: 0.6.2 (`scripts/setup_bridge_venv.sh`; `--python` or `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`) and
main (`scripts/setup_bridge_main_venv.sh`; `--main-python` or `MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON`), and prints
each one's counts: configurations tried, accepted, rejected by Bridge, missed and false rejections, EP switches
that differ, and the validator's errors by rule on the rejected ones. Then the same comparison on each family's own
recipes (`mbridge_epoverlap.harness.bridge_family_fuzz`: GPT-OSS, Kimi K2, DeepSeek, Qwen, Nemotron 3, Qwen VL,
GLM-5), per family (`--family-samples` cases each, 0 skips it).

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


def run_families(python: str, samples: int, seed: int) -> tuple[int, dict[str, Any] | None, str]:
    """(exit status, per-family tallies, stderr) of one environment's fuzz on the families' own recipes."""
    proc = subprocess.run([python, "-m", "mbridge_epoverlap.harness.bridge_family_fuzz", "--samples", str(samples),
                           "--seed", str(seed)], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    if not proc.stdout.strip():
        return 1, None, proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])["families"], ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON"),
                        help="the Python 3.12 interpreter with Megatron-Bridge 0.6.2 installed")
    parser.add_argument("--main-python", default=os.environ.get("MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON"),
                        help="the Python 3.12 interpreter with Megatron-Bridge main (optional)")
    parser.add_argument("--samples", type=int, default=None, help="configurations (default 2000, --quick 300)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--quick", action="store_true", help="300 configurations")
    parser.add_argument("--family-samples", type=int, default=None,
                        help="cases per family on the families' own recipes (default 200, --quick 40; 0: none)")
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
    family_samples = args.family_samples if args.family_samples is not None else (40 if args.quick else 200)
    families: dict[str, Any] = {}
    for name, python in pythons.items() if family_samples else ():
        code, tallies, errors = run_families(python, family_samples, args.seed)
        if tallies is None:
            sys.stderr.write(f"{name} (families): {errors}")
            return 1
        status = status or code
        families[name] = tallies
    if args.json:
        print(json.dumps({"releases": releases, "families": families}))
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
    for name, tallies in families.items():
        print(f"Megatron-Bridge {name}, each family's own recipes:")
        for family, t in tallies.items():
            print(f"  {family:<12} {t['tried']} cases on {len(t['recipes'])} recipes: {t['accepted']} accepted, "
                  f"{t['rejected_by_bridge']} rejected ({t['other_rejected']} not modelled); missed {t['missed']}, "
                  f"false {t['false']}, EP switches differing {t['switch_mismatch']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
