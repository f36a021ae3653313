"""MegaScale-Infer's ablations through the planner, each figure beside the paper's
(`serving.planning.ablations`): micro-batches m = 1..4 per model, DBRX's attention replicas 1..16, H20 attention
with L40S experts against homogeneous deployments, disaggregation against colocation. Prints one row per figure
(planner, paper, within 25 % or the reason it is not) and, with `--json`, the curves behind them. The planner is
analytic: the figures do not depend on this machine.

    python benchmarks/paper_ablations.py
    python benchmarks/paper_ablations.py --gpu H100 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.serving.planning.ablations import DEFAULT_GPU, run  # noqa: E402
from mbridge_epoverlap.serving.planning.catalog import GPUS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPUS),
                        help="the homogeneous GPU of the micro-batch, replica and colocation ablations")
    parser.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    parser.add_argument("--quick", action="store_true", help="the same run (it takes about a second)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    doc = run(args.gpu)
    doc["seconds"] = time.perf_counter() - start
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"MegaScale-Infer ablations through the planner ({args.gpu} where homogeneous; within = inside the "
          f"paper's range widened by {doc['tolerance']:.0%})")
    print(f"{'experiment':<20} {'case':<40} {'planner':>9} {'paper':>11}  within")
    for f in doc["findings"]:
        paper = (f"{f['paper_low']:g}" if f["paper_low"] == f["paper_high"]
                 else f"{f['paper_low']:g}-{f['paper_high']:g}")
        print(f"{f['experiment']:<20} {f['case']:<40} {f['planner']:>9.2f} {paper:>11}  "
              f"{'yes' if f['within'] else 'no'} {f['unit']}")
    for experiment in sorted({f["experiment"] for f in doc["findings"] if f["explanation"]}):
        cases = [f["case"] for f in doc["findings"] if f["experiment"] == experiment and f["explanation"]]
        reason = next(f["explanation"] for f in doc["findings"] if f["experiment"] == experiment and f["explanation"])
        print(f"\n{experiment} ({', '.join(cases)}): off the paper's own range because {reason}.")
    unexplained = [f["case"] for f in doc["findings"] if not f["within"] and not f["explanation"]]
    if unexplained:
        print(f"\npast the tolerance with no known reason: {', '.join(unexplained)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
