"""Qwen2-MoE (`Qwen2MoeForCausalLM`): biases on the q, k and v projections (`qkv_bias`), a shared expert in
every MoE layer scaled by sigmoid(`shared_expert_gate`), dense layers where `mlp_only_layers` /
`decoder_sparse_step` say, top-k renormalised only with `norm_topk_prob`, routed weights in the model dtype.

Sliding-window attention (`use_sliding_window`, per-layer `layer_types`) is not supported: such a config is
refused before any weight is read.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, one
from mbridge_epoverlap.serving.model.spec import ModelSpec


class Qwen2Moe(Architecture):
    name = "Qwen2MoeForCausalLM"
    summary = ("q/k/v bias; shared expert scaled by sigmoid(`shared_expert_gate`); dense layers by "
               "`mlp_only_layers`/`decoder_sparse_step`; `norm_topk_prob`")
    defaults = {"num_key_value_heads": 16, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False, "use_sliding_window": False, "rope_theta": 10000.0,
                "eos_token_id": None, "decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": [],
                "qkv_bias": True, "layer_types": None}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "moe_intermediate_size", "shared_expert_intermediate_size", "num_local_experts",
                "num_experts_per_tok")

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        cfg.require("use_sliding_window", False, "sliding-window attention")
        types = cfg.get("layer_types")
        if types is not None and any(t != "full_attention" for t in types):
            raise cfg.bad("layer_types", "'full_attention' for every layer (sliding windows are not supported)")
        moe_layers = self.sparse_layers(cfg, num_layers)
        return {"moe_layers": moe_layers, "expert_ffn": cfg.positive_int("moe_intermediate_size"),
                "dense_ffn": cfg.positive_int("intermediate_size") if not all(moe_layers) else 0,
                "shared_expert_ffn": cfg.positive_int("shared_expert_intermediate_size"), "shared_expert_gate": True,
                "qkv_bias": cfg.boolean("qkv_bias"), "norm_topk_prob": cfg.boolean("norm_topk_prob"),
                "router_weights_in_dtype": True}

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        h = spec.hidden_size
        out = super().moe_tensors(spec, prefix)
        shared = self.mlp_tensors(f"{prefix}.shared_expert", spec.shared_expert_ffn, h,
                                  "shared_expert_intermediate_size")
        out.update({f"shared_expert.mlp.{k}": v for k, v in shared.items()})
        out["shared_expert.gate.weight"] = one(f"{prefix}.shared_expert_gate.weight", 1, h)
        return out
