"""Disaggregated decode: ping-pong with m = 1, 2, 3 micro-batches, and disaggregated vs colocated.

1 attention worker + 1 expert worker on the CPU-shrunk recipe (default qwen3_30b_a3b). The micro-batch
size is chosen once so that an attention stage and an expert stage take about as long and both scale
with the batch (the largest expected ping-pong gain of the probes, `serving.bench`; the probe times are
printed), and every case decodes the same requests
(the same total batch: m micro-batches of B/m). Cases run interleaved A B C A B C ... `--repeats` times;
each reports the median steady decode throughput (tokens/s over the steps after the prefill step),
the simulator's prediction from that run's measured stage times, and whether every generated token
matched the single-process reference. Ratios: m=2/m=1 (target >= 1.7) and m=3/m=2 (target >= 0.95).
Then the same requests on the colocated baseline (2 processes, two-batch overlap), beside ping-pong
m=2 on the same process count.

    python benchmarks/serving_bench.py                 # ~5-10 minutes on 2 cores
    python benchmarks/serving_bench.py --repeats 1 --steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.machine import machine  # noqa: E402
from mbridge_epoverlap.serving.engine.bench import (  # noqa: E402
    balanced_micro_batch,
    describe_probe,
    matches_reference,
    synthetic_requests,
)
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine  # noqa: E402
from mbridge_epoverlap.serving.model.checkpoint import load_spec  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-mr", "--recipe", default="qwen3_30b_a3b")
    parser.add_argument("--layers", type=int, default=None, help="MoE layers of the recipe model")
    parser.add_argument("--steps", type=int, default=12, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=None, help="skip the balance probe: this per-mb size")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="one repeat, 3 tokens, micro-batch 16 (no probe)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.micro_batch = 1, 3, args.micro_batch or 16

    spec = load_spec(args.recipe, num_layers=args.layers)
    if args.micro_batch is None:
        micro, probes = balanced_micro_batch(spec, attn_workers=1, expert_workers=1)
    else:
        micro, probes = args.micro_batch, []
    # The same total batch for every m: divisible by 1, 2 and 3.
    batch = 6 * max(1, round(micro * 2 / 6))
    requests = synthetic_requests(batch, spec.vocab_size)
    m_info = machine()
    print(f"machine: {m_info['cpu']}, {m_info['cores']} cores, avx512_bf16={m_info['avx512_bf16']}, "
          f"amx_bf16={m_info['amx_bf16']} (shared machines give noisy figures)")
    print(f"model: {spec.describe()}")
    for p in probes:
        print(f"  balance probe: micro-batch {p['micro_batch']:>4}: {describe_probe(p)}")
    print(f"chosen micro-batch {micro} (largest expected gain) -> total batch {batch}, {args.steps} tokens each")

    cases = {
        "ping_pong_m1": dict(micro_batches=1),
        "ping_pong_m2": dict(micro_batches=2),
        "ping_pong_m3": dict(micro_batches=3),
        "colocated_2proc_tbo": dict(colocated=2, order="two_batch_overlap", micro_batches=2),
    }
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for repeat in range(args.repeats):
        for name, layout in cases.items():
            plan = make_plan(spec, requests, max_new_tokens=args.steps, max_batch=batch, num_layers=args.layers,
                             timeout_s=60, **layout)
            result = run_engine(plan)
            result["matches_reference"] = matches_reference(spec, requests, result["completions"], args.steps)
            result.pop("completions")
            runs[name].append(result)
            print(f"  repeat {repeat + 1}/{args.repeats} {name:<22} {result['decode_tokens_per_s']:9.1f} tokens/s "
                  f"(predicted {result['predicted']['tokens_per_s']:9.1f}), matches reference "
                  f"{result['matches_reference']}", flush=True)

    summary = {}
    print(f"\n{'case':<22} {'tokens/s':>10} {'predicted':>10} {'util attn':>9} {'util exp':>9} {'TBT p50 ms':>10} "
          f"{'reference':>9}")
    for name, results in runs.items():
        median = statistics.median(r["decode_tokens_per_s"] for r in results)
        predicted = statistics.median(r["predicted"]["tokens_per_s"] for r in results)
        util = {k: statistics.median(r["utilization"][k] for r in results) for k in ("attention", "expert")}
        tbt = statistics.median(r["tbt_ms_p50"] for r in results)
        ok = all(r["matches_reference"] for r in results)
        summary[name] = {"tokens_per_s": median, "predicted_tokens_per_s": predicted, "utilization": util,
                         "tbt_ms_p50": tbt, "matches_reference": ok,
                         "stage_ms": results[-1]["stage_ms"]}
        print(f"{name:<22} {median:10.1f} {predicted:10.1f} {util['attention']:9.0%} {util['expert']:9.0%} "
              f"{tbt:10.2f} {ok!s:>9}")

    def ratio(a: str, b: str) -> float:
        per_repeat = [x["decode_tokens_per_s"] / y["decode_tokens_per_s"] for x, y in zip(runs[a], runs[b],
                                                                                           strict=True)]
        return statistics.median(per_repeat)

    ratios = {"m2_over_m1": ratio("ping_pong_m2", "ping_pong_m1"),
              "m3_over_m2": ratio("ping_pong_m3", "ping_pong_m2"),
              "disaggregated_m2_over_colocated": ratio("ping_pong_m2", "colocated_2proc_tbo")}
    print(f"\nm=2 / m=1: {ratios['m2_over_m1']:.2f}x (target >= 1.7)   m=3 / m=2: {ratios['m3_over_m2']:.2f}x "
          f"(target >= 0.95)   disaggregated m=2 / colocated (2 processes): "
          f"{ratios['disaggregated_m2_over_colocated']:.2f}x  (medians of per-repeat ratios)")
    if args.json is not None:
        command = "python benchmarks/serving_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.json.write_text(json.dumps({"machine": m_info, "batch": batch, "micro_batch": micro, "probes": probes,
                                         "repeats": args.repeats, "steps": args.steps, "command": command,
                                         "cases": summary, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
