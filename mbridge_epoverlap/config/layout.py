"""Parallel-layout checks of a whole run: do TP/PP/CP/EP fit the number of GPUs.

These need the GPU count, which a model config alone does not carry, so they sit beside the
per-model rules of `rules.py` rather than among them. `LAYOUT_RULES` lists their ids for the docs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mbridge_epoverlap.config.fixes import expert_layout_fix
from mbridge_epoverlap.config.violations import Violation

if TYPE_CHECKING:
    from mbridge_epoverlap.config.container import RunConfig

LAYOUT_RULES: dict[str, str] = {
    "layout_world_size": "num_gpus divisible by TP * PP * CP",
    "layout_expert_parallel": "EP * ETP divides the GPUs of one pipeline stage (TP * CP * DP)",
    "layout_batch": "global_batch_size divisible by micro_batch_size * data-parallel size",
}


def data_parallel_size(cfg: RunConfig) -> int:
    m = cfg.model
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    return max(cfg.num_gpus // model_parallel, 1)


def layout_violations(cfg: RunConfig) -> list[Violation]:
    m = cfg.model
    found: list[Violation] = []
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if cfg.num_gpus % model_parallel:
        found.append(Violation(
            "layout_world_size",
            f"num_gpus={cfg.num_gpus} is not divisible by TP*PP*CP={model_parallel}",
            f"-ng {model_parallel * max(cfg.num_gpus // model_parallel, 1)}, or change -tp/-pp/-cp"))
        return found
    per_stage = cfg.num_gpus // m.pipeline_model_parallel_size
    expert_group = m.expert_model_parallel_size * (m.expert_tensor_parallel_size or 1)
    if per_stage % expert_group:
        found.append(Violation(
            "layout_expert_parallel",
            f"EP*ETP={expert_group} does not divide the {per_stage} GPUs of a pipeline stage "
            f"(num_gpus={cfg.num_gpus}, PP={m.pipeline_model_parallel_size})",
            expert_layout_fix(cfg)))
    dp = data_parallel_size(cfg)
    per_step = cfg.train.micro_batch_size * dp
    if cfg.train.global_batch_size % per_step:
        found.append(Violation(
            "layout_batch",
            f"global_batch_size={cfg.train.global_batch_size} is not divisible by micro_batch_size*DP="
            f"{cfg.train.micro_batch_size}*{dp}",
            f"-gb {per_step * max(cfg.train.global_batch_size // per_step, 1)}"))
    return found


def largest_divisor(n: int, limit: int | None = None, above: int = 0) -> int:
    """The largest divisor of `n` that is <= `limit` (default `n`) and > `above`; `above + 1` if none is."""
    top = n if limit is None else min(n, limit)
    return next((d for d in range(top, above, -1) if n % d == 0), above + 1)
