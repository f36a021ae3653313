"""Benchmark of the deployment planner against its time budgets.

Budgets (from the project's issue): one plan in under 3 s including interpreter start-up, and every
GPU pair (plus the colocated baseline) for every catalog model in under 10 s. Runs, alternating
A B A B so both see the same machine load:

* A: `mbridge-epoverlap plan --model Mixtral-8x22B --attn-gpu H20 --expert-gpu L40S --json` as a
  subprocess (start-up, imports, one plan, JSON out);
* B: one subprocess that imports the planner and runs `compare` for every model over every GPU
  (8 x 8 pairs + 8 colocated = 72 plans per model), start-up included.

As context it also times the bare interpreter start-up with `import mbridge_epoverlap`, and reports
medians, the per-plan cost inside B, and the machine.

    python benchmarks/planner_bench.py            # ~1 minute on 2 cores
    python benchmarks/planner_bench.py --json     # machine-readable summary
    python benchmarks/planner_bench.py --quick    # two rounds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.machine import cpu_model  # noqa: E402

ONE_PLAN_BUDGET_S = 3.0
ALL_PAIRS_BUDGET_S = 10.0

ONE_PLAN = [
    sys.executable, "-m", "mbridge_epoverlap.cli", "plan", "--model", "Mixtral-8x22B",
    "--attn-gpu", "H20", "--expert-gpu", "L40S", "--tbt-slo-ms", "150", "--json",
]  # fmt: skip
ALL_PAIRS = [
    sys.executable,
    "-c",
    "import json, time\n"
    "t = time.perf_counter()\n"
    "from mbridge_epoverlap.serving.planning.catalog import MODELS\n"
    "from mbridge_epoverlap.serving.planning.search import compare\n"
    "rows = [r for m in MODELS for r in compare(m)]\n"
    "print(json.dumps({'plans': len(rows), 'failed': sum('error' in r for r in rows),"
    " 'in_process_s': time.perf_counter() - t}))",
]
BARE_START = [sys.executable, "-c", "import mbridge_epoverlap"]


def timed(cmd: list[str]) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd[:6])}...\n{proc.stderr}")
    return elapsed, proc.stdout


def machine() -> dict[str, object]:
    cpu = cpu_model(platform.processor() or platform.machine())
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="A B rounds (default 5)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--quick", action="store_true", help="two rounds (benchmarks/run_all.py)")
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 2)

    timed(ONE_PLAN)  # warm the file cache and bytecode once; not counted
    one, everything, bare, in_process = [], [], [], []
    details: dict[str, object] = {}
    for _ in range(args.repeats):
        one.append(timed(ONE_PLAN)[0])
        elapsed, out = timed(ALL_PAIRS)
        everything.append(elapsed)
        details = json.loads(out)
        in_process.append(float(details["in_process_s"]))
        bare.append(timed(BARE_START)[0])

    summary = {
        "machine": machine(),
        "repeats": args.repeats,
        "one_plan_s": {"median": statistics.median(one), "max": max(one), "budget": ONE_PLAN_BUDGET_S},
        "all_pairs_all_models_s": {
            "median": statistics.median(everything),
            "max": max(everything),
            "budget": ALL_PAIRS_BUDGET_S,
            "plans": details["plans"],
            "infeasible": details["failed"],
            "in_process_median": statistics.median(in_process),
            "per_plan_ms": 1e3 * statistics.median(in_process) / int(details["plans"]),
        },
        "bare_start_s": statistics.median(bare),
    }
    ok = summary["one_plan_s"]["median"] < ONE_PLAN_BUDGET_S and summary["all_pairs_all_models_s"]["median"] < (
        ALL_PAIRS_BUDGET_S
    )
    summary["within_budget"] = ok
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        m = summary["machine"]
        a, b = summary["one_plan_s"], summary["all_pairs_all_models_s"]
        print(f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}")
        print(
            f"one plan incl. start-up:      median {a['median']:.2f} s (max {a['max']:.2f}) budget {a['budget']:.0f} s"
        )
        print(
            f"all pairs, all models:        median {b['median']:.2f} s (max {b['max']:.2f}) "
            f"budget {b['budget']:.0f} s; {b['plans']} plans ({b['infeasible']} infeasible), "
            f"{b['per_plan_ms']:.1f} ms per plan in process"
        )
        print(f"bare start-up (import only):  median {summary['bare_start_s']:.2f} s")
        print("within budget" if ok else "OVER BUDGET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
