"""`mbridge-epoverlap elastic-bench`: serve through the loss of expert workers and measure what it cost.

One run kills `--kill` expert workers mid-decode (SIGKILL, fault injection) and reports the interruption
(from the kill to the next token of every request in flight), when the loss was detected, throughput before
and after (with the survivors' share of expert workers), lost requests, and whether every token equals a
failure-free run of the same weights. With `--kill-every S` the K workers die one after another, one every S
decode steps. Each failure is a row of a table shaped like SGLang's Elastic EP one (failed workers,
interruption split into detection, switch and recovery, survivors' tokens/s over the rate before, lost
requests, outputs equal), beside the baseline it must beat: a full restart of the same serve, measured from
the workers' start to the first token in the no-failure runs.

With `--rejoin-after-steps N` a replacement process joins back N steps after the loss (when it joined,
throughput after it); with `--rebalance-every K` the placement is re-solved for the measured load every K
decode steps (each rebalance: experts moved, max/mean load before and after). Then the no-failure cost of
elastic mode: the plain engine and the elastic engine on the same requests, alternated (A B B A ...),
medians of decode tokens/s; with `--rebalance-every K` a third arm, elastic with
rebalancing, beside the elastic one: `rebalance_cost_ratio` (its median over elastic's), and what its
rebalances did (done, skipped within `--rebalance-threshold`, kept; copies moved against a solve from scratch;
max/mean load before and after). The load average of the machine is reported beside the ratios.

`register` only touches argparse; the engine is imported by the handler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from mbridge_epoverlap.arg_types import count, positive
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.cli.args import (
    checked_source,
    epoch_args,
    host_args,
    model_args,
    on_hosts,
    progress_printer,
    resolve_dtype,
)
from mbridge_epoverlap.serving.cli.output import fmt, print_result, print_rows
from mbridge_epoverlap.serving.cli.serve import run_reporting_failure

# Not the serving default (qwen3_30b_a3b): 8 experts, so 4 expert workers with 4 redundant slots survive one loss.
ELASTIC_DEFAULT_RECIPE = "mixtral_8x22b"



def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "elastic-bench", help="decode through SIGKILLed expert workers: interruption, throughput, correctness",
        description="Elastic EP: kill expert workers mid-decode and measure the interruption, detection time, "
                    "throughput before/after and token equality with a failure-free run; then the cost of "
                    "elastic mode without failures against the plain engine. "
                    f"Default model: {ELASTIC_DEFAULT_RECIPE}.")
    model_args(bench, required=False)
    bench.add_argument("--attn-workers", type=positive, default=1, metavar="A", help="attention workers (default 1)")
    bench.add_argument("--expert-workers", type=positive, default=4, metavar="E", help="expert workers (default 4)")
    bench.add_argument("--redundant-experts", type=count, default=4, metavar="R",
                       help="redundant expert slots over all expert workers (default 4)")
    bench.add_argument("--kill", type=count, default=1, metavar="K", help="expert workers killed (default 1)")
    bench.add_argument("--kill-step", type=positive, default=8, metavar="S",
                       help="decode step of the kill (default 8)")
    bench.add_argument("--kill-every", type=count, default=None, metavar="S",
                       help="kill the --kill K workers one after another, one every S decode steps from --kill-step "
                            "(default: all K at once)")
    bench.add_argument("--micro-batches", type=positive, default=2, metavar="M", help="default 2")
    bench.add_argument("--batch", type=positive, default=16, metavar="B", help="requests (default 16)")
    bench.add_argument("--steps", type=positive, default=32, metavar="S", help="tokens per request (default 32)")
    bench.add_argument("--repeats", type=positive, default=3, metavar="N",
                       help="plain/elastic pairs for the no-failure cost (default 3)")
    bench.add_argument("--no-expert-restore", action="store_true",
                       help="no weight copy: losing every replica of an expert ends the run naming it")
    epoch_args(bench)
    host_args(bench)
    bench.set_defaults(handler=handle_elastic_bench)


def handle_elastic_bench(args: argparse.Namespace) -> int:
    source = checked_source(args, ELASTIC_DEFAULT_RECIPE)
    from mbridge_epoverlap.serving.elastic.layout import check_elastic
    from mbridge_epoverlap.serving.engine.bench import finish_bench_result, synthetic_requests
    from mbridge_epoverlap.serving.engine.elastic_plan import check_kills, kill_schedule, make_elastic, routing_groups
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    dtype = resolve_dtype(args, source)
    spec = load_spec(source, dtype=args.dtype)
    check_elastic(spec.num_experts, args.expert_workers, args.redundant_experts, args.kill)
    if args.rejoin_after_steps and not args.kill:
        raise UsageError(f"--rejoin-after-steps {args.rejoin_after_steps} replaces a killed expert worker; add "
                         "--kill 1 (or more)")
    kill_every = _kill_every(args)
    check_kills(spec.num_experts, args.expert_workers, args.redundant_experts,
                kill_schedule(args.kill, args.kill_step, kill_every), restore=not args.no_expert_restore,
                steps=args.steps, groups=routing_groups(spec))
    requests = synthetic_requests(args.batch, spec.vocab_size)
    plain = make_plan(spec, requests, attn_workers=args.attn_workers, expert_workers=args.expert_workers,
                      micro_batches=args.micro_batches, max_new_tokens=args.steps, max_batch=args.batch,
                      backend=args.backend, timeout_s=args.timeout, dtype=args.dtype)
    plain = on_hosts(plain, args)  # every arm on the same (emulated) hosts
    elastic = make_elastic(plain, redundant=args.redundant_experts)
    killing = make_elastic(plain, redundant=args.redundant_experts, kill=args.kill, kill_step=args.kill_step,
                           restore=not args.no_expert_restore, rebalance_every=args.rebalance_every,
                           rejoin_after_steps=args.rejoin_after_steps, kill_every=kill_every,
                           rebalance_threshold=args.rebalance_threshold, rejoin_hold=args.rejoin_hold)
    say = progress_printer(args)
    # The no-failure arms: plain, elastic, and with --rebalance-every elastic with rebalancing.
    arms: dict[str, Any] = {"plain": plain, "elastic": elastic}
    if args.rebalance_every:
        arms["rebalancing"] = make_elastic(plain, redundant=args.redundant_experts,
                                           rebalance_every=args.rebalance_every,
                                           rebalance_threshold=args.rebalance_threshold)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    restarts: list[float] = []  # the baseline: a fresh start of the same elastic serve, to its first token
    reference = None
    rebalancing_runs: list[dict[str, Any]] = []
    elastic_runs: list[list[dict[str, Any]]] = []  # the no-failure elastic runs' completions
    # With a replacement, a failure run in every round right after that round's no-failure runs: its rate after
    # the rejoin is compared with the elastic run beside it over the same steps (runs minutes apart differ by
    # more than the rejoin costs on a shared machine).
    failure_runs: list[tuple[dict[str, Any], int]] = []
    rejoin_ratios: list[float | None] = []
    when = (f"one every {kill_every} decode steps from step {args.kill_step}" if kill_every
            else f"at decode step {args.kill_step}")
    load_start = os.getloadavg()
    for i in range(args.repeats):
        # A B, then B A: neither side always runs first (warm caches, a neighbour's load).
        say(f"no-failure round {i + 1}/{args.repeats}: {', '.join(arms)}")
        for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            started: list[float] = []
            run = run_engine(arms[name], on_start=lambda _pids, at=started: at.append(time.monotonic()))
            rates[name].append(run["decode_tokens_per_s"])
            if name == "plain" and reference is None:
                reference = {c["id"]: c["output_ids"] for c in run["completions"]}
            first = run.get("elastic", {}).get("first_token_at")
            if name == "elastic" and started and first is not None:
                restarts.append(first - started[0])
            if name == "rebalancing":
                rebalancing_runs.append(run)
            if name == "elastic":
                elastic_runs.append(run["completions"])
        if args.rejoin_after_steps:
            say(f"round {i + 1}/{args.repeats}: elastic run killing {args.kill} of {args.expert_workers} expert "
                f"workers {when}, a replacement after {args.rejoin_after_steps} steps")
            failure_runs.append(run_reporting_failure(killing, say))
            rejoin_ratios.append(_rejoin_ratio(failure_runs[-1][0], elastic_runs[-1]))
    load_end = os.getloadavg()
    if not failure_runs:
        say(f"elastic run killing {args.kill} of {args.expert_workers} expert workers {when}")
        failure_runs.append(run_reporting_failure(killing, say))
    result, code = failure_runs[-1]  # the reported run; every round's outputs and losses are checked
    code = max(c for _, c in failure_runs)
    summary = result.get("elastic", {})
    got = {c["id"]: c["output_ids"] for c in result["completions"]}
    every_equal = all({c["id"]: c["output_ids"] for c in r["completions"]} == reference for r, _ in failure_runs)
    lost_any = sorted({i for r, _ in failure_runs for i in r["failed_requests"]})
    medians = {name: statistics.median(values) for name, values in rates.items()}
    plain_rates, elastic_rates = rates["plain"], rates["elastic"]
    cost = medians["rebalancing"] / medians["elastic"] if "rebalancing" in medians and medians["elastic"] else None
    # The two arms run next to each other in every round (plain, elastic, rebalancing, then reversed): the median
    # of the rounds' ratios is less exposed to a neighbour's load drifting over the rounds than that of medians.
    paired = statistics.median(r / e for e, r in zip(rates["elastic"], rates["rebalancing"], strict=True)) \
        if "rebalancing" in rates and all(rates["elastic"]) else None
    report: dict[str, Any] = {
        "interruption_s": summary.get("interruption_s"), "detected_after_s": summary.get("detected_after_s"),
        "throughput_before": summary.get("throughput_before"), "throughput_after": summary.get("throughput_after"),
        "survivors_share": summary.get("survivors_share"),
        "outputs_match_reference": code == 0 and got == reference and every_equal,
        "lost_requests": lost_any, "lost_workers": summary.get("lost_workers"),
        "restored_experts": summary.get("restored_experts"), "events": summary.get("events", []),
        "rejoined_workers": summary.get("rejoined_workers", []), "rejoined_after_s": summary.get("rejoined_after_s"),
        "rejoin_wait_s": summary.get("rejoin_wait_s"),
        "throughput_after_rejoin": summary.get("throughput_after_rejoin"),
        # The pre-failure rate is measured on the first, shortest contexts: the run without a failure over the
        # steps after the rejoin is the like-for-like baseline (median over its runs).
        "throughput_same_steps_without_failure": _same_steps(elastic_runs, summary.get("rejoined_at_token")),
        # Each round's failure run after its rejoin over the no-failure elastic run beside it, same steps.
        "rejoin_throughput_ratio": statistics.median(r for r in rejoin_ratios if r is not None)
        if any(r is not None for r in rejoin_ratios) else None,
        "rejoin_throughput_ratio_rounds": rejoin_ratios,
        "rebalances": summary.get("rebalances", []),
        "failures": failure_table(summary.get("failures", []), args.expert_workers, outputs_equal=code == 0
                                  and got == reference and every_equal, lost=lost_any, restarts=restarts),
        "restart_s": restarts, "restart_s_median": statistics.median(restarts) if restarts else None,
        "no_failure": {"plain_tokens_per_s": plain_rates, "elastic_tokens_per_s": elastic_rates,
                       "elastic_over_plain": medians["elastic"] / medians["plain"] if medians["plain"] else None,
                       "rebalancing_tokens_per_s": rates.get("rebalancing"),
                       "rebalancing_over_elastic": cost,
                       "rebalancing": rebalance_summary(rebalancing_runs, reference)
                       if args.rebalance_every else None},
        "rebalance_cost_ratio": cost, "rebalance_cost_ratio_paired": paired,
        "load_average": {"start": list(load_start), "end": list(load_end)},
        "layout": {"attn_workers": args.attn_workers, "expert_workers": args.expert_workers,
                   "redundant_experts": args.redundant_experts, "kill": args.kill, "kill_step": args.kill_step,
                   "kill_every": kill_every,
                   "rebalance_every": args.rebalance_every, "rejoin_after_steps": args.rejoin_after_steps,
                   "rebalance_threshold": args.rebalance_threshold,
                   "slots": list(killing.slots), "requests": args.batch, "tokens_per_request": args.steps},
    }
    finish_bench_result(report, spec)  # the tokens were checked against the failure-free run above
    report["source"] = source
    report["dtype"] = dtype.to_dict()
    print_result(report, args.json, _table)
    return code


def _rejoin_ratio(result: dict[str, Any], completions: list[dict[str, Any]]) -> float | None:
    """A failure run's tokens/s after its rejoin over a no-failure run's over the same decode steps."""
    from mbridge_epoverlap.serving.elastic.report import rate_from_step

    summary = result.get("elastic", {})
    after, step = summary.get("throughput_after_rejoin"), summary.get("rejoined_at_token")
    same = rate_from_step(completions, step) if step is not None else None
    return after / same if after and same else None


def _same_steps(runs: list[list[dict[str, Any]]], step: float | None) -> float | None:
    if step is None:
        return None
    from mbridge_epoverlap.serving.elastic.report import rate_from_step

    rates = [rate for rate in (rate_from_step(completions, step) for completions in runs) if rate]
    return statistics.median(rates) if rates else None


def rebalance_summary(runs: list[dict[str, Any]], reference: dict[str, Any] | None) -> dict[str, Any]:
    """What the rebalances of the no-failure rebalancing arm's runs did, over all of them: how many were done
    (weights moved), skipped (max/mean within the threshold: nothing solved), kept (no solve lowered the load
    enough); copies moved against those a solve from scratch would have moved; max/mean load of each done one
    before and after; and whether every run's tokens equal the plain engine's."""
    records = [b for run in runs for b in run.get("elastic", {}).get("rebalances", [])]
    done = [b for b in records if not b["kept"]]
    return {
        "runs": len(runs), "considered": len(records), "done": len(done),
        "skipped": sum(1 for b in records if b["skipped"]),
        "kept": sum(1 for b in records if b["kept"] and not b["skipped"]),
        "moved_copies": sum(b["moved"] or 0 for b in done),
        "moved_copies_from_scratch": sum(b["moved_from_scratch"] or 0 for b in done),
        "incremental": sum(1 for b in done if b.get("solve") == "incremental"),
        "imbalance_before": [b["imbalance_before"] for b in done],
        "imbalance_after": [b["imbalance_after"] for b in done],
        "outputs_match_reference": reference is not None and all(
            {c["id"]: c["output_ids"] for c in run["completions"]} == reference for run in runs),
    }


def _kill_every(args: argparse.Namespace) -> int:
    """`--kill-every` checked against `--kill` (0: every kill at once)."""
    if args.kill_every is None:
        return 0
    if args.kill_every < 1:
        raise UsageError(f"--kill-every {args.kill_every} must be >= 1 (decode steps between one kill and the next); "
                         "drop it to kill every --kill worker at once")
    if args.kill < 2:
        raise UsageError(f"--kill-every {args.kill_every} spaces several kills; add --kill 2 (or more)")
    return args.kill_every


def failure_table(failures: list[dict[str, Any]], expert_workers: int, *, outputs_equal: bool, lost: list[str],
                  restarts: list[float]) -> list[dict[str, Any]]:
    """The rows of SGLang's Elastic EP table: each failure (the workers killed at one step, K at once or one of
    a series) with the failed workers so far, interruption and its phases, detection, the survivors' tokens/s
    over the rate before the first failure, lost requests and token equality (of the whole run), and the
    interruption over a full restart of the same serve (start-up to first token, median)."""
    restart = statistics.median(restarts) if restarts else None
    return [{"failed_workers": f["failed_workers"], "of": expert_workers, "workers": f["workers"], "step": f["step"],
             "interruption_s": f["interruption_s"], "detection_s": f["detection_s"], "switch_s": f["switch_s"],
             "recovery_s": f["recovery_s"], "weight_load_s": f["weight_load_s"],
             "throughput_after": f["throughput_after"], "throughput_over_before": f["after_over_before"],
             "lost_requests": len(lost), "outputs_equal": outputs_equal,
             "interruption_over_restart": f["interruption_s"] / restart
             if restart and f["interruption_s"] is not None else None}
            for f in failures]


def _print_failure_table(r: dict[str, Any]) -> None:
    header = ("failed workers", "at step", "interruption (s)", "detection (s)", "switch (s)", "recovery (s)",
              "tokens/s after / before", "lost requests", "outputs equal", "interruption / restart")
    rows = [(f"{f['failed_workers']} of {f['of']} ({f['workers']})", str(f["step"]), fmt3(f["interruption_s"]),
             fmt3(f["detection_s"]), fmt3(f["switch_s"]), fmt3(f["recovery_s"]),
             fmt3(f["throughput_over_before"], "{:.2f}"), str(f["lost_requests"]), str(f["outputs_equal"]),
             fmt3(f["interruption_over_restart"], "{:.4f}")) for f in r["failures"]]
    rows.append(("full restart (none)", "-", fmt3(r["restart_s_median"]), "-", "-", "-", "-", "-", "-",
                 f"1 (start-up to first token, median of {len(r['restart_s'])})"))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print()


def _epoch_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    if r["layout"]["rejoin_after_steps"]:
        rows.append(("rejoined workers", f"{r['rejoined_workers'] or 'none'} after {fmt3(r['rejoined_after_s'])} s "
                                         f"(waited {fmt3(r['rejoin_wait_s'])} s for the replacement), tokens/s "
                                         f"after rejoin {fmt3(r['throughput_after_rejoin'], '{:,.1f}')} (the same "
                                         f"steps without a failure: "
                                         f"{fmt3(r['throughput_same_steps_without_failure'], '{:,.1f}')})"))
        rounds = ", ".join(fmt3(x, "{:.2f}") for x in r["rejoin_throughput_ratio_rounds"])
        rows.append(("after rejoin / no failure", f"{fmt3(r['rejoin_throughput_ratio'], '{:.2f}')} (median of the "
                                                  f"rounds' ratios, each failure run beside that round's no-failure "
                                                  f"elastic run, same decode steps: {rounds})"))
    moved = [b for b in r["rebalances"] if not b["kept"]]
    if r["layout"]["rebalance_every"]:
        rows.append(("rebalances", "; ".join(f"step {b['step']}: {b['moved']} moved, max/mean "
                                             f"{b['imbalance_before']:.3f} -> {b['imbalance_after']:.3f}"
                                             for b in moved) or f"none of {len(r['rebalances'])} lowered the load"))
    return rows


def _table(r: dict[str, Any]) -> None:
    nf = r["no_failure"]
    after = r["throughput_after"]
    share = r["survivors_share"]
    ratio = after / r["throughput_before"] if after and r["throughput_before"] else None
    m = r["machine"]
    if r["failures"]:
        _print_failure_table(r)
    print_rows([
        ("layout", f"{r['layout']['attn_workers']} attention, {r['layout']['expert_workers']} expert workers, "
                   f"{r['layout']['redundant_experts']} redundant slots, {r['layout']['kill']} killed"
                   + (f" one every {r['layout']['kill_every']} steps" if r["layout"]["kill_every"] else " at once")),
        ("detected after (s)", fmt3(r["detected_after_s"])),
        ("interruption (s)", fmt3(r["interruption_s"])),
        ("tokens/s before / after", f"{fmt3(r['throughput_before'], '{:,.1f}')} / {fmt3(after, '{:,.1f}')} "
                                    f"(after/before {fmt3(ratio, '{:.2f}')}, "
                                    f"survivors' share {fmt3(share, '{:.2f}')})"),
        ("outputs match reference", str(r["outputs_match_reference"])),
        ("lost requests", ", ".join(r["lost_requests"]) or "none"),
        ("restored experts", str(r["restored_experts"])),
        *_epoch_rows(r),
        ("no failure: elastic/plain", f"{fmt3(nf['elastic_over_plain'])} (medians of "
                                      f"{len(nf['plain_tokens_per_s'])} A/B pairs, decode tokens/s)"),
        *_rebalancing_rows(r),
        ("dtype", f"{r['dtype']['dtype']} ({r['dtype']['reason']})"),
        ("machine", f"{m['cpu']} ({m['cores']} cores, avx512_bf16={m['avx512_bf16']}, amx_bf16={m['amx_bf16']})"),
        ("load average", "start " + " ".join(f"{x:.2f}" for x in r["load_average"]["start"]) + ", end "
                         + " ".join(f"{x:.2f}" for x in r["load_average"]["end"])),
    ])


def _rebalancing_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    nf = r["no_failure"]
    b = nf["rebalancing"]
    if b is None:
        return []
    before, after = b["imbalance_before"], b["imbalance_after"]
    threshold = r["layout"]["rebalance_threshold"] or "1.1 or the routing noise"
    balance = (f", max/mean median {statistics.median(before):.3f} -> {statistics.median(after):.3f}"
               if before else "")
    return [("rebalance_cost_ratio", f"{fmt3(r['rebalance_cost_ratio'])} (rebalancing every "
                                     f"{r['layout']['rebalance_every']} steps / elastic, no failure, medians of "
                                     f"{len(nf['elastic_tokens_per_s'])} alternated runs, decode tokens/s; "
                                     f"median of the rounds' ratios {fmt3(r['rebalance_cost_ratio_paired'])})"),
            ("rebalancing arm", f"{b['done']} done, {b['skipped']} skipped (max/mean <= "
                                f"{threshold}), {b['kept']} kept; {b['moved_copies']} "
                                f"copies moved ({b['moved_copies_from_scratch']} from scratch){balance}; outputs "
                                f"match reference {b['outputs_match_reference']}")]


def fmt3(value: Any, spec: str = "{:.3f}") -> str:
    """`fmt` with three decimals, the elastic report's default."""
    return fmt(value, spec)
