"""Elastic EP: interruption when an expert worker is SIGKILLed mid-decode, and the cost of elastic mode.

Runs `mbridge-epoverlap elastic-bench` several times (each run: plain/elastic no-failure pairs, then one
run that kills `--kill` expert workers) and reports medians over the runs:

* interruption: from the kill to the next token of every request in flight (target <= 1 s here);
  SGLang reports 6.2-6.8 s on 32 GPUs with real weights (a real model's weights, NCCL/DeepEP
  re-initialisation, CUDA graphs) where here the workers are CPU processes on one host with a shrunk
  model, so the figures differ in scale by far more than the method;
* detection: from the kill to the first attention worker noticing it;
* throughput after / before the failure, beside the survivors' share of expert workers;
* no-failure cost: elastic over plain decode tokens/s, alternated A B B A ..., medians (target >= 0.97);
* with `--rejoin-after-steps N`: a replacement process joins back N steps after the loss: when (from the
  kill), how long decoding waited for it, and tokens/s after it joined;
* with `--rebalance-every K`: the placement is re-solved for the measured load every K steps: rebalances
  that moved experts, max/mean load before and after, and a third no-failure arm (elastic with
  rebalancing over elastic without, alternated with the other two): `rebalance_cost_ratio` (target >= 0.97),
  rebalances done / skipped (within `--rebalance-threshold`) / kept, copies moved against a solve from
  scratch; the machine's load average beside it.

    python benchmarks/elastic_bench.py            # ~5 minutes on 2 cores
    python benchmarks/elastic_bench.py --quick    # ~1 minute (benchmarks/run_all.py)
    python benchmarks/elastic_bench.py --json
    python benchmarks/elastic_bench.py --rejoin-after-steps 16 --rebalance-every 8
    python benchmarks/elastic_bench.py --rebalance-every 8 --rebalance-threshold 1.0   # every rebalance that helps

`--failure-table` measures the table shaped like SGLang's Elastic EP one instead: 1, 2 and 3 of
`--expert-workers` (default 8 here) killed at once and 3 killed one every `--kill-every` steps, the
configurations alternated run after run (A B C D, then D C B A, ...), medians over `--runs` per row:
interruption and its phases (detection, switch, recovery), survivors' tokens/s over before, lost requests,
outputs equal, and the interruption over a full restart of the same serve (start-up to first token, median
of the no-failure runs). The load average is printed beside it (a loaded machine stretches every figure):

    python benchmarks/elastic_bench.py --failure-table --backend mooncake --emulate-hosts 2 --emulate-link-gbps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.serving.cli.elastic import fmt3  # noqa: E402


def _run(args: argparse.Namespace, steps: int, repeats: int, kill: int | None = None, kill_every: int = 0) -> dict:
    command = [sys.executable, "-m", "mbridge_epoverlap.cli", "elastic-bench", "--json",
               "--expert-workers", str(args.expert_workers), "--redundant-experts", str(args.redundant_experts),
               "--kill", str(args.kill if kill is None else kill), "--steps", str(steps), "--repeats", str(repeats),
               "--rebalance-every", str(args.rebalance_every), "--rejoin-after-steps", str(args.rejoin_after_steps),
               "--backend", args.backend, "--rebalance-threshold", str(args.rebalance_threshold)]
    if kill_every:
        command += ["--kill-every", str(kill_every)]
    if args.emulate_hosts:
        command += ["--emulate-hosts", str(args.emulate_hosts), "--emulate-link-gbps", str(args.emulate_link_gbps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"elastic-bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one run, short generations")
    parser.add_argument("--json", action="store_true", help="JSON on stdout")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--expert-workers", type=int, default=4)
    parser.add_argument("--redundant-experts", type=int, default=4)
    parser.add_argument("--kill", type=int, default=1)
    parser.add_argument("--rebalance-every", type=int, default=0, metavar="K")
    parser.add_argument("--rejoin-after-steps", type=int, default=0, metavar="N")
    parser.add_argument("--rebalance-threshold", type=float, default=1.1, metavar="T")
    parser.add_argument("--backend", default="m2n")
    parser.add_argument("--emulate-hosts", type=int, default=0, metavar="H")
    parser.add_argument("--emulate-link-gbps", type=float, default=10.0, metavar="G")
    parser.add_argument("--failure-table", action="store_true", help="the SGLang-shaped failure table (see above)")
    parser.add_argument("--kill-every", type=int, default=4, metavar="S", help="with --failure-table (default 4)")
    args = parser.parse_args()
    if args.failure_table:
        return failure_table(args)
    runs, steps, repeats = (1, 16, 1) if args.quick else (args.runs, 32, 2)
    results = []
    for i in range(runs):
        print(f"run {i + 1}/{runs}", file=sys.stderr, flush=True)
        results.append(_run(args, steps, repeats))

    def median(key: str) -> float | None:
        values = [r[key] for r in results if r[key] is not None]
        return statistics.median(values) if values else None

    plain = [v for r in results for v in r["no_failure"]["plain_tokens_per_s"]]
    elastic = [v for r in results for v in r["no_failure"]["elastic_tokens_per_s"]]
    reb = [v for r in results for v in r["no_failure"]["rebalancing_tokens_per_s"] or []]
    after, before = median("throughput_after"), median("throughput_before")
    doc = {
        "runs": runs, "interruption_s": median("interruption_s"), "interruption_s_all":
        [r["interruption_s"] for r in results], "detected_after_s": median("detected_after_s"),
        "throughput_before": before, "throughput_after": after,
        "after_over_before": after / before if after and before else None,
        "survivors_share": results[0]["survivors_share"],
        "outputs_match_reference": all(r["outputs_match_reference"] for r in results),
        "lost_requests": sorted({x for r in results for x in r["lost_requests"]}),
        "elastic_over_plain": statistics.median(elastic) / statistics.median(plain),
        "pairs": len(plain), "layout": results[0]["layout"], "model": results[0]["model"],
        "machine": results[0]["machine"],
        "rejoined_after_s": median("rejoined_after_s"), "rejoin_wait_s": median("rejoin_wait_s"),
        "throughput_after_rejoin": median("throughput_after_rejoin"),
        "rejoined_every_run": all(r["rejoined_workers"] for r in results),
        "rebalances_moved": [[b for b in r["rebalances"] if not b["kept"]] for r in results],
        "rebalancing_over_elastic": statistics.median(reb) / statistics.median(elastic) if reb else None,
        "rebalance_cost_ratio": statistics.median(reb) / statistics.median(elastic) if reb else None,
        "rebalance_cost_ratio_runs": [r["rebalance_cost_ratio"] for r in results],
        "rebalance_cost_ratio_paired_runs": [r["rebalance_cost_ratio_paired"] for r in results],
        "rebalancing": [r["no_failure"]["rebalancing"] for r in results],
        "load_average": [r["load_average"] for r in results],
    }
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    m = doc["machine"]
    print(f"machine: {m['cpu']} ({m['cores']} cores, avx512_bf16={m['avx512_bf16']}, amx_bf16={m['amx_bf16']})")
    print(f"layout: {doc['layout']}")
    print(f"interruption (median of {runs}): {doc['interruption_s']:.3f} s  (target <= 1 s; SGLang 6.2-6.8 s on 32 "
          "GPUs with real weights)")
    print(f"detected after: {doc['detected_after_s']:.3f} s")
    print(f"tokens/s before / after: {before:.1f} / {after:.1f} = {doc['after_over_before']:.2f} "
          f"(survivors' share {doc['survivors_share']:.2f})")
    print(f"outputs match reference: {doc['outputs_match_reference']}; lost requests: {doc['lost_requests']}")
    print(f"no failure, elastic / plain decode tokens/s: {doc['elastic_over_plain']:.3f} (medians of "
          f"{doc['pairs']} A/B pairs; target >= 0.97)")
    if args.rejoin_after_steps:
        print(f"rejoined in every run: {doc['rejoined_every_run']}; after {fmt3(doc['rejoined_after_s'])} s from the "
              f"kill (decoding waited {fmt3(doc['rejoin_wait_s'])} s for the replacement); tokens/s after rejoin "
              f"{fmt3(doc['throughput_after_rejoin'], '{:.1f}')}")
    if args.rebalance_every:
        print(f"no failure, rebalancing every {args.rebalance_every} steps / elastic decode tokens/s "
              f"(rebalance_cost_ratio): {fmt3(doc['rebalance_cost_ratio'])} (medians of {len(reb)} runs, alternated; "
              "target >= 0.97; per invocation " + ", ".join(fmt3(x) for x in doc["rebalance_cost_ratio_runs"])
              + "; median of the rounds' ratios per invocation "
              + ", ".join(fmt3(x) for x in doc["rebalance_cost_ratio_paired_runs"]) + ")")
        for i, b in enumerate(doc["rebalancing"]):
            print(f"run {i + 1} rebalancing arm: {b['done']} done, {b['skipped']} skipped (max/mean <= "
                  f"{args.rebalance_threshold}), {b['kept']} kept; {b['moved_copies']} copies moved "
                  f"({b['moved_copies_from_scratch']} from scratch); outputs match {b['outputs_match_reference']}")
        print("load average (start, end of each run): " + "; ".join(
            f"{a['start'][0]:.2f} -> {a['end'][0]:.2f}" for a in doc["load_average"]))
        for i, moved in enumerate(doc["rebalances_moved"]):
            print(f"run {i + 1} rebalances: " + ("; ".join(
                f"step {b['step']}: {b['moved']} moved, max/mean {b['imbalance_before']:.3f} -> "
                f"{b['imbalance_after']:.3f}" for b in moved) or "none lowered the load"))
    return 0


# The rows of the failure table: (label, --kill, --kill-every).
_CONFIGS = (("1 at once", 1, 0), ("2 at once", 2, 0), ("3 at once", 3, 0), ("3, one every S steps", 3, None))


def failure_table(args: argparse.Namespace) -> int:
    """Measure and print (or dump) the SGLang-shaped failure table (module docstring)."""
    if args.expert_workers == 4 and args.redundant_experts == 4:  # the single-failure defaults: widen them
        args.expert_workers, args.redundant_experts = 8, 8
    runs, steps = (1, 24) if args.quick else (args.runs, 32)
    configs = [(label.replace(" S ", f" {args.kill_every} "), kill, args.kill_every if every is None else every)
               for label, kill, every in _CONFIGS]
    got: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    loads = [os.getloadavg()[0]]
    for i in range(runs):
        for label, kill, every in (configs if i % 2 == 0 else list(reversed(configs))):
            print(f"run {i + 1}/{runs}: {label}", file=sys.stderr, flush=True)
            got[label].append(_run(args, steps, 1, kill=kill, kill_every=every))
            loads.append(os.getloadavg()[0])

    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    restarts = [t for results in got.values() for r in results for t in r["restart_s"]]
    restart = median(restarts)
    rows = []
    for label, kill, every in configs:
        results = got[label]
        for n in range(len(results[0]["failures"]) if results and results[0]["failures"] else 0):
            cells = [r["failures"][n] for r in results if len(r["failures"]) > n]
            row = {"config": label, "kill": kill, "kill_every": every, "failed_workers": cells[0]["failed_workers"],
                   "runs": len(cells)}
            for key in ("interruption_s", "detection_s", "switch_s", "recovery_s", "weight_load_s",
                        "throughput_over_before"):
                row[key] = median([c[key] for c in cells])
            row["interruption_s_all"] = [c["interruption_s"] for c in cells]
            row["lost_requests"] = sorted({x for r in results for x in r["lost_requests"]})
            row["outputs_equal"] = all(r["outputs_match_reference"] for r in results)
            row["interruption_over_restart"] = row["interruption_s"] / restart \
                if restart and row["interruption_s"] is not None else None
            rows.append(row)
    first = next(r for results in got.values() for r in results)
    doc = {"rows": rows, "restart_s_median": restart, "restart_s_all": restarts, "runs": runs,
           "load_average": {"median": statistics.median(loads), "min": min(loads), "max": max(loads)},
           "layout": {k: first["layout"][k] for k in ("attn_workers", "expert_workers", "redundant_experts",
                                                         "requests", "tokens_per_request")},
           "backend": args.backend, "emulate_hosts": args.emulate_hosts,
           "emulate_link_gbps": args.emulate_link_gbps if args.emulate_hosts else None,
           "model": first["model"], "machine": first["machine"]}
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    m = doc["machine"]
    print(f"machine: {m['cpu']} ({m['cores']} cores); load average {doc['load_average']['median']:.1f} "
          f"(min {doc['load_average']['min']:.1f}, max {doc['load_average']['max']:.1f}); backend {args.backend}"
          + (f", {args.emulate_hosts} emulated hosts at {args.emulate_link_gbps:g} Gbit/s"
             if args.emulate_hosts else ""))
    print(f"layout: {doc['layout']}; medians of {runs} runs per row")
    print("| failed workers | config | interruption (s) | detection / switch / recovery (s) | tokens/s after / before "
          "| lost requests | outputs equal | interruption / restart |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['failed_workers']} of {doc['layout']['expert_workers']} | {r['config']} | "
              f"{fmt3(r['interruption_s'])} | {fmt3(r['detection_s'])} / {fmt3(r['switch_s'])} / "
              f"{fmt3(r['recovery_s'])} | {fmt3(r['throughput_over_before'], '{:.2f}')} | "
              f"{len(r['lost_requests'])} | {r['outputs_equal']} | {fmt3(r['interruption_over_restart'], '{:.4f}')} |")
    print(f"| none (full restart) | start-up to first token | {fmt3(restart)} | - | - | - | - | 1 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
