"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): Mixtral's layout (every layer MoE, experts `w1`/`w3`/`w2` under
`block_sparse_moe`) with

- sigmoid routing: each expert's score is the sigmoid of its logit (the logit multiplied in the model dtype), a
  correction bias (`block_sparse_moe.e_score_correction_bias`) added for the choice only, the k chosen scores
  renormalised to sum to one and kept fp32 (`GroupedSigmoidRouter` with one group and no scaling);
- RMSNorm over the whole q and k projections (OLMoE's scope), before the rotary embedding;
- partial rotary: `rope_parameters.partial_rotary_factor`, or the released configs' `rotary_dim`.

The released config.json also states `scoring_func`, `use_qk_norm`, `qk_norm_type` and `use_routing_bias`, which
`transformers` does not read; a value other than the model's own (sigmoid, true, per_layer, true) is refused.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import (
    ConfigFields,
    Source,
    checked_routing,
    one,
)
from mbridge_epoverlap.serving.model.architectures.mixtral import Mixtral
from mbridge_epoverlap.serving.model.architectures.rope import partial_rotary_dim
from mbridge_epoverlap.serving.model.spec import GroupedRouting, ModelSpec

# fields of MiniMax's own config.json that `transformers` ignores: only the values its model computes are served
_FIXED_FIELDS = {"scoring_func": "sigmoid", "use_qk_norm": True, "qk_norm_type": "per_layer",
                 "use_routing_bias": True}


class MiniMaxM2(Mixtral):
    name = "MiniMaxM2ForCausalLM"
    summary = ("Mixtral's layout; sigmoid routing with a correction bias, renormalised top-k; q/k RMSNorm over the "
               "projection; partial rotary (`rotary_dim`)")
    # transformers' MiniMaxM2Config defaults
    defaults = {"num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False, "rope_theta": 5e6, "eos_token_id": 200020, "num_local_experts": 256,
                "num_experts_per_tok": 8, "rotary_dim": None}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        for name, value in _FIXED_FIELDS.items():
            if cfg.get(name) is not None and cfg.get(name) != value:
                raise UsageError(f"{cfg.path}: field {name!r} is {cfg.get(name)!r}; MiniMax-M2 is served as "
                                 f"`transformers` computes it ({name} {value!r})")
        routing = checked_routing(cfg, GroupedRouting(n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                                      logits_in_model_dtype=True))
        return {**super().read_config(cfg, num_layers), "grouped_routing": routing, "qk_norm": True,
                "qk_norm_scope": "projection", "rotary_dim": self.rotary_dim(cfg)}

    @staticmethod
    def rotary_dim(cfg: ConfigFields) -> int:
        """The rotated part of a head: `partial_rotary_factor` where the config states it, else `rotary_dim`
        (MiniMax's own name), else the whole head."""
        params = cfg.get("rope_parameters") or {}
        if cfg.get("rotary_dim") is None or (isinstance(params, dict) and "partial_rotary_factor" in params):
            return partial_rotary_dim(cfg, 1.0)
        head_dim = cfg.positive_int("head_dim")
        dim = cfg.positive_int("rotary_dim")
        if dim > head_dim or dim % 2:
            raise cfg.bad("rotary_dim", f"an even size of at most head_dim ({head_dim})")
        return 0 if dim == head_dim else dim

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        fields = ("num_local_experts", "hidden_size")
        return {"router.weight": one(f"{prefix}.gate.weight", spec.num_experts, spec.hidden_size, fields=fields),
                "router.e_score_correction_bias": one(f"{prefix}.e_score_correction_bias", spec.num_experts,
                                                      fields=fields)}
