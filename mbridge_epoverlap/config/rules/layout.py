"""Parallel-layout rules of a whole run: do TP/PP/CP/EP fit the GPUs, does the batch split evenly.

They need the GPU count and the batch shape (`RuleContext.run`), which a model config alone does not
carry, so they apply only when a whole run is validated. `global_batch_problem` is the one
global-batch divisibility check: the layout rule, the launcher and the runtime all call it.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.config.fixes import expert_layout_fix
from mbridge_epoverlap.config.rules.registry import RuleContext, rule, violation
from mbridge_epoverlap.config.violations import Violation

_LAUNCHER = "the launcher stops building process groups"


def model_parallel_size(model: Any) -> int:
    """TP * PP * CP of a model config."""
    from mbridge_epoverlap.config.model import model_attr

    return ((model_attr(model, "tensor_model_parallel_size") or 1) * (model_attr(model, "pipeline_model_parallel_size")
            or 1) * (model_attr(model, "context_parallel_size") or 1))


def data_parallel_size(num_gpus: int, model: Any) -> int:
    """GPUs / (TP * PP * CP), at least 1."""
    return max(num_gpus // model_parallel_size(model), 1)


def global_batch_problem(global_batch_size: int, micro_batch_size: int, data_parallel: int) -> str | None:
    """Why the global batch does not split into micro-batches over the data-parallel ranks, or None."""
    per_step = micro_batch_size * data_parallel
    if per_step >= 1 and global_batch_size % per_step == 0:
        return None
    return (f"train.global_batch_size={global_batch_size} is not a multiple of train.micro_batch_size "
            f"({micro_batch_size}) x {data_parallel} data-parallel ranks")


@rule("layout_world_size", "layout", "mbridge_epoverlap", "num_gpus divisible by TP * PP * CP",
      symptom=f"{_LAUNCHER} (world size not divisible)", cause="the GPUs do not split into TP x PP x CP groups",
      where="`-ng`, `-tp`, `-pp`, `-cp`", example=("num_gpus=12", "model.tensor_model_parallel_size=8"))
def _world_size(ctx: RuleContext) -> Violation | None:
    mp = model_parallel_size(ctx.model)
    if ctx.run.num_gpus % mp == 0:
        return None
    return violation("layout_world_size", f"num_gpus={ctx.run.num_gpus} is not divisible by TP*PP*CP={mp}",
                     f"-ng {mp * max(ctx.run.num_gpus // mp, 1)}, or change -tp/-pp/-cp")


@rule("layout_expert_parallel", "layout", "mbridge_epoverlap",
      "EP * ETP divides the GPUs of one pipeline stage (TP * CP * DP)",
      symptom="the launcher stops building expert process groups",
      cause="EP x ETP must divide the GPUs of one pipeline stage", where="`-ng`, `-ep`, `-et`, `-pp`",
      example=("num_gpus=8",))
def _expert_parallel(ctx: RuleContext) -> Violation | None:
    if ctx.run.num_gpus % model_parallel_size(ctx.model):
        return None  # layout_world_size says it
    pp = ctx.get("pipeline_model_parallel_size") or 1
    ep = ctx.get("expert_model_parallel_size") or 1
    per_stage = ctx.run.num_gpus // pp
    expert_group = ep * (ctx.get("expert_tensor_parallel_size") or 1)
    if per_stage % expert_group == 0:
        return None
    return violation("layout_expert_parallel",
                     f"EP*ETP={expert_group} does not divide the {per_stage} GPUs of a pipeline stage "
                     f"(num_gpus={ctx.run.num_gpus}, PP={pp})",
                     expert_layout_fix(ctx.run.num_gpus, tp=ctx.get("tensor_model_parallel_size") or 1, pp=pp,
                                       cp=ctx.get("context_parallel_size") or 1, ep=ep,
                                       etp=ctx.get("expert_tensor_parallel_size") or 1,
                                       experts=ctx.get("num_moe_experts")))


@rule("layout_batch", "layout", "mbridge_epoverlap", "global_batch_size divisible by micro_batch_size * DP",
      symptom="the job stops computing the number of micro-batches",
      cause="the global batch must split evenly over data-parallel ranks and micro-batches",
      where="`-gb`, `-mb`, `-ng`", example=("train.global_batch_size=1000",))
def _batch(ctx: RuleContext) -> Violation | None:
    if ctx.run.num_gpus % model_parallel_size(ctx.model):
        return None  # layout_world_size says it
    dp = data_parallel_size(ctx.run.num_gpus, ctx.model)
    problem = global_batch_problem(ctx.run.global_batch_size, ctx.run.micro_batch_size, dp)
    if problem is None:
        return None
    per_step = ctx.run.micro_batch_size * dp
    return violation("layout_batch", problem, f"-gb {per_step * max(ctx.run.global_batch_size // per_step, 1)}")
