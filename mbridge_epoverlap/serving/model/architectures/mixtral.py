"""Mixtral (`MixtralForCausalLM`): every layer MoE, routed weights renormalised and kept fp32, an optional
sliding window; experts named `w1` (gate), `w3` (up), `w2` (down) under `block_sparse_moe`."""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields


class Mixtral(Architecture):
    name = "MixtralForCausalLM"
    summary = "all layers MoE; top-k renormalised, weights in fp32; optional sliding window"
    defaults = {"num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "sliding_window": None, "rope_theta": 1e6, "eos_token_id": 2}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "num_local_experts", "num_experts_per_tok")
    moe_block = "block_sparse_moe"
    expert_projections = ("w1", "w3", "w2")
    expert_ffn_field = "intermediate_size"

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        window = None if cfg.get("sliding_window") is None else cfg.positive_int("sliding_window")
        return {"moe_layers": tuple([True] * num_layers), "expert_ffn": cfg.positive_int("intermediate_size"),
                "norm_topk_prob": True, "router_weights_in_dtype": False, "sliding_window": window}
