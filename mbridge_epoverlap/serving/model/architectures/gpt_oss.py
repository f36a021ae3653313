"""GPT-OSS (`GptOssForCausalLM`): every layer MoE, with what no other architecture here has:

- attention sinks: a learned logit per head (`self_attn.sinks`) joins each softmax and is dropped after it;
- biases on the q, k, v and o projections (`attention_bias`, true in the released models), on the router and on
  every expert's projections;
- sliding-window and full-attention layers alternating as `layer_types` says (`sliding_window` wide);
- routing: the k largest logits, then a softmax over them (in the model dtype);
- experts with a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`), stored fused per layer: `gate_up_proj`
  [experts, hidden, 2*ffn] with gate and up in alternating columns, `down_proj` [experts, ffn, hidden], both
  [in, out] as `transformers` multiplies them, and their biases `gate_up_proj_bias`, `down_proj_bias`;
- RMSNorm: the weight multiplies the fp32 normalised input, and the product is rounded (not the input first);
- YaRN rotary scaling (`rope_parameters`, the default when a config has none).

MXFP4 experts (`quantization_config` {"quant_method": "mxfp4"}, as OpenAI released the models: `*_blocks` and
`*_scales` instead of `gate_up_proj` and `down_proj`) are dequantized as each expert is loaded
(`serving.model.architectures.formats.mxfp4`), to the weights `transformers` dequantizes them to.

Refused before any weight is read: a rope type other than the default or YaRN, a partial rotary factor,
`layer_types` other than sliding/full attention, another quantization method, and MXFP4 widths that are not
multiples of its 32-input blocks.
"""

from __future__ import annotations

from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures import base
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, one
from mbridge_epoverlap.serving.model.architectures.rope import yarn_scaling
from mbridge_epoverlap.serving.model.spec import ModelSpec, RopeScaling

_LAYER_TYPES = ("sliding_attention", "full_attention")
_MXFP4_BLOCK = 32  # inputs per MXFP4 scale (`formats.mxfp4.BLOCK`; that module needs torch, this one not)
# GptOssConfig's rope when config.json states none (not a `defaults` entry: a 4.x config's `rope_scaling` must win)
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}


class GptOss(Architecture):
    name = "GptOssForCausalLM"
    summary = ("attention sinks; q/k/v/o, router and expert biases; sliding/full layers by `layer_types`; "
               "softmax after top-k; clamped SwiGLU; YaRN rope; MXFP4 experts dequantized at load")
    # transformers' GptOssConfig defaults (for the YaRN it sets when a config has no rope parameters: `_YARN`)
    defaults = {"num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "sliding_window": 128, "layer_types": None, "attention_bias": True,
                "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "rope_theta": 150000.0, "eos_token_id": None,
                "max_position_embeddings": 131072}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
                "num_local_experts", "num_experts_per_tok")
    expert_ffn_field = "intermediate_size"
    rope_types = ("default", "yarn")
    quantizations = ("mxfp4",)

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        return {"moe_layers": tuple([True] * num_layers), "expert_ffn": cfg.positive_int("intermediate_size"),
                "layer_windows": self._layer_windows(cfg, num_layers), "attention_sinks": True,
                "qkv_bias": cfg.boolean("attention_bias"), "attention_out_bias": cfg.boolean("attention_bias"),
                "norm_round_after_weight": True, "router_bias": True, "router_softmax_after_topk": True,
                "router_weights_in_dtype": True, "expert_bias": True, "expert_activation": "clamped_swiglu",
                "swiglu_limit": cfg.positive_float("swiglu_limit"), "swiglu_alpha": cfg.positive_float("swiglu_alpha"),
                "expert_weights_in_out": True, "rope_scaling": self._rope_scaling(cfg),
                "expert_quantization": self._quantization(cfg)}

    @staticmethod
    def _quantization(cfg: ConfigFields) -> str | None:
        """None, or "mxfp4" when the experts are stored as MXFP4 blocks (their widths then multiples of 32)."""
        config = cfg.get("quantization_config")
        if config is None:
            return None
        method = config.get("quant_method") if isinstance(config, dict) else None
        if method != "mxfp4":
            raise cfg.bad("quantization_config", "absent or {'quant_method': 'mxfp4'}")
        for name in ("hidden_size", "intermediate_size"):
            if cfg.positive_int(name) % _MXFP4_BLOCK:
                raise UsageError(f"{cfg.path}: field {name!r} is {cfg.get(name)}; MXFP4 experts "
                                 f"(field 'quantization_config') need a multiple of {_MXFP4_BLOCK}")
        return "mxfp4"

    @staticmethod
    def _layer_windows(cfg: ConfigFields, num_layers: int) -> tuple[int | None, ...]:
        types = cfg.get("layer_types")
        if types is None:  # transformers' default: even layers sliding, odd layers full
            types = [_LAYER_TYPES[i % 2] for i in range(num_layers)]
        if not isinstance(types, list) or len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
            raise cfg.bad("layer_types", f"a list of {num_layers} entries, each 'sliding_attention' or "
                                         "'full_attention'")
        window = None if cfg.get("sliding_window") is None else cfg.positive_int("sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in types)

    @staticmethod
    def _rope_scaling(cfg: ConfigFields) -> RopeScaling | None:
        """YaRN as GPT-OSS states it (`rope.yarn_scaling`; a config without one gets GPT-OSS's YaRN)."""
        return yarn_scaling(cfg, _YARN)

    # --- tensors ------------------------------------------------------------------------------------

    def attention_sources(self, spec: ModelSpec) -> dict[str, Source]:
        out = super().attention_sources(spec)
        for i in range(spec.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            out[f"{ours}.attention.sinks"] = one(f"{hf}.self_attn.sinks", spec.num_heads, fields=base.ATTENTION_FIELDS)
            out[f"{ours}.router.bias"] = one(f"{hf}.mlp.router.bias", spec.num_experts,
                                             fields=("num_local_experts",))
        return out

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        return {"router.weight": one(f"{prefix}.router.weight", spec.num_experts, spec.hidden_size,
                                     fields=("num_local_experts", "hidden_size"))}

    def expert_sources(self, spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
        """The fused tensors (every expert of the layer) an expert is read from, with their biases, for the
        checks of `load_spec`; `expert_weights` reads them."""
        h, f, n = spec.hidden_size, spec.expert_ffn, spec.num_experts
        prefix = f"model.layers.{layer}.mlp.experts"
        fields = ("num_local_experts", "hidden_size", "intermediate_size")
        if spec.expert_quantization == "mxfp4":
            half, b = _MXFP4_BLOCK // 2, _MXFP4_BLOCK
            up = Source(((f"{prefix}.gate_up_proj_blocks", (n, 2 * f, h // b, half)),
                         (f"{prefix}.gate_up_proj_scales", (n, 2 * f, h // b)),
                         (f"{prefix}.gate_up_proj_bias", (n, 2 * f))), fields)
            down = Source(((f"{prefix}.down_proj_blocks", (n, h, f // b, half)),
                           (f"{prefix}.down_proj_scales", (n, h, f // b)),
                           (f"{prefix}.down_proj_bias", (n, h))), fields)
            return up, down
        up = Source(((f"{prefix}.gate_up_proj", (n, h, 2 * f)), (f"{prefix}.gate_up_proj_bias", (n, 2 * f))), fields)
        down = Source(((f"{prefix}.down_proj", (n, f, h)), (f"{prefix}.down_proj_bias", (n, h))), fields)
        return up, down

    def expert_weights(self, reader: Any, spec: ModelSpec, layer: int, expert: int) -> dict[str, Any]:
        """Expert `expert`'s slice of the fused tensors, gate and up columns de-interleaved (gate first, as the
        serving experts hold them; which column holds what does not change a column's product)."""
        from mbridge_epoverlap.serving.model.architectures.formats import mxfp4

        prefix = f"model.layers.{layer}.mlp.experts"
        if spec.expert_quantization == "mxfp4":  # stored [out, in]: gate_up's rows interleaved
            gate_up_t = mxfp4.dequantize(_expert_row(reader, f"{prefix}.gate_up_proj_blocks", expert),
                                         _expert_row(reader, f"{prefix}.gate_up_proj_scales", expert))
            w1 = deinterleave(gate_up_t, dim=0)
            w2 = mxfp4.dequantize(_expert_row(reader, f"{prefix}.down_proj_blocks", expert),
                                  _expert_row(reader, f"{prefix}.down_proj_scales", expert))
        else:  # stored [in, out]: gate_up's columns interleaved
            w1 = deinterleave(_expert_row(reader, f"{prefix}.gate_up_proj", expert), dim=1).t()
            w2 = _expert_row(reader, f"{prefix}.down_proj", expert).t()
        b1 = deinterleave(_expert_row(reader, f"{prefix}.gate_up_proj_bias", expert), dim=0)
        return {"w1": w1, "w2": w2, "b1": b1, "b2": _expert_row(reader, f"{prefix}.down_proj_bias", expert)}


def _expert_row(reader: Any, name: str, expert: int) -> Any:
    """Expert `expert`'s entry of a fused [experts, ...] tensor, reading only that entry."""
    return reader.rows(name, expert, expert + 1)[0]


def deinterleave(t: Any, *, dim: int) -> Any:
    """Alternating gate, up entries along `dim` -> the gate entries, then the up entries."""
    import torch

    front = t.movedim(dim, 0)
    return torch.cat([front[0::2], front[1::2]]).movedim(0, dim)
