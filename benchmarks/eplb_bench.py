"""Expert placement on Zipf-skewed loads: max/mean GPU load and solve time.

Four placements of the same load, for several model / cluster sizes:

* none: no rebalancing (experts in id order, no replicas);
* greedy: the replicate-then-pack baseline (one extra replica for each of the heaviest experts, then
  heaviest-first into the lightest GPU);
* eplb-global: `rebalance_experts` with one group on one node;
* eplb-hier: `rebalance_experts` with expert groups packed onto nodes first.

Balance is max/mean GPU load, averaged over layers (1.00 is perfect). Solve times alternate
greedy / global / hierarchical (A B C A B C ...) and report medians, so all see the same machine
load; the load figures are exact and do not depend on the machine.

    python benchmarks/eplb_bench.py            # ~1 minute on 2 cores
    python benchmarks/eplb_bench.py --quick    # a few seconds (used by benchmarks/run_all.py)
    python benchmarks/eplb_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mbridge_epoverlap.machine import cpu_model  # noqa: E402
from mbridge_epoverlap.serving.elastic import eplb  # noqa: E402

# (logical experts, expert groups, nodes, GPUs, redundant experts)
SIZES = [
    (64, 8, 2, 8, 8),       # Mixtral/Qwen-sized EP 8
    (128, 8, 2, 16, 32),    # Qwen3-30B-A3B experts over 16 GPUs
    (256, 8, 4, 32, 32),    # DeepSeek-V3 on 4 nodes of 8
    (256, 8, 8, 64, 64),    # DeepSeek-V3 decode on 64 GPUs, 1 redundant per GPU
]
QUICK_SIZES = SIZES[:2]


def machine() -> dict[str, object]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((set(line.split(":", 1)[1].split()) for line in fh if line.startswith("flags")), set())
    except OSError:
        pass
    return {"cpu": cpu_model(platform.machine()), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "bf16_flags": sorted(flags & {"avx512_bf16", "amx_bf16"})}


def timed(solve: Callable[[], object]) -> float:
    start = time.perf_counter()
    solve()
    return time.perf_counter() - start


def measure(experts: int, groups: int, nodes: int, gpus: int, redundant: int, layers: int, repeats: int,
            exponent: float) -> dict[str, object]:
    load = eplb.zipf_load(layers, experts, exponent=exponent, seed=experts + gpus)
    replicas = experts + redundant
    solvers: dict[str, Callable[[], torch.Tensor]] = {
        "greedy": lambda: eplb.greedy_placement(load, replicas, gpus),
        "eplb-global": lambda: eplb.rebalance_experts(load, replicas, 1, 1, gpus).phy2log,
        "eplb-hier": lambda: eplb.rebalance_experts(load, replicas, groups, nodes, gpus).phy2log,
    }
    balance = {"none": float(eplb.imbalance(load, eplb.contiguous_placement(layers, experts), gpus).mean())}
    balance.update({name: float(eplb.imbalance(load, solve(), gpus).mean()) for name, solve in solvers.items()})
    times: dict[str, list[float]] = {name: [] for name in solvers}
    for _ in range(repeats):
        for name, solve in solvers.items():
            times[name].append(timed(solve))
    return {
        "experts": experts, "groups": groups, "nodes": nodes, "gpus": gpus, "redundant": redundant,
        "layers": layers, "balance": balance,
        "solve_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, 4 layers, 3 repeats (seconds)")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers per load (default 58, quick 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per solver (default 5, quick 3)")
    parser.add_argument("--exponent", type=float, default=1.2, help="Zipf exponent of the load (default 1.2)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    layers = args.layers or (4 if args.quick else 58)
    repeats = args.repeats or (3 if args.quick else 5)
    rows = [measure(*size, layers=layers, repeats=repeats, exponent=args.exponent)
            for size in (QUICK_SIZES if args.quick else SIZES)]
    result = {"machine": machine(), "zipf_exponent": args.exponent, "rows": rows}
    # The property the placement promises, checked on every row.
    result["ok"] = all(r["balance"]["eplb-global"] <= r["balance"]["greedy"] + 1e-9
                       and r["balance"]["eplb-global"] < r["balance"]["none"] for r in rows)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    m = result["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, "
          f"bf16 flags: {', '.join(m['bf16_flags']) or 'none'}")
    print(f"load: Zipf exponent {args.exponent}, {layers} layers, a different hot expert per layer; "
          f"solve time median of {repeats}")
    print()
    print("| experts | groups/nodes/GPUs | redundant | max/mean: none | greedy | EPLB global | EPLB hier. "
          "| solve ms: greedy | global | hier. |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, t = r["balance"], r["solve_ms"]
        print(f"| {r['experts']} | {r['groups']}/{r['nodes']}/{r['gpus']} | {r['redundant']} | {b['none']:.2f} "
              f"| {b['greedy']:.2f} | {b['eplb-global']:.2f} | {b['eplb-hier']:.2f} | {t['greedy']:.1f} "
              f"| {t['eplb-global']:.1f} | {t['eplb-hier']:.1f} |")
    print()
    print("EPLB global <= greedy < none on every row" if result["ok"] else "CHECK FAILED: EPLB worse than greedy")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
