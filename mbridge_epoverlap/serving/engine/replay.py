"""The replay: the stage times the workers measured, fed to the simulator with the order the engine ran.

`stage_times_ms` turns the workers' reports into one cost per stage of the stage table, `replay` times
the engine's order with those costs (`ping_pong` over `DISAGGREGATED_RESOURCES`, or the colocated order
over `COLOCATED_RESOURCES`) and gives a predicted step time, throughput and per-role utilization, and
`measured_utilization` is the measured counterpart of the last. Each step also pays the attention side's
measured `overhead` (its wall time outside every stage), once.

The transfer time comes from the fastest round trips (dispatch issued -> combine received): slower
ones include waiting behind other micro-batches. Each worker's `StageTimer.summary` already keeps
only its fastest tenth (`round_trip_ms`); here they are pooled and their median taken, not filtered
again (a second tenth of the tenth would leave about the fastest hundredth).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mbridge_epoverlap.schedule.program import ATTN, COMBINE, DISPATCH, EXPERTS, POST
from mbridge_epoverlap.serving.engine.plan import COLOCATED, EnginePlan
from mbridge_epoverlap.serving.workers.attention import SAMPLE_STAGE
from mbridge_epoverlap.serving.workers.stage_timer import OVERHEAD_STAGE


def measured_utilization(ranks: Sequence[dict[str, Any]], compute: Sequence[str]) -> float:
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
    # One transfer: what is left of the fastest round trips after the expert compute, halved. The workers sent
    # only their fastest round trips (module docstring).
    trips = [t for r in readers for t in r.get("stages", {}).get("round_trip_ms", [])]
    transfer = max(0.0, (statistics.median(trips) - experts) / 2) if trips else 0.0
    return {ATTN.name: attn, EXPERTS.name: experts, POST.name: median(readers, POST.name),
            DISPATCH.name: transfer, COMBINE.name: transfer, SAMPLE_STAGE: median(readers, SAMPLE_STAGE),
            OVERHEAD_STAGE: median(readers, OVERHEAD_STAGE)}


def replay(plan: EnginePlan, stages: dict[str, float], *, tokens_per_step: float) -> dict[str, Any]:
    """Feed measured stage times to the simulator: predicted step time, throughput and utilization."""
    from mbridge_epoverlap.schedule.resources import COLOCATED_RESOURCES, DISAGGREGATED_RESOURCES
    from mbridge_epoverlap.schedule.serving_orders import COLOCATED_ORDERS, ping_pong
    from mbridge_epoverlap.schedule.simulator import simulate

    spec = plan.load_spec()
    if plan.mode == COLOCATED:
        steps, resources = COLOCATED_ORDERS[plan.order](plan.micro_batches, spec.num_layers), COLOCATED_RESOURCES
    else:
        steps, resources = None, DISAGGREGATED_RESOURCES

    def cost(step: Any) -> float:
        # Dense layers have no routed experts and move nothing (layers number on across decode steps).
        if not spec.is_moe(step.layer % spec.num_layers) and step.stage in (DISPATCH.name, EXPERTS.name,
                                                                             COMBINE.name):
            return 0.0
        if step.stage == POST.name and step.layer % spec.num_layers == spec.num_layers - 1:
            # The last layer's post also runs the head and picks the tokens: once per micro-batch and step,
            # where the median post (over every layer) leaves it out.
            return stages.get(POST.name, 0.0) + stages.get(SAMPLE_STAGE, 0.0)
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
        (short, short_busy), (long, long_busy) = (timed(ping_pong(plan.micro_batches, n * spec.num_layers))
                                                  for n in (2, 4))
        makespan = (long - short) / 2
        busy = {role: (long_busy.get(role, 0.0) - short_busy.get(role, 0.0)) / 2 for role in long_busy}
    # What a step spends outside its stages (batch building, the step agreement, bookkeeping), once per step on
    # the attention side: it delays the step's first dispatch, so the whole step.
    makespan += stages.get(OVERHEAD_STAGE, 0.0)
    if plan.mode == COLOCATED:
        utilization = {"attention": busy.get("compute", 0.0) / makespan if makespan else 0.0}
        utilization["expert"] = utilization["attention"]
    else:
        utilization = {role: busy.get(role, 0.0) / makespan if makespan else 0.0 for role in ("attention", "expert")}
    return {"step_ms": makespan, "tokens_per_s": tokens_per_step / makespan * 1e3 if makespan else 0.0,
            "utilization": utilization, "stage_ms": stages}
