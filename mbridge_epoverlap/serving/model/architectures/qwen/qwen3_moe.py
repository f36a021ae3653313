"""Qwen3-MoE (`Qwen3MoeForCausalLM`): RMSNorm on each query and key head, dense layers where
`mlp_only_layers` / `decoder_sparse_step` say, top-k renormalised only with `norm_topk_prob`, the routed
weights rounded to the model dtype, an optional sliding window (`use_sliding_window`)."""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields


class Qwen3Moe(Architecture):
    name = "Qwen3MoeForCausalLM"
    summary = "q/k RMSNorm per head; dense layers by `mlp_only_layers`/`decoder_sparse_step`; `norm_topk_prob`"
    defaults = {"num_key_value_heads": 4, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False, "sliding_window": 4096, "use_sliding_window": False,
                "rope_theta": 10000.0, "eos_token_id": None, "decoder_sparse_step": 1,
                "norm_topk_prob": False, "mlp_only_layers": [], "attention_bias": False}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "moe_intermediate_size", "num_local_experts", "num_experts_per_tok")

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        cfg.require("attention_bias", False, "an attention bias")
        moe_layers = self.sparse_layers(cfg, num_layers)
        window = (cfg.positive_int("sliding_window")
                  if cfg.boolean("use_sliding_window") and cfg.get("sliding_window") is not None else None)
        return {"moe_layers": moe_layers, "expert_ffn": cfg.positive_int("moe_intermediate_size"),
                "dense_ffn": cfg.positive_int("intermediate_size") if not all(moe_layers) else 0,
                "qk_norm": True, "norm_topk_prob": cfg.boolean("norm_topk_prob"), "router_weights_in_dtype": True,
                "sliding_window": window}
