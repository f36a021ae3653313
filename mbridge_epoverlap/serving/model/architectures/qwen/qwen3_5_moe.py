"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, the text model of the Qwen3.5 MoE releases): Qwen3-Next's hybrid with its
gated DeltaNet's input projections stored apart and side by side over the heads (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`), every layer a MoE layer and the top-k always renormalised (the config has no
`mlp_only_layers`, `decoder_sparse_step` or `norm_topk_prob`). Its multimodal rotary embedding reduces to the plain
partial rope for text, whose three position streams are equal.

The releases themselves are `Qwen3_5MoeForConditionalGeneration`: the same language model under
`model.language_model.` with a vision tower beside it and its config under `text_config`; served as text
(`Qwen3_5MoeVision`), the vision tower is not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.serving.model.architectures.base import ConfigFields, Source, cat, text_config
from mbridge_epoverlap.serving.model.architectures.qwen.qwen3_next import LINEAR_FIELDS, Qwen3Next
from mbridge_epoverlap.serving.model.spec import GatedDeltaNet, ModelSpec


class Qwen3_5Moe(Qwen3Next):  # noqa: N801 (the transformers class name)
    name = "Qwen3_5MoeForCausalLM"
    summary = "Qwen3-Next's hybrid, its DeltaNet projections stored apart (`in_proj_qkv`, `_z`, `_b`, `_a`); all MoE"
    # transformers' Qwen3_5MoeTextConfig defaults
    defaults = {**Qwen3Next.defaults, "num_local_experts": 256, "num_experts_per_tok": 8}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "moe_intermediate_size",
                "shared_expert_intermediate_size")

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        every = ConfigFields(cfg.path, {**cfg.values, "decoder_sparse_step": 1, "mlp_only_layers": [],
                                        "norm_topk_prob": True}, cfg.names)
        return super().read_config(every, num_layers)

    @staticmethod
    def gated_delta_net(cfg: ConfigFields) -> GatedDeltaNet:
        la = Qwen3Next.gated_delta_net(cfg)
        return GatedDeltaNet(la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel,
                             grouped=False)

    def linear_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        la = spec.linear_attention
        assert la is not None
        h, f = spec.hidden_size, LINEAR_FIELDS
        return {"in_proj_qkvz.weight": cat((f"{prefix}.in_proj_qkv.weight", (la.conv_dim, h)),
                                           (f"{prefix}.in_proj_z.weight", (la.value_dim, h)), fields=f),
                "in_proj_ba.weight": cat((f"{prefix}.in_proj_b.weight", (la.num_value_heads, h)),
                                         (f"{prefix}.in_proj_a.weight", (la.num_value_heads, h)), fields=f),
                **self.delta_net_common(spec, prefix)}


class Qwen3_5MoeVision(Qwen3_5Moe):  # noqa: N801 (the transformers class name)
    name = "Qwen3_5MoeForConditionalGeneration"
    summary = ("the Qwen3.5-MoE releases: the language model (`text_config`, tensors under `model.language_model.`) "
               "served on text prompts; the vision tower is not read")
    tensor_prefixes = (("model.", "model.language_model."),)

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        flat, names = super().flatten_config(path, text_config(path, raw))
        return flat, {**{k: f"text_config.{k}" for k in raw.get("text_config", {})}, **names}
