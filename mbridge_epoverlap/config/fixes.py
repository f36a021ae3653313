"""Fixes that must agree across rules: one expert-parallel size that satisfies every EP constraint.

`layout_expert_parallel` (EP x ETP divides the GPUs of a pipeline stage) and `ep_divides_experts`
(EP divides the expert count) both suggest an EP size; pasting either must make its rule pass, and
when both fire they suggest the same size, one that satisfies both.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from mbridge_epoverlap.config.violations import Violation

if TYPE_CHECKING:
    from mbridge_epoverlap.config.model import MoEModelConfig


def fitting_ep(ep: int, stage_gpus: int | None, etp: int = 1, experts: int | None = None) -> int | None:
    """The largest EP <= `ep` whose EP x ETP divides `stage_gpus` (if given) and that divides `experts`
    (if given); None when no EP fits (ETP itself does not divide the stage)."""
    for candidate in range(max(ep, 1), 0, -1):
        if stage_gpus is not None and stage_gpus % (candidate * etp):
            continue
        if experts and experts > 1 and experts % candidate:
            continue
        return candidate
    return None


def gpus_for_expert_layout(num_gpus: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> int:
    """The smallest GPU count >= `num_gpus` that splits into TP x PP x CP and whose pipeline stages
    (GPUs / PP) are a multiple of EP x ETP."""
    unit = pp * math.lcm(tp * cp, ep * etp)
    return unit * max(math.ceil(num_gpus / unit), 1)


def expert_layout_fix(num_gpus: int, *, tp: int, pp: int, cp: int, ep: int, etp: int, experts: int | None) -> str:
    """The fix text of `layout_expert_parallel`: an EP size that fits, or a GPU count that fits this EP."""
    ep_fit = fitting_ep(ep, num_gpus // pp, etp, experts)
    alternatives = [f"-ep {ep_fit}"] if ep_fit is not None else []
    alternatives.append(f"-ng {gpus_for_expert_layout(num_gpus, tp, pp, cp, ep, etp)} "
                        "(GPUs a multiple of PP x lcm(TP x CP, EP x ETP))")
    return ", or ".join(alternatives)


def agree_on_ep(violations: list[Violation], m: MoEModelConfig, num_gpus: int) -> list[Violation]:
    """When both EP rules fire, make `ep_divides_experts` suggest the EP that also fits the layout of
    `m` on `num_gpus` GPUs."""
    ids = {v.rule for v in violations}
    if not {"ep_divides_experts", "layout_expert_parallel"} <= ids:
        return violations
    stage = num_gpus // m.pipeline_model_parallel_size
    ep = fitting_ep(m.expert_model_parallel_size, stage, m.expert_tensor_parallel_size or 1, m.num_moe_experts)
    if ep is None:
        return violations
    fix = (f"model.expert_model_parallel_size={ep} (flag -ep {ep}; divides the {m.num_moe_experts} experts and "
           f"fits the {stage} GPUs of a pipeline stage)")
    return [replace(v, fix=fix) if v.rule == "ep_divides_experts" else v for v in violations]
