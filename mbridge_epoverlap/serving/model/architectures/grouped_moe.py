"""The MoE layers DeepSeek-V3 introduced, as GLM-4.5 and DeepSeek-V3 (and the families built on them) state them:
grouped sigmoid routing with a correction bias (`moe.router.GroupedSigmoidRouter`), plain shared experts and dense
first layers. `read_grouped_moe` reads their config fields into the spec, `grouped_moe_tensors` names their router
and shared-expert tensors, `flatten_routed_experts` reads `n_routed_experts` as the expert count.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, checked_routing, one
from mbridge_epoverlap.serving.model.spec import GroupedRouting, ModelSpec

# the only routing `GroupedSigmoidRouter` implements, under the names DeepSeek's config.json gives it
_ROUTING_FIELDS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def flatten_routed_experts(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`n_routed_experts` under the name `checkpoint` reads (`num_local_experts`), the file's name kept for
    messages."""
    if "n_routed_experts" not in raw:
        return raw, {}
    out = {k: v for k, v in raw.items() if k != "n_routed_experts"}
    out["num_local_experts"] = raw["n_routed_experts"]
    return out, {"num_local_experts": "n_routed_experts"}


def read_grouped_moe(cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
    """The `ModelSpec` fields of DeepSeek-V3-style MoE layers: dense first layers, grouped sigmoid routing and
    plain shared experts (GLM-4.5 and DeepSeek-V3 read them alike)."""
    for name, only in _ROUTING_FIELDS.items():
        if cfg.get(name) is not None and cfg.get(name) != only:
            raise UsageError(f"{cfg.path}: field {name!r} is {cfg.get(name)!r}; only {only!r} is supported")
    dense = cfg.get("first_k_dense_replace")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise cfg.bad("first_k_dense_replace", "a non-negative integer")
    moe_layers = tuple(i >= dense for i in range(num_layers))
    scaling = cfg.get("routed_scaling_factor")
    routing = checked_routing(cfg, GroupedRouting(
        n_group=cfg.positive_int("n_group"), topk_group=cfg.positive_int("topk_group"),
        routed_scaling_factor=cfg.positive_float("routed_scaling_factor") if scaling is not None else 1.0))
    shared = cfg.get("n_shared_experts")
    if isinstance(shared, bool) or not isinstance(shared, int | None) or (shared or 0) < 0:
        raise cfg.bad("n_shared_experts", "a non-negative integer or null")
    expert_ffn = cfg.positive_int("moe_intermediate_size")
    return {"moe_layers": moe_layers, "expert_ffn": expert_ffn,
            "dense_ffn": cfg.positive_int("intermediate_size") if not all(moe_layers) else 0,
            "shared_expert_ffn": expert_ffn * (shared or 0), "norm_topk_prob": cfg.boolean("norm_topk_prob"),
            "grouped_routing": routing}


def grouped_moe_tensors(spec: ModelSpec, prefix: str) -> dict[str, Source]:
    """The router (`gate.weight`, `gate.e_score_correction_bias`) and the shared experts of a MoE layer."""
    experts = ("n_routed_experts", "hidden_size")
    out = {"router.weight": one(f"{prefix}.gate.weight", spec.num_experts, spec.hidden_size, fields=experts),
           "router.e_score_correction_bias": one(f"{prefix}.gate.e_score_correction_bias", spec.num_experts,
                                                 fields=experts)}
    if spec.shared_expert_ffn:
        shared = Architecture.mlp_tensors(f"{prefix}.shared_experts", spec.shared_expert_ffn, spec.hidden_size,
                                          "moe_intermediate_size")
        out.update({f"shared_expert.mlp.{k}": v for k, v in shared.items()})
    return out
