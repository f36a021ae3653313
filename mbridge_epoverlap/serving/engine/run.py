"""The serving engine: start the workers, hand out the requests, gather completions, stage times and a replay.

`run_engine` validates everything before any process starts (model, layout, prompts), starts the workers
with the training runtime's launcher (supervision, heartbeats, timeouts, the failed worker named), and
merges what the workers report:

- completions with time to first token and time between tokens per request;
- throughput (generated tokens over the slowest attention worker's decode time);
- measured per-stage times and per-role utilization (compute time over wall time);
- the replay: the measured stage times fed to the simulator with the same order (`ping_pong` on
  `DISAGGREGATED`, or the colocated order on `COLOCATED`) give a predicted step time, throughput and
  per-role utilization beside the measured ones.

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
from mbridge_epoverlap.schedule.program import ATTN, COMBINE, DISPATCH, EXPERTS, POST
from mbridge_epoverlap.serving.engine.plan import COLOCATED, EnginePlan
from mbridge_epoverlap.serving.workers.requests import Request, micro_batch_limit

_HEADER_BYTES = 4096  # room for the M2N message header and the control tensor


class EngineFailed(RunFailedError):
    """A worker failed; `result` still lists every request (finished ones ok, the others failed)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def make_plan(spec: Any, requests: Sequence[Request], *, attn_workers: int = 1, expert_workers: int = 1,
              micro_batches: int = 2, colocated: int = 0, order: str = "two_batch_overlap",
              max_new_tokens: int = 16, max_batch: int = 64, placement: Sequence[int] | None = None,
              backend: str = "m2n", timeout_s: float = 30.0, num_layers: int | None = None, seed: int = 0,
              dtype: str = "float32") -> EnginePlan:
    """Check a layout against the model and deal the requests to the attention workers (round robin).

    Raises:
        UsageError: a count below one, more expert workers than experts, a placement that does not fit,
            a model without MoE layers, or a bad generation limit.
    """
    from mbridge_epoverlap.serving.engine.plan import check_layout
    from mbridge_epoverlap.serving.workers.placement import Placement

    check_layout(attn_workers=attn_workers, expert_workers=expert_workers, micro_batches=micro_batches,
                 processes=colocated, colocated=colocated > 0, num_experts=spec.num_experts)
    if not spec.moe_layer_ids:
        raise UsageError(f"{spec.source}: the model has no MoE layer; the engine serves MoE models")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: need at least 1")
    holders = colocated or expert_workers
    table = (Placement.from_list(placement, holders) if placement is not None
             else Placement.balanced(spec.num_experts, holders))
    if len(table.owner) != spec.num_experts:
        raise UsageError(f"the placement has {len(table.owner)} entries for {spec.num_experts} experts")
    readers = colocated or attn_workers
    dealt: list[list[dict[str, Any]]] = [[] for _ in range(readers)]
    for i, request in enumerate(requests):
        dealt[i % readers].append({"id": request.id, "prompt_ids": list(request.prompt_ids)})
    # The largest message: every token of a full micro-batch of prefills routed k times to one worker (a
    # prefill carries the prompt; later steps one token per sequence). A micro-batch holds at most its
    # share of the batch limit (`AttentionWorker._refill`).
    longest = max(len(r.prompt_ids) for r in requests)
    per_micro_batch = min(micro_batch_limit(max_batch, micro_batches, 0), max(len(d) for d in dealt))
    rows = per_micro_batch * longest * spec.top_k
    element = 2 if dtype == "bfloat16" else 4
    slot_bytes = rows * (spec.hidden_size * element + 8) + _HEADER_BYTES
    return EnginePlan(source=str(spec.source), mode=COLOCATED if colocated else "disaggregated",
                      attn_workers=attn_workers, expert_workers=expert_workers, processes=colocated,
                      micro_batches=micro_batches, order=order if colocated else "ping_pong",
                      placement=table.owner, max_new_tokens=max_new_tokens, max_batch=max_batch,
                      requests=tuple(tuple(d) for d in dealt), backend=backend, slot_bytes=slot_bytes,
                      timeout_s=timeout_s, num_layers=num_layers, seed=seed, dtype=dtype)


def run_engine(plan: EnginePlan, *, progress: Callable[[str], None] | None = None,
               on_start: Callable[[list[int]], None] | None = None, run_timeout_s: float = 900.0) -> dict[str, Any]:
    """Run `plan` on local worker processes and return the merged result.

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
        return command + ["--rejoin", str(generation)] if generation == 1 else None

    try:
        ranks = launch_processes(plan.world, lambda rank: command, files={"plan.json": plan.to_json()},
                                 timeout_s=run_timeout_s, progress=progress, on_start=started,
                                 rank_names=plan.rank_names(), collect=_collect,
                                 expendable=plan.expert_ranks if plan.elastic else (),
                                 respawn=replacement if plan.elastic and plan.rejoin_after_steps else None,
                                 activity="serving")
    except RunFailedError as exc:
        partial = getattr(exc, "partial", {"ranks": []})
        raise EngineFailed(str(exc), merge(plan, partial["ranks"], failed=True)) from None
    finally:
        _remove_shared_memory(pids)
    result = merge(plan, ranks["ranks"])
    if plan.elastic:
        from mbridge_epoverlap.serving.elastic.report import elastic_summary

        result["elastic"] = elastic_summary(plan, ranks)
    return result


def _collect(workdir: Path) -> dict[str, Any]:
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
    ordered = [completions[i] for i in arrival_order(plan)]
    tokens = sum(len(c["output_ids"]) for c in ordered)
    wall = max((r.get("wall_s", 0.0) for r in readers), default=0.0)
    tbts = [t for c in ordered for t in c["tbt_ms"]]
    result: dict[str, Any] = {
        "mode": plan.mode, "order": plan.order, "micro_batches": plan.micro_batches,
        "attn_workers": plan.attn_workers if plan.mode != COLOCATED else plan.processes,
        "expert_workers": plan.expert_workers if plan.mode != COLOCATED else plan.processes,
        "completions": ordered, "generated_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "decode_tokens_per_s": decode_rate(readers),
        "tbt_ms_p50": _percentile(tbts, 50), "tbt_ms_p99": _percentile(tbts, 99),
        "ttft_ms_p50": _percentile([c["ttft_ms"] for c in ordered if c["ttft_ms"] is not None], 50),
        "decode_steps": max((r.get("decode_steps", 0) for r in readers), default=0),
        "failed_requests": [c["id"] for c in ordered if c["status"] != "ok"],
    }
    if failed or not readers:
        return result
    stages = stage_times_ms(readers, holders)
    result["stage_ms"] = stages
    result["utilization"] = {
        "attention": _utilization(readers, (ATTN.name, POST.name, DISPATCH.name)),
        "expert": _utilization(holders, (EXPERTS.name,)),
    }
    result["predicted"] = replay(plan, stages, tokens_per_step=decode_tokens_per_step(readers))
    return result


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


def arrival_order(plan: EnginePlan) -> list[str]:
    """Request ids in the order they were given (the plan deals them round robin)."""
    ids: list[str] = []
    for position in range(max((len(d) for d in plan.requests), default=0)):
        ids += [str(dealt[position]["id"]) for dealt in plan.requests if position < len(dealt)]
    return ids


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[position]


def _utilization(ranks: Sequence[dict[str, Any]], compute: Sequence[str]) -> float:
    """Mean over the ranks of their time in `compute` stages over their wall time, in steady decode (after
    the prefill step) where the worker marked it, else over the whole run."""
    shares = []
    for r in ranks:
        stages, wall = r.get("stages", {}), r.get("wall_s", 0.0)
        if stages.get("steady_wall_s", 0.0) > 0 and stages.get("steady_busy_s", 0.0) > 0:
            shares.append(min(1.0, stages["steady_busy_s"] / stages["steady_wall_s"]))
        elif wall > 0:
            median, count = stages.get("median_ms", {}), stages.get("count", {})
            busy = sum(median.get(s, 0.0) * count.get(s, 0) for s in compute) / 1e3
            shares.append(min(1.0, busy / wall))
    return statistics.fmean(shares) if shares else 0.0


def stage_times_ms(readers: Sequence[dict[str, Any]], holders: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Measured per-stage medians (ms) in the stage table's names; `dispatch`/`combine` are one transfer."""

    def median(rows: Sequence[dict[str, Any]], key: str) -> float:
        values = [r["stages"]["median_ms"][key] for r in rows if key in r.get("stages", {}).get("median_ms", {})]
        return statistics.median(values) if values else 0.0

    attn = median(readers, ATTN.name) + median(readers, DISPATCH.name)  # the send is the attention worker's work
    experts = median(holders, EXPERTS.name)
    # One transfer: what is left of the fastest round trips (dispatch issued -> combine received) after
    # the expert compute, halved. Slower round trips include waiting behind other micro-batches.
    trips = sorted(t for r in readers for t in r.get("stages", {}).get("round_trip_ms", []))
    fast = trips[: max(1, len(trips) // 10)] if trips else [0.0]
    transfer = max(0.0, (statistics.median(fast) - experts) / 2)
    return {ATTN.name: attn, EXPERTS.name: experts, POST.name: median(readers, POST.name),
            DISPATCH.name: transfer, COMBINE.name: transfer}


def replay(plan: EnginePlan, stages: dict[str, float], *, tokens_per_step: float) -> dict[str, Any]:
    """Feed measured stage times to the simulator: predicted step time, throughput and utilization."""
    from mbridge_epoverlap.schedule.resources import COLOCATED as COLOCATED_RESOURCES
    from mbridge_epoverlap.schedule.resources import DISAGGREGATED
    from mbridge_epoverlap.schedule.simulator import simulate
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    spec = load_spec(plan.source, seed=plan.seed, num_layers=plan.num_layers, dtype=plan.dtype)
    if plan.mode == COLOCATED:
        from mbridge_epoverlap.serving.workers.colocated import ORDERS

        steps, resources = ORDERS[plan.order](plan.micro_batches, spec.num_layers), COLOCATED_RESOURCES
    else:
        steps, resources = None, DISAGGREGATED

    def cost(step: Any) -> float:
        # Dense layers have no routed experts and move nothing (layers number on across decode steps).
        if not spec.is_moe(step.layer % spec.num_layers) and step.stage in (DISPATCH.name, EXPERTS.name,
                                                                             COMBINE.name):
            return 0.0
        return stages.get(step.stage, 0.0)

    def timed(order: Any) -> tuple[float, dict[str, float]]:
        timeline = simulate(order, cost, resources)
        busy: dict[str, float] = {}
        for event in timeline.events:
            busy[event.resource] = busy.get(event.resource, 0.0) + event.end - event.start
        return timeline.makespan, busy

    if steps is not None:
        makespan, busy = timed(steps)
    else:
        # The workers stream decode steps, running ping_pong over S * L layers: the steady step is what one
        # more step adds (4 steps minus 2, halved), without the pipeline's fill and drain.
        from mbridge_epoverlap.schedule.serving_orders import ping_pong

        (short, short_busy), (long, long_busy) = (timed(ping_pong(plan.micro_batches, n * spec.num_layers))
                                                  for n in (2, 4))
        makespan = (long - short) / 2
        busy = {role: (long_busy.get(role, 0.0) - short_busy.get(role, 0.0)) / 2 for role in long_busy}
    if plan.mode == COLOCATED:
        utilization = {"attention": busy.get("compute", 0.0) / makespan if makespan else 0.0}
        utilization["expert"] = utilization["attention"]
    else:
        utilization = {role: busy.get(role, 0.0) / makespan if makespan else 0.0 for role in ("attention", "expert")}
    return {"step_ms": makespan, "tokens_per_s": tokens_per_step / makespan * 1e3 if makespan else 0.0,
            "utilization": utilization, "stage_ms": stages}


def with_requests(plan: EnginePlan, requests: Sequence[Request]) -> EnginePlan:
    """The same layout with other requests."""
    readers = len(plan.requests)
    dealt: list[list[dict[str, Any]]] = [[] for _ in range(readers)]
    for i, request in enumerate(requests):
        dealt[i % readers].append({"id": request.id, "prompt_ids": list(request.prompt_ids)})
    return replace(plan, requests=tuple(tuple(d) for d in dealt))
