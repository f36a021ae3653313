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

from mbridge_epoverlap.serving.model.architectures.base import (
    Architecture,
    ConfigFields,
    Source,
)
from mbridge_epoverlap.serving.model.architectures.grouped_moe import (
    flatten_routed_experts,
    grouped_moe_tensors,
    read_grouped_moe,
)
from mbridge_epoverlap.serving.model.architectures.rope import partial_rotary_dim
from mbridge_epoverlap.serving.model.spec import ModelSpec


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
