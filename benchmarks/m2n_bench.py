"""M2N backends against the gloo `batch_isend_irecv` baseline, side by side in one run.

2 senders x 2 receivers, 256 KB messages by default. The backends run interleaved (gloo, shm, mooncake,
torch, gloo, shm, ...) for `--rounds` rounds, so load that comes and goes on a shared machine hits them
alike; each backend's figure is the median over rounds of its per-round median and P99. Targets: shm median
<= 0.5x gloo and P99 <= 0.3x gloo; mooncake's P99 below gloo's.

    python benchmarks/m2n_bench.py                      # 3 rounds of 300 iterations
    python benchmarks/m2n_bench.py --rounds 5 --iters 500 --size 256K --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.comm.m2n import mooncake_available  # noqa: E402
from mbridge_epoverlap.comm.m2n.bench import describe_machine, parse_size, run_bench  # noqa: E402
from mbridge_epoverlap.machine import machine  # noqa: E402

TARGETS = {"shm": (0.5, 0.3)}  # (median ratio, P99 ratio) at most, against gloo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--size", default="256K")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="gloo,shm,mooncake,torch", help="gloo first: the baseline")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 100 iterations")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.iters = 2, 100
    size = parse_size(args.size)
    backends = [b for b in args.backends.split(",") if b != "mooncake" or mooncake_available()]
    if "gloo" not in backends:
        backends.insert(0, "gloo")
    rows: dict[str, dict[str, list[float]]] = {b: {"median_us": [], "p99_us": []} for b in backends}
    for round_ in range(args.rounds):
        for backend in backends:
            doc = run_bench(backend, senders=args.senders, receivers=args.receivers, sizes=[size], iters=args.iters)
            res = doc["results"][0]
            rows[backend]["median_us"].append(res["median_us"])
            rows[backend]["p99_us"].append(res["p99_us"])
            print(f"round {round_ + 1}/{args.rounds} {backend:>9}: median {res['median_us']:9.1f} us, "
                  f"P99 {res['p99_us']:9.1f} us", file=sys.stderr, flush=True)
    summary = {b: {k: statistics.median(v) for k, v in r.items()} for b, r in rows.items()}
    base = summary["gloo"]
    out = {"senders": args.senders, "receivers": args.receivers, "size_bytes": size, "iters": args.iters,
           "rounds": args.rounds, "machine": machine(), "backends": {}}
    for b, s in summary.items():
        ratio_median, ratio_p99 = s["median_us"] / base["median_us"], s["p99_us"] / base["p99_us"]
        entry = {**s, "median_vs_gloo": round(ratio_median, 3), "p99_vs_gloo": round(ratio_p99, 3),
                 "per_round": rows[b]}
        if b in TARGETS:
            entry["meets_target"] = ratio_median <= TARGETS[b][0] and ratio_p99 <= TARGETS[b][1]
        if b == "mooncake":
            entry["meets_target"] = s["p99_us"] < base["p99_us"]
        out["backends"][b] = entry
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"M2N {args.senders} senders x {args.receivers} receivers, {size:,} bytes, {args.rounds} interleaved rounds "
          f"of {args.iters} iterations")
    print(f"machine: {describe_machine(out['machine'])}")
    print(f"{'backend':>9} {'median (us)':>12} {'P99 (us)':>10} {'median/gloo':>12} {'P99/gloo':>9} {'target':>8}")
    for b, e in out["backends"].items():
        target = {True: "met", False: "missed"}.get(e.get("meets_target"), "")
        print(f"{b:>9} {e['median_us']:>12,.1f} {e['p99_us']:>10,.1f} {e['median_vs_gloo']:>12.3f} "
              f"{e['p99_vs_gloo']:>9.3f} {target:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
