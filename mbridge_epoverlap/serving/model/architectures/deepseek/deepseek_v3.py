"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (`layers.MultiLatentAttention`) and GLM-4.5's MoE
layers (`grouped_moe.read_grouped_moe`):

- queries from `q_proj`, or through a `q_lora_rank` bottleneck (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); keys and
  values from one latent of `kv_lora_rank` values per token (`kv_a_proj_with_mqa`, `kv_a_layernorm`) expanded per
  head by `kv_b_proj` (`qk_nope_head_dim` key and `v_head_dim` value), plus a `qk_rope_head_dim` rotary key shared by
  every head; `attention_bias` on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`;
- the rotary dimensions interleaved in pairs (`rope_interleave`, true by default) and YaRN scaling
  (`rope_parameters`), whose `mscale_all_dim` also scales the softmax (by mscale squared, as `transformers` does);
- sigmoid routing with a correction bias, group-limited top-k (`topk_method` "noaux_tc"), `routed_scaling_factor`;
  `n_shared_experts` plain shared experts; the first `first_k_dense_replace` layers dense.

The KV cache holds the latents (`kv_cache_bytes_per_token`). Multi-token-prediction layers a checkpoint stores past
`num_hidden_layers` (`num_nextn_predict_layers`, layer 61 of the released model) are not read; `load_spec` names
them in a log line.

Refused before any weight is read: `num_key_value_heads` other than `num_attention_heads` (MLA's keys are per head),
a `topk_method` / `scoring_func` other than "noaux_tc" / "sigmoid", groups that cannot route, a rope type other than
the default or YaRN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, one
from mbridge_epoverlap.serving.model.architectures.grouped_moe import (
    flatten_routed_experts,
    grouped_moe_tensors,
    read_grouped_moe,
)
from mbridge_epoverlap.serving.model.architectures.rope import yarn_scaling
from mbridge_epoverlap.serving.model.spec import LatentAttention, ModelSpec, RopeScaling

_MLA_FIELDS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim")


def yarn_softmax_scale(qk_head_dim: int, params: dict[str, Any] | None) -> float:
    """The attention scores' scale: qk_head_dim^-0.5, times mscale^2 where a scaled rope gives `mscale_all_dim`
    (mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for factor > 1), in `transformers`' order of operations."""
    import math

    scale = qk_head_dim ** (-0.5)
    params = params or {}
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class DeepseekV3(Architecture):
    name = "DeepseekV3ForCausalLM"
    summary = ("multi-head latent attention (latent KV cache, absorbed decode); interleaved YaRN rope with "
               "`mscale_all_dim`; sigmoid routing with a correction bias, group-limited top-k; plain shared "
               "experts; dense first layers")
    # transformers' DeepseekV3Config defaults (`n_routed_experts` read as `num_local_experts`)
    defaults = {"num_key_value_heads": None, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "rope_theta": 10000.0, "eos_token_id": 1, "attention_bias": False, "num_local_experts": 256,
                "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
                "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
                "max_position_embeddings": 4096}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    rope_types = ("default", "yarn")

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """`n_routed_experts` as `num_local_experts`, and the rotary width as `head_dim` (what `transformers`'
        config sets: the rotary embedding turns `qk_rope_head_dim` dimensions)."""
        flat, names = flatten_routed_experts(raw)
        rope = flat.get("qk_rope_head_dim", self.defaults["qk_rope_head_dim"])
        return {**flat, "head_dim": rope}, {**names, "head_dim": "qk_rope_head_dim"}

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        heads = cfg.positive_int("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise UsageError(f"{cfg.path}: field 'num_key_value_heads' is {kv_heads!r}; multi-head latent attention "
                             f"builds keys per head, so it must equal 'num_attention_heads' ({heads}) or be null")
        q_lora = cfg.get("q_lora_rank")
        interleave = cfg.boolean("rope_interleave") if cfg.get("rope_interleave") is not None else True
        nope, rope = cfg.positive_int("qk_nope_head_dim"), cfg.positive_int("qk_rope_head_dim")
        if rope % 2:
            raise cfg.bad("qk_rope_head_dim", "even (the rotary dimensions turn in pairs)")
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        scale = yarn_softmax_scale(nope + rope, params if isinstance(params, dict) else None)
        mla = LatentAttention(q_lora_rank=None if q_lora is None else cfg.positive_int("q_lora_rank"),
                              kv_lora_rank=cfg.positive_int("kv_lora_rank"), qk_nope_head_dim=nope,
                              qk_rope_head_dim=rope, v_head_dim=cfg.positive_int("v_head_dim"),
                              rope_interleave=interleave, softmax_scale=scale)
        return {**read_grouped_moe(cfg, num_layers), "mla": mla, "qkv_bias": cfg.boolean("attention_bias"),
                "rope_scaling": self._rope_scaling(cfg)}

    @staticmethod
    def _rope_scaling(cfg: ConfigFields) -> RopeScaling | None:
        """YaRN's parameters (`rope.yarn_scaling`, `mscale` / `mscale_all_dim` included); None when the config states
        no scaled rope."""
        if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
            return None
        return yarn_scaling(cfg)

    # --- tensors ------------------------------------------------------------------------------------

    def attention_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        m = spec.mla
        if m is None:
            raise ValueError(f"{spec.source}: a DeepSeek-V3 spec needs its latent attention sizes")
        h, heads, f = spec.hidden_size, spec.num_heads, _MLA_FIELDS
        qk, rank = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
        out: dict[str, Source] = {}
        if m.q_lora_rank is None:
            out["q_proj.weight"] = one(f"{prefix}.q_proj.weight", heads * qk, h, fields=f)
        else:
            out["q_a_proj.weight"] = one(f"{prefix}.q_a_proj.weight", m.q_lora_rank, h, fields=f)
            out["q_a_norm.weight"] = one(f"{prefix}.q_a_layernorm.weight", m.q_lora_rank, fields=f)
            out["q_b_proj.weight"] = one(f"{prefix}.q_b_proj.weight", heads * qk, m.q_lora_rank, fields=f)
            if spec.qkv_bias:
                out["q_a_bias"] = one(f"{prefix}.q_a_proj.bias", m.q_lora_rank, fields=f)
        out["kv_a_proj.weight"] = one(f"{prefix}.kv_a_proj_with_mqa.weight", rank + m.qk_rope_head_dim, h, fields=f)
        out["kv_a_norm.weight"] = one(f"{prefix}.kv_a_layernorm.weight", rank, fields=f)
        out["kv_b_proj.weight"] = one(f"{prefix}.kv_b_proj.weight", heads * (m.qk_nope_head_dim + m.v_head_dim), rank,
                                      fields=f)
        out["o_proj.weight"] = one(f"{prefix}.o_proj.weight", h, heads * m.v_head_dim, fields=f)
        if spec.qkv_bias:
            out["kv_a_bias"] = one(f"{prefix}.kv_a_proj_with_mqa.bias", rank + m.qk_rope_head_dim, fields=f)
            out["o_bias"] = one(f"{prefix}.o_proj.bias", h, fields=f)
        return out

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        return grouped_moe_tensors(spec, prefix)
