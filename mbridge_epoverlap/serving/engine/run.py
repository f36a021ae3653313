"""The serving engine: start the workers, hand out the requests, gather completions, stage times and a replay.

`run_engine` validates everything before any process starts (model, layout, prompts), starts the workers
with the training runtime's launcher (supervision, heartbeats, timeouts, the failed worker named), and
merges what the workers report:

- completions with time to first token and time between tokens per request;
- throughput (generated tokens over the slowest attention worker's decode time);
- measured per-stage times and per-role utilization (compute time over wall time);
- the replay (`serving.engine.replay`): the measured stage times fed to the simulator with the same
  order (`ping_pong` on `DISAGGREGATED`, or the colocated order on `COLOCATED`) give a predicted step
  time, throughput and per-role utilization beside the measured ones.

A worker that dies makes the others stop within the timeout; the run still reports every request, the
ones in flight as failed (`EngineFailed.result`).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.schedule.program import ATTN, DISPATCH, EXPERTS, POST
from mbridge_epoverlap.serving.engine.plan import COLOCATED, EnginePlan, deal_requests
from mbridge_epoverlap.serving.engine.replay import measured_utilization, replay, stage_times_ms
from mbridge_epoverlap.serving.workers.requests import Request, micro_batch_limit

_HEADER_BYTES = 4096  # room for the M2N message header and the control tensor

# glibc's malloc gives every block above 128 KB its own mapping and returns it on free, so each of a prefill's
# large temporaries (tens of MB of gathered rows, expert outputs, partial sums) costs fresh zeroed pages: on a
# 64-prompt Qwen3-MoE prefill, 3.2 s against 2.7 s with blocks kept in the heap (AMD EPYC Zen 4, one thread),
# the same arithmetic. Applied to the workers where the caller's environment does not set them.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
              "MALLOC_TOP_PAD_": str(256 << 20)}


def worker_env(threads: int) -> dict[str, str]:
    """The environment every worker process starts with: its torch threads and the allocator settings."""
    import os

    env = {key: value for key, value in MALLOC_ENV.items() if key not in os.environ}
    return {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


class EngineFailed(RunFailedError):
    """A worker failed; `result` still lists every request (finished ones ok, the others failed)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def make_plan(spec: Any, requests: Sequence[Request], *, attn_workers: int = 1, expert_workers: int = 1,
              micro_batches: int = 2, colocated: int = 0, order: str = "two_batch_overlap",
              max_new_tokens: int = 16, max_batch: int = 64, placement: Sequence[int] | None = None,
              backend: str = "m2n", timeout_s: float = 30.0, num_layers: int | None = None, seed: int = 0,
              dtype: str = "float32", online_requests: Sequence[str] = (), online_events: str = "",
              max_model_len: int = 0, max_prefill_tokens: int = 0, threads: int = 0,
              replicated_experts: bool = False, prefix_cache_bytes: int = 0) -> EnginePlan:
    """Check a layout against the model and deal the requests to the attention workers (round robin).

    Online serving (`online_requests`, one front-end endpoint per attention worker, and `online_events`) deals
    none: requests arrive while the workers run, each at most `max_model_len` tokens long, and an engine step feeds
    at most `max_prefill_tokens` prompt tokens over its attention workers (0: `max_model_len` per admission); a
    longer prompt is fed in chunks over several steps; `prefix_cache_bytes` gives each attention worker an automatic
    prefix cache of that size (0: none; none for a hybrid model, whose DeltaNet or Mamba-2 states blocks cannot
    restore). `replicated_experts`: colocated processes hold every expert each (no all-to-all;
    `EnginePlan.replicated_experts`). `threads` is torch's intra-op threads per worker
    process; 0 shares the cores evenly (`plan.default_threads`).

    Raises:
        UsageError: a count below one, more expert workers than experts, a placement that does not fit,
            a model without MoE layers, or a bad generation limit.
    """
    from mbridge_epoverlap.serving.engine.plan import check_layout, default_threads
    from mbridge_epoverlap.serving.workers.placement import Placement

    check_layout(attn_workers=attn_workers, expert_workers=expert_workers, micro_batches=micro_batches,
                 processes=colocated, colocated=colocated > 0, num_experts=spec.num_experts)
    if replicated_experts and not colocated:
        raise UsageError("--replicate-experts applies to colocated processes; add --colocated N")
    if not spec.moe_layer_ids:
        raise UsageError(f"{spec.source}: the model has no MoE layer; the engine serves MoE models")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: need at least 1")
    if threads < 0:
        raise UsageError(f"--threads {threads}: need at least 1 (or 0 for the cores over the processes)")
    holders = colocated or expert_workers
    table = (Placement.from_list(placement, holders) if placement is not None
             else Placement.balanced(spec.num_experts, holders))
    if len(table.owner) != spec.num_experts:
        raise UsageError(f"the placement has {len(table.owner)} entries for {spec.num_experts} experts")
    dealt = deal_requests(requests, colocated or attn_workers)
    # The largest message: every token of a full micro-batch of prefills routed k times to one worker (a
    # prefill carries the prompt; later steps one token per sequence). A micro-batch holds at most its
    # share of the batch limit (`AttentionSide.refill`).
    prefill_budget = 0
    if online_requests:  # an admission feeds its budget's prompt tokens (chunks of longer prompts) beside decoding
        prefill_budget = admission_budget(max_prefill_tokens, colocated or attn_workers,
                                          1 if colocated else micro_batches) if max_prefill_tokens else 0
        rows = (max(max_model_len, prefill_budget) + micro_batch_limit(max_batch, micro_batches, 0)) * spec.top_k
    else:
        longest = max(len(r.prompt_ids) for r in requests)
        per_micro_batch = min(micro_batch_limit(max_batch, micro_batches, 0), max(len(d) for d in dealt))
        rows = per_micro_batch * longest * spec.top_k
    element = 2 if dtype == "bfloat16" else 4
    slot_bytes = rows * (spec.hidden_size * element + 8) + _HEADER_BYTES
    return EnginePlan(source=str(spec.source), attn_workers=attn_workers, expert_workers=expert_workers,
                      processes=colocated, micro_batches=micro_batches, order=order if colocated else "ping_pong",
                      placement=table.owner, max_new_tokens=max_new_tokens, max_batch=max_batch, requests=dealt,
                      backend=backend, slot_bytes=slot_bytes, timeout_s=timeout_s, num_layers=num_layers, seed=seed,
                      dtype=dtype, online_requests=tuple(online_requests), online_events=online_events,
                      max_model_len=max_model_len, prefill_budget=prefill_budget,
                      # a hybrid model's sequences also carry DeltaNet or Mamba-2 states (DeepSeek-V4's windows
                      # and pooled entries), which cached key and value blocks cannot restore: its prompts are
                      # prefilled whole
                      prefix_cache_bytes=(prefix_cache_bytes if online_requests and not spec.state_layer_ids
                                          and spec.compressed is None else 0),
                      replicated_experts=replicated_experts,
                      threads=threads or default_threads(colocated or attn_workers + expert_workers))


def admission_budget(step_tokens: int, attention_sides: int, admissions_per_step: int) -> int:
    """The prompt tokens one admission may start when an engine step may start `step_tokens` over its attention
    sides, each admitting `admissions_per_step` times a step (a colocated rank once, a disaggregated attention
    worker at each micro-batch's boundary)."""
    return max(1, step_tokens // (attention_sides * admissions_per_step))


def run_engine(plan: EnginePlan, *, progress: Callable[[str], None] | None = None,
               on_start: Callable[[list[int]], None] | None = None, run_timeout_s: float = 900.0,
               link: Any = None) -> dict[str, Any]:
    """Run `plan` on local worker processes and return the merged result; `link`: the emulated hosts'
    `launch.netns.EmulatedLink` when the caller created it (the online front end binds on its gateway).

    Raises:
        EngineFailed: a worker failed or timed out; the message names it, `result` holds every request.
    """
    import sys

    from mbridge_epoverlap.launch import launch_processes

    pids: list[int] = []

    def started(ids: list[int]) -> None:
        pids.extend(ids)
        if on_start is not None:
            on_start(ids)

    command = [sys.executable, "-m", "mbridge_epoverlap.serving.engine.worker_main", "--plan", "{workdir}/plan.json",
               "--out", "{workdir}"]

    def replacement(rank: int, generation: int) -> list[str] | None:  # one replacement per lost expert worker
        return command + ["--rejoin", str(generation)] if generation == 1 and rank in plan.expert_ranks else None

    from mbridge_epoverlap.serving.engine.hosts import host_of_ranks

    rendezvous, store = None, None
    if plan.store_hosted:  # this process holds the rendezvous: any worker may be lost
        from mbridge_epoverlap.comm.store import hosted_store

        address = link.gateway_address if link is not None else "127.0.0.1"
        store, port = hosted_store(address, timeout_s=plan.timeout_s)
        rendezvous = (address, port)
    try:
        # Every worker's torch threads (the launcher's default is one; the worker sets torch from this) and allocator.
        ranks = launch_processes(plan.world, lambda rank: command, files={"plan.json": plan.to_json()},
                                 env_vars=worker_env(plan.threads_per_process),
                                 timeout_s=run_timeout_s, progress=progress, on_start=started,
                                 rank_names=plan.rank_names(), collect=collect_reports,
                                 expendable=plan.expendable_ranks,
                                 respawn=replacement if plan.elastic and plan.rejoin_after_steps else None,
                                 activity="serving", emulate_link_gbps=plan.emulate_link_gbps or None,
                                 emulate_hosts=host_of_ranks(plan), link=link, rendezvous=rendezvous)
    except RunFailedError as exc:
        partial = getattr(exc, "partial", {"ranks": []})
        raise EngineFailed(str(exc), merge(plan, partial["ranks"], failed=True)) from None
    finally:
        _remove_shared_memory(pids)
        del store  # the rendezvous ends with the run
    result = merge(plan, ranks["ranks"])
    if plan.elastic and not plan.online:  # online: the front end reported each loss as it happened
        from mbridge_epoverlap.serving.elastic.report import elastic_summary

        result["elastic"] = elastic_summary(plan, ranks)
    return result


def collect_reports(workdir: Path) -> dict[str, Any]:
    """What the workers left in `workdir`: their reports (`rank<R>.json`) and, under fault injection, when
    each killed worker died (`killed<R>`)."""
    import json

    ranks = []
    for path in sorted(workdir.glob("rank*.json")):
        try:
            ranks.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    killed = {}
    for path in sorted(workdir.glob("killed*")):  # fault injection: when each killed worker died
        with contextlib.suppress(OSError, ValueError):
            killed[int(path.name.removeprefix("killed"))] = float(path.read_text())
    return {"ranks": ranks, "killed_at": killed}


def _remove_shared_memory(pids: list[int]) -> None:
    """Segments a killed worker could not unlink (the communicator names them by owner pid)."""
    try:
        from mbridge_epoverlap.comm.m2n.shm import remove_leftovers
    except ImportError:  # pragma: no cover
        return
    remove_leftovers(pids)


def merge(plan: EnginePlan, ranks: Sequence[dict[str, Any]], *, failed: bool = False) -> dict[str, Any]:
    """One result from the workers' reports (requests a dead worker never reported are failed)."""
    readers = [r for r in ranks if r["role"] != "expert"]
    holders = [r for r in ranks if r["role"] != "attention"]
    completions = {c["id"]: c for r in readers for c in r.get("completions", [])}
    for dealt in plan.requests:
        for request in dealt:
            completions.setdefault(str(request["id"]), {"id": str(request["id"]), "output_ids": [], "ttft_ms": None,
                                                        "tbt_ms": [], "status": "failed"})
    ordered = [completions[i] for i in plan.arrival_order()]
    tokens = sum(len(c["output_ids"]) for c in ordered)
    wall = max((r.get("wall_s", 0.0) for r in readers), default=0.0)
    tbts = [t for c in ordered for t in c["tbt_ms"]]
    result: dict[str, Any] = {
        "mode": plan.mode, "order": plan.order, "micro_batches": plan.micro_batches,
        "threads_per_process": plan.threads_per_process,
        "worker_threads": [r.get("torch_threads") for r in sorted(ranks, key=lambda r: r["rank"])],
        "worker_cores": [r.get("step_cores") for r in sorted(ranks, key=lambda r: r["rank"])],
        "attn_workers": plan.attn_workers if plan.mode != COLOCATED else plan.processes,
        "expert_workers": plan.expert_workers if plan.mode != COLOCATED else plan.processes,
        "completions": ordered, "generated_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "decode_tokens_per_s": decode_rate(readers),
        "tbt_ms_p50": _percentile(tbts, 50), "tbt_ms_p99": _percentile(tbts, 99),
        "ttft_ms_p50": _percentile([c["ttft_ms"] for c in ordered if c["ttft_ms"] is not None], 50),
        "decode_steps": max((r.get("decode_steps", 0) for r in readers), default=0),
        "failed_requests": [c["id"] for c in ordered if c["status"] != "ok"],
        "expert_load": expert_load(ranks),
    }
    held = [r["memory"] for r in sorted(ranks, key=lambda r: r["rank"]) if "memory" in r]
    if held:
        from mbridge_epoverlap.memory import total

        result["memory"] = total(held)
    if failed or not readers or plan.online:  # online: the front end measured each request itself
        return result
    stages = stage_times_ms(readers, holders)
    result["stage_ms"] = stages
    result["utilization"] = {
        "attention": measured_utilization(readers, (ATTN.name, POST.name, DISPATCH.name)),
        "expert": measured_utilization(holders, (EXPERTS.name,)),
    }
    result["predicted"] = replay(plan, stages, tokens_per_step=decode_tokens_per_step(readers))
    return result


def expert_load(ranks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The expert load the workers counted: `routed` (`[MoE layers][experts]` (token, choice) pairs the attention
    workers' routers chose, summed over them), `served` (the pairs the expert workers computed, summed over those
    that reported, resends included; absent when none did, e.g. colocated), `layers` (the MoE layer ids of the
    rows), `max_over_mean` (of `routed`, per layer) and `max_over_mean_all_layers` (of `routed` summed over layers:
    what the elastic re-solve balances); empty when no worker reported."""
    def total(reports: list[dict[str, Any]]) -> list[list[int]] | None:
        loads = [r["expert_load"]["counts"] for r in reports if r.get("expert_load")]
        if not loads:
            return None
        return [[sum(column) for column in zip(*rows, strict=True)] for rows in zip(*loads, strict=True)]

    def ratio(row: list[int]) -> float | None:
        return max(row) / (sum(row) / len(row)) if row and sum(row) else None

    routed = total([r for r in ranks if r["role"] != "expert"])
    if routed is None:
        return {}
    layers = next(r["expert_load"]["layers"] for r in ranks if r.get("expert_load"))
    out: dict[str, Any] = {"layers": layers, "routed": routed, "max_over_mean": [ratio(row) for row in routed],
                           "max_over_mean_all_layers": ratio([sum(column) for column in zip(*routed, strict=True)])}
    served = total([r for r in ranks if r["role"] == "expert"])
    if served is not None:
        out["served"] = served
    return out


def decode_rate(readers: Sequence[dict[str, Any]]) -> float:
    """Steady decode throughput: the attention workers' token rates over their steps after the first
    (which holds the prefills), summed (they decode side by side)."""
    total = 0.0
    for r in readers:
        log = r.get("step_log", [])[1:]
        seconds, tokens = sum(s for s, _ in log), sum(t for _, t in log)
        total += tokens / seconds if seconds > 0 else 0.0
    return total


def decode_tokens_per_step(readers: Sequence[dict[str, Any]]) -> float:
    """Tokens one decode step produces over all attention workers (steps after the first, averaged)."""
    total = 0.0
    for r in readers:
        log = r.get("step_log", [])
        steady = log[1:] or log
        total += statistics.fmean(t for _, t in steady) if steady else 0.0
    return total


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[position]


def with_requests(plan: EnginePlan, requests: Sequence[Request]) -> EnginePlan:
    """The same layout with other requests."""
    return replace(plan, requests=deal_requests(requests, len(plan.requests)))
