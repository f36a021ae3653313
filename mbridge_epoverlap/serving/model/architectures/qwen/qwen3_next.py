"""Qwen3-Next (`Qwen3NextForCausalLM`): a hybrid of gated DeltaNet linear attention and gated softmax attention.

What it adds to Qwen2-MoE's MoE layers (shared expert scaled by sigmoid(`shared_expert_gate`), dense layers by
`mlp_only_layers` / `decoder_sparse_step`, `norm_topk_prob`, routed weights in the model dtype):

- `layer_types`: each layer's token mixer, "linear_attention" (gated DeltaNet, `serving.model.linear.delta_net`,
  sized by the `linear_*` fields) or "full_attention"; by default three linear layers to one full one
  (`full_attention_interval`, 4).
- full attention with an output gate (q_proj gives each head its query and its gate), RMSNorm on q and k per head,
  and partial rotary (`partial_rotary_factor`, 0.25 by default).
- zero-centred RMSNorm: every norm but the DeltaNet's gated one scales by 1 + weight.

The multi-token-prediction weights of the released checkpoints (`mtp.*`) are not read.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import ConfigFields, Source, one
from mbridge_epoverlap.serving.model.architectures.qwen.qwen2_moe import Qwen2Moe
from mbridge_epoverlap.serving.model.architectures.rope import partial_rotary_dim
from mbridge_epoverlap.serving.model.spec import GatedDeltaNet, ModelSpec

LAYER_KINDS = ("linear_attention", "full_attention")
LINEAR_FIELDS = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim")


class Qwen3Next(Qwen2Moe):
    name = "Qwen3NextForCausalLM"
    summary = ("hybrid: gated DeltaNet layers (`layer_types`) with a state cache, gated full attention with partial "
               "rotary; zero-centred RMSNorm; Qwen2-MoE's gated shared expert")
    # transformers' Qwen3NextConfig defaults
    defaults = {"num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": None, "attention_bias": False,
                "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": [], "layer_types": None,
                "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "moe_intermediate_size", "shared_expert_intermediate_size", "num_local_experts",
                "num_experts_per_tok")

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        cfg.require("attention_bias", False, "an attention bias")
        moe_layers = self.sparse_layers(cfg, num_layers)
        linear = self.linear_layers(cfg, num_layers)
        return {"moe_layers": moe_layers, "expert_ffn": cfg.positive_int("moe_intermediate_size"),
                "dense_ffn": cfg.positive_int("intermediate_size") if not all(moe_layers) else 0,
                "shared_expert_ffn": cfg.positive_int("shared_expert_intermediate_size"), "shared_expert_gate": True,
                "norm_topk_prob": cfg.boolean("norm_topk_prob"), "router_weights_in_dtype": True, "qk_norm": True,
                "attention_output_gate": True, "norm_zero_centred": True, "rotary_dim": partial_rotary_dim(cfg, 0.25),
                "linear_layers": linear, "linear_attention": self.gated_delta_net(cfg) if any(linear) else None}

    @staticmethod
    def linear_layers(cfg: ConfigFields, num_layers: int) -> tuple[bool, ...]:
        """Which layers are gated DeltaNet layers: `layer_types`, else every layer but each
        `full_attention_interval`-th."""
        kinds = cfg.get("layer_types")
        if kinds is None:
            interval = cfg.positive_int("full_attention_interval")
            return tuple(bool((i + 1) % interval) for i in range(num_layers))
        if not isinstance(kinds, list) or len(kinds) != num_layers:
            raise cfg.bad("layer_types", f"a list of {num_layers} layer kinds (one per layer)")
        for i, kind in enumerate(kinds):
            if kind not in LAYER_KINDS:
                raise UsageError(f"{cfg.path}: field 'layer_types' has {kind!r} for layer {i}; the engine serves "
                                 f"{' and '.join(repr(k) for k in LAYER_KINDS)} layers")
        return tuple(kind == "linear_attention" for kind in kinds)

    @staticmethod
    def gated_delta_net(cfg: ConfigFields) -> GatedDeltaNet:
        la = GatedDeltaNet(num_key_heads=cfg.positive_int("linear_num_key_heads"),
                           num_value_heads=cfg.positive_int("linear_num_value_heads"),
                           key_head_dim=cfg.positive_int("linear_key_head_dim"),
                           value_head_dim=cfg.positive_int("linear_value_head_dim"),
                           conv_kernel=cfg.positive_int("linear_conv_kernel_dim"))
        if la.num_value_heads % la.num_key_heads:
            raise UsageError(f"{cfg.path}: field 'linear_num_value_heads' ({la.num_value_heads}) is not a multiple of "
                             f"'linear_num_key_heads' ({la.num_key_heads}); each key head serves whole value heads")
        return la

    def mixer_tensors(self, spec: ModelSpec, layer: int, prefix: str) -> dict[str, Source]:
        if not spec.is_linear(layer):
            return super().mixer_tensors(spec, layer, prefix)
        return self.linear_tensors(spec, f"{prefix}.linear_attn")

    def linear_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        """A gated DeltaNet layer's tensors as Qwen3-Next stores them (q, k, v, z fused and grouped by key head)."""
        la = spec.linear_attention
        assert la is not None
        h, f = spec.hidden_size, LINEAR_FIELDS
        return {"in_proj_qkvz.weight": one(f"{prefix}.in_proj_qkvz.weight", 2 * la.key_dim + 2 * la.value_dim, h,
                                           fields=f),
                "in_proj_ba.weight": one(f"{prefix}.in_proj_ba.weight", 2 * la.num_value_heads, h, fields=f),
                **self.delta_net_common(spec, prefix)}

    @staticmethod
    def delta_net_common(spec: ModelSpec, prefix: str) -> dict[str, Source]:
        """The convolution, decay, norm and output tensors every gated DeltaNet checkpoint names alike."""
        la = spec.linear_attention
        assert la is not None
        f = (*LINEAR_FIELDS, "linear_conv_kernel_dim")
        return {"conv_weight": one(f"{prefix}.conv1d.weight", la.conv_dim, 1, la.conv_kernel, fields=f),
                "dt_bias": one(f"{prefix}.dt_bias", la.num_value_heads, fields=f),
                "A_log": one(f"{prefix}.A_log", la.num_value_heads, fields=f),
                "norm.weight": one(f"{prefix}.norm.weight", la.value_head_dim, fields=f),
                "out_proj.weight": one(f"{prefix}.out_proj.weight", spec.hidden_size, la.value_dim, fields=f)}
