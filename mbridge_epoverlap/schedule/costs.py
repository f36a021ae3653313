"""Stage costs: how long each stage of the layer program takes, in any one time unit.

The simulator accepts either a mapping `stage name -> duration` (every layer and micro-batch alike)
or a callable `Step -> duration` (for costs that vary by layer or micro-batch). The helpers here
build the common mappings from three numbers: attention, expert and communication time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.program import Step

StageCosts = Mapping[str, float] | Callable[[Step], float]


def check_duration(name: str, value: float) -> float:
    """Return `value` as a float, or raise `UsageError` if it is not a finite number >= 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise UsageError(f"{name} must be a finite time >= 0, got {value!r}; pass a non-negative duration")
    return number


def serving_costs(t_attn: float, t_expert: float, t_comm: float, *, t_post: float = 0.0) -> dict[str, float]:
    """Forward-only costs for decode: attention, experts, one transfer each way, residual.

    Args:
        t_attn: attention (plus router and permute) time of one micro-batch in one layer.
        t_expert: expert FFN time of one micro-batch in one layer.
        t_comm: time of one dispatch and of one combine transfer.
        t_post: unpermute and residual after combine (0 folds it into attention).
    """
    t_attn = check_duration("t_attn", t_attn)
    t_expert = check_duration("t_expert", t_expert)
    t_comm = check_duration("t_comm", t_comm)
    t_post = check_duration("t_post", t_post)
    return {"attn": t_attn, "dispatch": t_comm, "experts": t_expert, "combine": t_comm, "post": t_post}


def training_costs(
    t_attn: float,
    t_expert: float,
    t_comm: float,
    *,
    t_post: float = 0.0,
    backward_factor: float = 2.0,
) -> dict[str, float]:
    """Forward and backward costs for one training layer.

    Backward of a GEMM is two GEMMs of the forward's size (data gradient and weight gradient), hence
    the default `backward_factor` of 2, split evenly between dgrad and wgrad. The backward
    all-to-alls move the same bytes as the forward ones.

    Args:
        t_attn: forward attention (plus router and permute) time.
        t_expert: forward expert FFN time.
        t_comm: time of each all-to-all (dispatch, combine and their backward).
        t_post: forward unpermute and residual; its backward costs the same.
        backward_factor: backward compute time over forward compute time for attention and experts.
    """
    costs = serving_costs(t_attn, t_expert, t_comm, t_post=t_post)
    half = check_duration("backward_factor", backward_factor) / 2.0
    costs.update(
        post_bwd=costs["post"],
        combine_bwd=costs["combine"],
        experts_dgrad=costs["experts"] * half,
        # Gate/up and down projections: two thirds and one third of the experts' weight-gradient GEMMs.
        experts_wgrad=costs["experts"] * half * 2.0 / 3.0,
        experts_wgrad_down=costs["experts"] * half / 3.0,
        dispatch_bwd=costs["dispatch"],
        attn_dgrad=costs["attn"] * half,
        attn_wgrad=costs["attn"] * half,
    )
    return costs


def cost_function(costs: StageCosts) -> Callable[[Step], float]:
    """Turn `costs` into a checked `Step -> duration` function."""
    if callable(costs):
        return lambda step: check_duration(f"cost of {step}", costs(step))
    checked = {name: check_duration(f"cost of stage {name!r}", value) for name, value in costs.items()}

    def lookup(step: Step) -> float:
        try:
            return checked[step.stage]
        except KeyError:
            known = ", ".join(sorted(checked)) or "none"
            raise UsageError(
                f"no cost for stage {step.stage!r} (costs given for: {known}); add it to the costs"
            ) from None

    return lookup
