"""OLMoE (`OlmoeForCausalLM`): every layer MoE, RMSNorm over the whole query and key projections (one weight
of heads x head_dim, not one per head), top-k renormalised only with `norm_topk_prob` (false in the released
models), routed weights in the model dtype; the experts' width is `intermediate_size`.

Refused before any weight is read: `clip_qkv` (clamped projections) and `attention_bias`.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields


class Olmoe(Architecture):
    name = "OlmoeForCausalLM"
    summary = "q/k RMSNorm over the whole projection; all layers MoE; `norm_topk_prob` (default false)"
    defaults = {"num_key_value_heads": None, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": 50279, "norm_topk_prob": False,
                "attention_bias": False, "clip_qkv": None}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "num_local_experts", "num_experts_per_tok")
    expert_ffn_field = "intermediate_size"

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        cfg.require("clip_qkv", None, "clamping q, k and v")
        cfg.require("attention_bias", False, "an attention bias")
        return {"moe_layers": tuple([True] * num_layers), "expert_ffn": cfg.positive_int("intermediate_size"),
                "qk_norm": True, "qk_norm_scope": "projection", "norm_topk_prob": cfg.boolean("norm_topk_prob"),
                "router_weights_in_dtype": True}
