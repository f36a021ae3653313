"""EP overlap on the reference runtime: plain 1F1B vs combined 1F1B (vs + delayed wgrad, vs + the down-projection
expert wgrad moved into the next combine-backward window), side by side.

Runs the CPU-shrunk recipe (default qwen3_30b_a3b, EP = processes = 2) for each case, interleaved
A B C A B C ... `--repeats` times, on loopback gloo or behind an emulated link (`--emulate-link-gbps`,
root only). Reports, per case, the median over repeats of the stable-window mean step time
(iterations `--window` A..B, 1-based, inclusive), the speedup against overlap off (ratio of medians and
median of the per-repeat ratios), whether every run's losses are bitwise identical per iteration and
finite, and from one extra profiled run per case the share of communication time the profile shows
overlapped with compute (union of `gloo:` intervals against union of compute intervals, via
`mbridge_epoverlap.profiling.analyze_trace`). Also prints where the time goes per stage on rank 0, and
an estimate of the best speedup overlap can reach on this machine: the baseline's time spent waiting on
communication comes off, but the all-to-alls' own CPU work (the CPU time of gloo's threads and the
communication thread, which the runtime measures per iteration) stays on the critical path when every
core computes. `gloo_alltoall_cost.py` shows that cost for a single all-to-all.

    python benchmarks/runtime_overlap_bench.py                          # loopback, ~2-3 minutes
    python benchmarks/runtime_overlap_bench.py --emulate-link-gbps 1    # 1 Gbit/s link (root)
    python benchmarks/runtime_overlap_bench.py --shape hidden_size=128  # try another CpuShape
    python benchmarks/runtime_overlap_bench.py --quick                  # short profile (run_all.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.config.container import RunConfig  # noqa: E402
from mbridge_epoverlap.config.shrink import CpuShape  # noqa: E402
from mbridge_epoverlap.harness.stats import overlap_ceiling  # noqa: E402
from mbridge_epoverlap.machine import cpu_model  # noqa: E402
from mbridge_epoverlap.profiling import analyze_trace  # noqa: E402
from mbridge_epoverlap.recipes.cpu_case import cpu_overlap_case  # noqa: E402
from mbridge_epoverlap.runtime import RunMetrics, run_local  # noqa: E402
from mbridge_epoverlap.schedule.predict import predict  # noqa: E402

# case: (overlap, delayed wgrad, runtime options in the ranks' environment)
CASES: dict[str, tuple[bool, bool, dict[str, str]]] = {
    "ep_overlap_off": (False, False, {}),
    "ep_overlap_on": (True, False, {}),
    "ep_overlap_on_delay_wgrad": (True, True, {}),
    # The down-projection expert wgrad in the next combine-backward window (`one_f_one_b(split_expert_wgrad)`).
    "ep_overlap_on_delay_wgrad_split": (True, True, {"MBRIDGE_EPOVERLAP_SPLIT_EXPERT_WGRAD": "1"}),
}
STAGES = ("attn", "experts", "post", "post_bwd", "experts_dgrad", "experts_wgrad", "experts_wgrad_down", "attn_dgrad",
          "attn_wgrad")


def make_config(recipe: str, procs: int, ep: int | None, overlap: bool, delay: bool, env: dict[str, str],
                shape: CpuShape) -> RunConfig:
    cfg = cpu_overlap_case(recipe, procs, overlap=overlap, delay_wgrad=delay, shape=shape, ep=ep)
    cfg.env_vars.update(env)
    return cfg


def parse_shape(items: list[str]) -> CpuShape:
    fields = {f.name: f.type for f in dataclasses.fields(CpuShape)}
    values = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--shape {item}: unknown CpuShape field; fields: {', '.join(fields)}")
        values[key] = None if value.lower() == "none" else int(value)
    return CpuShape(**values)


def machine() -> dict[str, str]:
    model = cpu_model()
    import torch

    from mbridge_epoverlap.machine import cpu_flags, reported_flags

    return {"nproc": str(os.cpu_count()), "cpu": model, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "cpu_flags": " ".join(reported_flags(cpu_flags())) or "none of avx2/avx512f/avx512_bf16/amx_bf16"}


def window_mean(metrics: RunMetrics, first: int, last: int) -> float:
    times = metrics.step_times_s[first - 1:last]
    return statistics.fmean(times)


def hidden_share(trace_dir: Path) -> dict[str, float | None]:
    """Overlap of communication with compute in the traces, summed over ranks."""
    totals = analyze_trace(str(trace_dir)).totals()
    return {"comm_ms": totals["comm_ns"] / 1e6, "overlap_ms": totals["overlap_ns"] / 1e6,
            "exposed_ms": totals["exposed_comm_ns"] / 1e6,
            "hidden_pct": totals["overlap_pct"]}


def stage_times(trace: Path) -> dict[str, float]:
    """Mean duration (ms) per stage range on one rank's trace."""
    sums: dict[str, list[float]] = defaultdict(list)
    for e in json.loads(trace.read_text())["traceEvents"]:
        if e.get("ph") != "X":
            continue
        name = e["name"]
        if name in STAGES or name.endswith((".issue", ".wait")) or name == "gloo:all_to_all":
            sums[name].append(e["dur"] / 1e3)
    return {k: statistics.fmean(v) for k, v in sorted(sums.items())}


def series_median(runs: list[RunMetrics], attribute: str, first: int, last: int) -> float | None:
    """Median over repeats of the window mean of a per-iteration series of `RunMetrics`."""
    means = [statistics.fmean(getattr(r, attribute)[first - 1:last]) for r in runs if getattr(r, attribute)]
    return statistics.median(means) if means else None


def stage_costs(runs: list[RunMetrics], first: int, last: int) -> dict[str, float]:
    """Per range name, the median over repeats of the window mean of one occurrence's duration."""
    names = sorted({n for r in runs for n in (r.stage_s or {})})
    return {n: statistics.median(statistics.fmean(r.stage_s[n][first - 1:last]) for r in runs
                                 if r.stage_s and n in r.stage_s) for n in names}


def print_predictions(runs: dict[str, list[RunMetrics]], first: int, last: int) -> dict[str, dict]:
    """The simulator fed each case's measured stage costs, against the measured schedule time."""
    print("\nsimulator with each case's measured stage costs (schedule only; step = schedule + reduction/optimizer):")
    print("| case | measured schedule | predicted | error | comm hidden: measured, all ranks (worst rank) / simulated "
          "/ upper bound | simulated hidden if issuing were free "
          "| worst-modelled stall (measured / predicted per iteration) |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for case, rs in runs.items():
        if not all(r.stage_s and r.schedule and r.schedule_s for r in rs):
            continue
        measured = statistics.median(statistics.fmean(r.schedule_s[first - 1:last]) for r in rs)
        costs = stage_costs(rs, first, last)
        shares = [s for s in (r.hidden_share(first, last) for r in rs) if s is not None]
        measured_hidden = statistics.median(s[0] for s in shares) if shares else None
        worst_rank = statistics.median(s[1] for s in shares) if shares else None
        p = predict(rs[0].schedule, costs, measured_hidden=measured_hidden)
        # Handing a collective to the communication thread holds the training thread on a loaded CPU; what
        # the order itself hides shows with that cost taken out.
        free = predict(rs[0].schedule, {k: 0.0 if k.endswith(".issue") else v for k, v in costs.items()})
        gap = p.largest_gap()
        hidden = "n/a" if p.measured_hidden_fraction is None else f"{p.measured_hidden_fraction:.1%}"
        hidden += "" if worst_rank is None else f" ({worst_rank:.1%})"
        worst = "n/a" if gap is None else f"{gap[0]} ({gap[1] * 1e3:.1f} / {gap[2] * 1e3:.1f} ms)"
        print(f"| {case} | {measured * 1e3:.1f} ms | {p.schedule_s * 1e3:.1f} ms | "
              f"{p.schedule_s / measured - 1:+.1%} | {hidden} / {p.hidden_fraction:.1%} / "
              f"{p.hidden_upper_bound:.1%} | {free.hidden_fraction:.1%} | {worst} |")
        out[case] = {"measured_schedule_s": measured, **p.to_dict(),
                     "hidden_fraction_free_issue": free.hidden_fraction, "stage_costs_s": costs,
                     "measured_hidden_worst_rank": worst_rank,
                     "schedule": rs[0].schedule}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="qwen3_30b_a3b")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--ep", type=int, default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--window", type=int, nargs=2, default=(3, 8), metavar=("FIRST", "LAST"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--emulate-link-gbps", type=float, default=None)
    parser.add_argument("--profile-steps", type=int, default=4, help="iterations of the profiled run (0: none)")
    parser.add_argument("--shape", nargs="*", default=[], metavar="FIELD=VALUE", help="CpuShape overrides")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true",
                        help="overlap off and on, 5 iterations (window 3-5), one repeat, no profiled run")
    args = parser.parse_args()
    if args.quick:
        args.iters, args.window, args.repeats, args.profile_steps = 5, (3, 5), 1, 0
        args.cases = [case for case in args.cases if not case.startswith("ep_overlap_on_delay_wgrad")] or args.cases
    first, last = args.window
    if not 1 <= first <= last <= args.iters:
        raise SystemExit(f"--window {first} {last} must lie within 1..{args.iters}")
    shape = parse_shape(args.shape)
    configs = {case: make_config(args.recipe, args.procs, args.ep, *CASES[case], shape) for case in args.cases}
    info = machine()
    link = f"emulated {args.emulate_link_gbps:g} Gbit/s (netns + tbf)" if args.emulate_link_gbps else "loopback"
    m = configs[args.cases[0]].model
    print(f"machine: {info['nproc']} CPUs, {info['cpu']}, flags {info['cpu_flags']}, Python {info['python']}, "
          f"torch {info['torch']}")
    print(f"run: {args.recipe} CPU-shrunk, {args.procs} processes, EP {m.expert_model_parallel_size}, link {link}, "
          f"{args.iters} iterations, window {first}-{last}, {args.repeats} repeats interleaved")
    print(f"shape: {dataclasses.asdict(shape)}; model: layers {m.num_layers}, hidden {m.hidden_size}, "
          f"experts {m.num_moe_experts} top-{m.moe_router_topk}, expert ffn {m.moe_ffn_hidden_size}, "
          f"seq {m.seq_length}, bf16 {m.bf16}")
    runs: dict[str, list[RunMetrics]] = {case: [] for case in args.cases}
    start = time.monotonic()
    for repeat in range(args.repeats):
        for case in args.cases:
            metrics = run_local(configs[case], max_steps=args.iters, emulate_link_gbps=args.emulate_link_gbps,
                                timeout_s=args.timeout)
            runs[case].append(metrics)
            print(f"  repeat {repeat + 1} {case:28s} window mean {window_mean(metrics, first, last) * 1e3:8.1f} ms",
                  flush=True)
    profiles: dict[str, dict] = {}
    stages: dict[str, dict[str, float]] = {}
    if args.profile_steps > 0:
        with tempfile.TemporaryDirectory(prefix="mbe-bench-") as tmp:
            for case in args.cases:
                trace_dir = Path(tmp) / case
                run_local(configs[case], max_steps=args.profile_steps, profile_dir=trace_dir,
                          emulate_link_gbps=args.emulate_link_gbps, timeout_s=args.timeout)
                profiles[case] = hidden_share(trace_dir)
                stages[case] = stage_times(trace_dir / "rank0.json")
    elapsed = time.monotonic() - start

    base = args.cases[0]
    medians = {case: statistics.median(window_mean(r, first, last) for r in rs) for case, rs in runs.items()}
    reference_losses = runs[base][0].losses
    all_equal = all(r.losses == reference_losses for rs in runs.values() for r in rs)
    finite = all(math.isfinite(x) for rs in runs.values() for r in rs for x in r.losses)
    print()
    print("| case | stable-window mean | speedup (ratio of medians) | speedup (median of paired ratios) "
          "| comm hidden (profile) | peak mem |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for case in args.cases:
        paired = statistics.median(window_mean(a, first, last) / window_mean(b, first, last)
                                   for a, b in zip(runs[base], runs[case], strict=True))
        hidden = profiles.get(case, {}).get("hidden_pct")
        peak = max(r.peak_mem_bytes for r in runs[case]) / 2**20
        print(f"| {case} | {medians[case] * 1e3:.1f} ms | {medians[base] / medians[case]:.3f}x | {paired:.3f}x | "
              f"{'n/a' if hidden is None else f'{hidden:.1f} %'} | {peak:.0f} MiB |")
        summary[case] = {"window_mean_s": medians[case], "speedup": medians[base] / medians[case],
                         "paired_speedup": paired, "profile": profiles.get(case),
                         "step_times_s": [r.step_times_s for r in runs[case]], "peak_mem_mib": peak}
    print()
    print(f"losses bitwise identical across all {sum(len(r) for r in runs.values())} runs: {all_equal}; "
          f"finite: {finite}; skipped/NaN iterations: "
          f"{sum(r.skipped_iters for rs in runs.values() for r in rs)}/"
          f"{sum(r.nan_iters for rs in runs.values() for r in rs)}")
    print(f"loss per iteration: {' '.join(f'{x:.4f}' for x in reference_losses)}")
    if stages:
        names = sorted({n for s in stages.values() for n in s})
        print("\nrank-0 mean time per range (ms), from the profiled runs:")
        print("| range | " + " | ".join(args.cases) + " |")
        print("|---|" + "---|" * len(args.cases))
        for n in names:
            print(f"| {n} | " + " | ".join(f"{stages[c].get(n, float('nan')):.2f}" for c in args.cases) + " |")
        for case, p in profiles.items():
            if p.get("comm_ms") is not None:
                print(f"{case}: comm {p['comm_ms']:.1f} ms, overlapped {p['overlap_ms']:.1f} ms, "
                      f"exposed {p['exposed_ms']:.1f} ms (all ranks, profiled iterations)")
    waits = {case: series_median(rs, "comm_step_s", first, last) for case, rs in runs.items()}
    cpus = {case: series_median(rs, "comm_cpu_s", first, last) for case, rs in runs.items()}
    ceiling = None
    if all(v is not None for v in (*waits.values(), *cpus.values())):
        print("\ncommunication per iteration (training thread waiting in issue/wait steps; CPU of the other threads):")
        for case in args.cases:
            print(f"  {case:28s} exposed {waits[case] * 1e3:6.1f} ms   comm-thread CPU {cpus[case] * 1e3:6.1f} ms")
        ceiling = overlap_ceiling(medians[base], waits[base], cpus[base])
        print(f"overlap ceiling on this machine (estimate): {medians[base] * 1e3:.0f} / ({medians[base] * 1e3:.0f} - "
              f"{waits[base] * 1e3:.0f} + {cpus[base] * 1e3:.0f}) = {ceiling:.3f}x: hiding every wait of {base} "
              "takes the waits off, but the CPU work of moving the bytes stays on cores that all compute")
        for case in args.cases:
            summary[case].update(comm_wait_s=waits[case], comm_cpu_s=cpus[case])
    predictions = print_predictions(runs, first, last)
    for case, prediction in predictions.items():
        summary[case]["prediction"] = prediction
    print(f"\nbenchmark wall time {elapsed:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "link": link, "shape": dataclasses.asdict(shape),
                                         "cases": summary, "losses_equal": all_equal, "finite": finite,
                                         "ceiling": ceiling}, indent=1))
    return 0 if all_equal and finite else 1


if __name__ == "__main__":
    sys.exit(main())
