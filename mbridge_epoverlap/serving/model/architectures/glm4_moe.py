"""GLM-4.5 (`Glm4MoeForCausalLM`): grouped-query attention with what the other architectures here lack:

- partial rotary: only the first `partial_rotary_factor` x head_dim dimensions of each query and key head turn
  (rotate-half within them), the rest pass through (`rope_parameters.partial_rotary_factor`, or the top-level
  field of an older config.json; 0.5 when neither states it, as `Glm4MoeConfig` sets it);
- optional RMSNorm per query and key head (`use_qk_norm`) and q/k/v biases (`attention_bias`; `o_proj` has none);
- routing by `moe.router.GroupedSigmoidRouter` (sigmoid scores, `e_score_correction_bias` for the choice only,
  the `topk_group` best of `n_group` groups, `norm_topk_prob`, `routed_scaling_factor`), the router weight and
  bias in fp32 whatever the model dtype;
- `n_shared_experts` plain shared experts (one SwiGLU of `n_shared_experts` x `moe_intermediate_size`, no gate)
  in every MoE layer;
- the first `first_k_dense_replace` layers dense (SwiGLU of `intermediate_size`).

The routed experts' count is `n_routed_experts` (`num_local_experts` to the shared code). Multi-token-prediction
layers a checkpoint stores past `num_hidden_layers` (`num_nextn_predict_layers`) are not read.

Refused before any weight is read: a `topk_method` other than "noaux_tc" or a `scoring_func` other than
"sigmoid" (fields DeepSeek-style config.json files may carry), groups that cannot route (`n_group`,
`topk_group`), a rotary part of odd width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import (
    Architecture,
    ConfigFields,
    Source,
    checked_routing,
    one,
    partial_rotary_dim,
)
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


class Glm4Moe(Architecture):
    name = "Glm4MoeForCausalLM"
    summary = ("partial rotary; optional q/k RMSNorm and q/k/v bias; sigmoid routing with a correction bias, "
               "group-limited top-k, `routed_scaling_factor`; plain shared experts; dense first layers")
    # transformers' Glm4MoeConfig defaults (`n_routed_experts` read as `num_local_experts`)
    defaults = {"num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": None, "attention_bias": False,
                "use_qk_norm": False, "num_local_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
                "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "norm_topk_prob": True, "intermediate_size": 10944, "moe_intermediate_size": 1408}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        return flatten_routed_experts(raw)

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        return {**read_grouped_moe(cfg, num_layers), "qkv_bias": cfg.boolean("attention_bias"),
                "qk_norm": cfg.boolean("use_qk_norm"), "rotary_dim": partial_rotary_dim(cfg, 0.5)}

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        return grouped_moe_tensors(spec, prefix)
