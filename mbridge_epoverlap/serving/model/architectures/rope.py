"""The rotary embedding's settings as config.json states them, read once for every family: how much of each head
turns (`partial_rotary_dim`) and YaRN's parameters (`yarn_scaling`, with `yarn_attention_factor`), as `transformers`
completes them. The arithmetic is `moe.rotary`'s and `layers.rotary_for`'s.
"""

from __future__ import annotations

import math
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import ConfigFields
from mbridge_epoverlap.serving.model.spec import RopeScaling


def partial_rotary_dim(cfg: ConfigFields, default_factor: float) -> int:
    """How many leading dimensions of each attention head the rotary embedding turns (0: all), as `transformers`
    computes it: int(head_dim * partial_rotary_factor), the factor from `rope_parameters` (5.x), the top level (4.x)
    or the config class's default."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    field, factor = "partial_rotary_factor", default_factor
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        field, factor = "rope_parameters.partial_rotary_factor", params["partial_rotary_factor"]
    elif cfg.get("partial_rotary_factor") is not None:
        factor = cfg.get("partial_rotary_factor")
    heads = cfg.positive_int("num_attention_heads")
    head_dim = (cfg.positive_int("hidden_size") // heads if cfg.get("head_dim") is None
                else cfg.positive_int("head_dim"))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise UsageError(f"{cfg.path}: field {field!r} is {factor!r}; it must be a number in (0, 1]")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise UsageError(f"{cfg.path}: field {field!r} is {factor!r}; the rotated part of a head "
                         f"(int({head_dim} * {factor}) = {dim}) must be a positive even size")
    return 0 if dim == head_dim else dim


def yarn_scaling(cfg: ConfigFields, default: dict[str, Any] | None = None) -> RopeScaling | None:
    """YaRN's parameters as `transformers` completes them (`standardize_rope_params`, then
    `_compute_yarn_parameters`) from `rope_parameters` (5.x) or `rope_scaling` (4.x), else `default`; None for the
    default rope. The rope type itself is checked by `checkpoint`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or default or {}
    field = "rope_scaling" if cfg.get("rope_scaling") and not cfg.get("rope_parameters") else "rope_parameters"
    if params.get("rope_type", params.get("type", "default")) == "default":
        return None
    fields = ConfigFields(cfg.path, {f"{field}.{k}": v for k, v in params.items()})
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UsageError(f"{cfg.path}: field '{field}.partial_rotary_factor' is {partial!r}; only 1.0 (the "
                         "whole head rotated) is supported")
    original = (fields.positive_int(f"{field}.original_max_position_embeddings")
                if "original_max_position_embeddings" in params else cfg.positive_int("max_position_embeddings"))
    factor = (fields.positive_float(f"{field}.factor") if params.get("factor") is not None
              else cfg.positive_int("max_position_embeddings") / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
    else:
        attention_factor = fields.positive_float(f"{field}.attention_factor")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise fields.bad(f"{field}.truncate", "true or false")
    beta_fast = fields.positive_float(f"{field}.beta_fast") if params.get("beta_fast") else 32.0
    beta_slow = fields.positive_float(f"{field}.beta_slow") if params.get("beta_slow") else 1.0
    return RopeScaling(kind="yarn", factor=factor, beta_fast=beta_fast, beta_slow=beta_slow,
                       original_max_position_embeddings=original, truncate=truncate,
                       attention_factor=attention_factor)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """cos/sin scale YaRN infers when the config gives no `attention_factor`: 0.1 ln(factor) + 1 (1 for
    factor <= 1), or the ratio of two such terms weighted by `mscale` and `mscale_all_dim` when both are given."""
    def get_mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)
