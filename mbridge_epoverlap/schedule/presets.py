"""Named schedules with three-number costs: what `mbridge-epoverlap simulate` runs.

Also the closed form of the ping-pong pipeline. The serving performance model uses it, so the
planner and the simulator share one model of the pipeline; the tests hold the two equal.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.costs import check_duration, serving_costs, training_costs
from mbridge_epoverlap.schedule.resources import COLOCATED_RESOURCES, DISAGGREGATED_RESOURCES, TRAINING
from mbridge_epoverlap.schedule.serving_orders import ping_pong, two_batch_overlap
from mbridge_epoverlap.schedule.simulator import simulate
from mbridge_epoverlap.schedule.timeline import Timeline
from mbridge_epoverlap.schedule.training_orders import one_f_one_b

SCHEDULES: tuple[str, ...] = ("pingpong", "1f1b", "two-batch")
DEFAULT_MICRO_BATCHES = {"pingpong": 3, "1f1b": 4, "two-batch": 2}


def ping_pong_makespan(t_attn: Any, t_expert: Any, t_comm: Any, micro_batches: Any, layers: int) -> Any:
    """Exact makespan of `ping_pong(m, L)` with these stage times (and a free residual).

    One micro-batch's trip through a layer takes `R = T_a + T_e + 2*T_c`; the slowest station (the
    attention worker, the expert worker or a link) sets the beat `T_f`. A layer's round for all m
    micro-batches takes `max(m*T_f, R)`: the stations stay busy if `m*T_f >= R`, otherwise each
    micro-batch's round trip does. The first layer fills the pipeline (`R`), the last one drains it
    (`(m-1)*T_f`). With `m*T_f >= 2*(T_f + T_c)` and `T_c <= T_f` this is MegaScale-Infer's
    `(T_a + T_e + 2*T_c) + T_f*(m*L - 1)`; with m = 1 it is `L*(T_a + T_e + 2*T_c)`.

    Works on floats and on numpy arrays alike.
    """
    round_trip = t_attn + t_expert + 2 * t_comm
    beat = _maximum(_maximum(t_attn, t_expert), t_comm)
    return round_trip + (layers - 1) * _maximum(micro_batches * beat, round_trip) + (micro_batches - 1) * beat


def _maximum(a: Any, b: Any) -> Any:  # floats or numpy arrays
    if hasattr(a, "__array__") or hasattr(b, "__array__"):
        # Arrays only come from callers that already imported numpy, so this import is free.
        import numpy

        return numpy.maximum(a, b)
    return max(a, b)


def min_micro_batches(t_attn: float, t_expert: float, t_comm: float) -> int:
    """Smallest m that keeps the busiest station of the ping-pong pipeline busy: `m*T_f >= R`.

    With balanced stages (`T_a = T_e = T_f`) this is MegaScale-Infer's `m >= 2*(1 + T_c/T_f)`.
    """
    beat = max(t_attn, t_expert, t_comm)
    if beat <= 0:
        return 1
    round_trip = t_attn + t_expert + 2 * t_comm
    m = max(1, int(round_trip // beat))
    while m * beat < round_trip:
        m += 1
    return m


def simulate_schedule(
    schedule: str,
    *,
    micro_batches: int | None = None,
    layers: int = 2,
    t_attn: float = 1.0,
    t_expert: float = 1.0,
    t_comm: float = 0.5,
    t_post: float = 0.0,
    overlap: bool = True,
    delay_wgrad: bool = False,
    backward_factor: float = 2.0,
    paired_edges: bool = True,
) -> Timeline:
    """Simulate a named schedule.

    Args:
        schedule: "pingpong" (disaggregated serving), "1f1b" (training) or "two-batch" (colocated serving).
        micro_batches: micro-batches (defaults: pingpong 3, 1f1b 4, two-batch 2).
        layers: MoE layers.
        t_attn: attention time of one micro-batch in one layer.
        t_expert: expert time of one micro-batch in one layer.
        t_comm: time of one all-to-all (or one M2N transfer).
        t_post: unpermute and residual time.
        overlap: 1f1b only: combined 1F1B (True) or plain 1F1B (False).
        delay_wgrad: 1f1b only: delay expert weight gradients into the dispatch-backward window.
        backward_factor: 1f1b only: backward over forward compute time.
        paired_edges: 1f1b only: interleave the first two forwards and the last two backwards (True) or run
            them alone as Megatron-Core does (see `training_orders.one_f_one_b`).

    Raises:
        UsageError: unknown schedule name or a nonsensical number.
    """
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    m = DEFAULT_MICRO_BATCHES[schedule] if micro_batches is None else micro_batches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise UsageError(f"--micro-batches must be an integer >= 1, got {m!r}; pass e.g. --micro-batches 3")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise UsageError(f"--layers must be an integer >= 1, got {layers!r}; pass e.g. --layers 2")
    for name, value in (("--t-attn", t_attn), ("--t-expert", t_expert), ("--t-comm", t_comm), ("--t-post", t_post)):
        check_duration(name, value)
    if schedule == "1f1b":
        costs = training_costs(t_attn, t_expert, t_comm, t_post=t_post, backward_factor=backward_factor)
        steps = one_f_one_b(m, layers, overlap=overlap, delay_wgrad=delay_wgrad, paired_edges=paired_edges)
        return simulate(steps, costs, TRAINING)
    costs = serving_costs(t_attn, t_expert, t_comm, t_post=t_post)
    if schedule == "pingpong":
        return simulate(ping_pong(m, layers), costs, DISAGGREGATED_RESOURCES)
    return simulate(two_batch_overlap(m, layers), costs, COLOCATED_RESOURCES)
