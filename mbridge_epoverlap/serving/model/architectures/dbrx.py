"""DBRX (`DbrxForCausalLM`): every layer MoE; its own config.json and tensor layout.

- config.json nests the attention and FFN settings (`attn_config`, `ffn_config`) and renames the sizes
  (`d_model`, `n_heads`, `n_layers`, `max_seq_len`); `flatten_config` maps them to the names `checkpoint` reads
  and keeps the file's names for messages (`attn_config.kv_n_heads`).
- q, k and v come from one fused `Wqkv` projection, clamped to +-`attn_config.clip_qkv` when it is set.
- Bias-free LayerNorm (eps 1e-5, `nn.LayerNorm`'s default) before attention (`norm_1`), before the experts
  (`norm_2`) and at the end (`norm_f`).
- Routing: softmax over all experts in the logits' dtype, top-k, divided by their p-norm
  (`ffn_config.moe_normalize_expert_weights`, p=1 by default; null: not normalised); the weights stay in that
  dtype. `moe_jitter_eps` only perturbs training, so it is ignored.
- Experts are stored fused per layer: `ffn.experts.mlp.{w1,v1,w2}`, each [experts * ffn, hidden], expert e
  owning rows [e * ffn, (e + 1) * ffn); `w1` is the gate, `v1` the up projection and `w2` the down projection
  stored transposed ([ffn, hidden], multiplied as stored). An expert's rows are read alone (`Source.rows`).

The rotary base is `rope_parameters.rope_theta` where config.json has it (what `transformers` 5.x saves and
uses); an older config.json without it states the base as `attn_config.rope_theta`, which is read instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, cat, one
from mbridge_epoverlap.serving.model.spec import ModelSpec

# name `checkpoint` reads -> where DBRX's config.json keeps it (dots: a field of a nested object)
_FIELDS = {
    "hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
    "max_position_embeddings": "max_seq_len", "num_key_value_heads": "attn_config.kv_n_heads",
    "clip_qkv": "attn_config.clip_qkv", "num_local_experts": "ffn_config.moe_num_experts",
    "num_experts_per_tok": "ffn_config.moe_top_k", "ffn_hidden_size": "ffn_config.ffn_hidden_size",
    "moe_normalize_expert_weights": "ffn_config.moe_normalize_expert_weights",
    "hidden_act": "ffn_config.ffn_act_fn.name",
}
# read under their own names
_KEPT = ("architectures", "vocab_size", "tie_word_embeddings", "eos_token_id", "rope_parameters", "rope_scaling",
         "rope_theta", "quantization_config")


class Dbrx(Architecture):
    name = "DbrxForCausalLM"
    summary = ("nested `attn_config`/`ffn_config`; fused `Wqkv` clamped by `clip_qkv`; bias-free LayerNorm; "
               "top-k divided by its p-norm; experts fused in one tensor per projection")
    # transformers' DbrxConfig / DbrxAttentionConfig / DbrxFFNConfig defaults, under the flattened names
    defaults = {"num_key_value_heads": 1, "clip_qkv": None, "num_local_experts": 4, "num_experts_per_tok": 1,
                "ffn_hidden_size": 3584, "moe_normalize_expert_weights": 1.0, "hidden_act": "silu",
                "head_dim": None, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 10000.0,
                "eos_token_id": None}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "ffn_hidden_size",
                "num_local_experts", "num_experts_per_tok")
    expert_ffn_field = "ffn_config.ffn_hidden_size"

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        flat = {k: raw[k] for k in _KEPT if k in raw}
        for key, where in _FIELDS.items():
            found, value = _lookup(path, raw, where)
            if found:
                flat[key] = value
        # an older config.json states the rotary base only here; a 5.x one also has `rope_parameters`
        found, theta = _lookup(path, raw, "attn_config.rope_theta")
        if found and "rope_parameters" not in raw and "rope_theta" not in raw:
            flat["rope_theta"] = theta
            return flat, {**_FIELDS, "rope_theta": "attn_config.rope_theta"}
        return flat, dict(_FIELDS)

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        hidden, heads = cfg.positive_int("hidden_size"), cfg.positive_int("num_attention_heads")
        if hidden % heads:
            raise UsageError(f"{cfg.path}: field 'd_model' ({hidden}) is not a multiple of 'n_heads' ({heads}); "
                             "DBRX's head size is d_model / n_heads")
        clip = None if cfg.get("clip_qkv") is None else cfg.positive_float("clip_qkv")
        p = cfg.get("moe_normalize_expert_weights")
        return {"moe_layers": tuple([True] * num_layers), "expert_ffn": cfg.positive_int("ffn_hidden_size"),
                "normalization": "LayerNorm", "clip_qkv": clip, "norm_topk_prob": False,
                "router_softmax_in_dtype": True,
                "topk_norm_p": None if p is None else cfg.positive_float("moe_normalize_expert_weights"),
                "router_weights_in_dtype": True, "fused_qkv": True, "expert_gate_up_separate": True}

    def attention_sources(self, spec: ModelSpec) -> dict[str, Source]:
        h, d, hq, hkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        attn = ("d_model", "n_heads", "attn_config.kv_n_heads")
        out = self.model_ends(spec, "transformer.wte.weight", "transformer.norm_f.weight", "lm_head.weight",
                              hidden_field="d_model")
        for i in range(spec.num_layers):
            hf, ours = f"transformer.blocks.{i}", f"layers.{i}"
            block = f"{hf}.norm_attn_norm"
            out[f"{ours}.input_norm.weight"] = one(f"{block}.norm_1.weight", h, fields=("d_model",))
            out[f"{ours}.post_norm.weight"] = one(f"{block}.norm_2.weight", h, fields=("d_model",))
            out[f"{ours}.attention.qkv.weight"] = one(f"{block}.attn.Wqkv.weight", (hq + 2 * hkv) * d, h, fields=attn)
            out[f"{ours}.attention.proj.weight"] = one(f"{block}.attn.out_proj.weight", h, hq * d, fields=attn)
            out[f"{ours}.router.weight"] = one(f"{hf}.ffn.router.layer.weight", spec.num_experts, h,
                                               fields=("ffn_config.moe_num_experts", "d_model"))
        return out

    def expert_sources(self, spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
        h, f, n = spec.hidden_size, spec.expert_ffn, spec.num_experts
        prefix = f"transformer.blocks.{layer}.ffn.experts.mlp"
        fused = (n * f, h)
        span = (expert * f, (expert + 1) * f)
        fields = ("ffn_config.moe_num_experts", "ffn_config.ffn_hidden_size", "d_model")
        up = cat((f"{prefix}.w1", fused), (f"{prefix}.v1", fused), fields=fields, rows=(span, span))
        return up, one(f"{prefix}.w2", *fused, fields=fields, rows=span, transpose=True)


def _lookup(path: Path, raw: dict[str, Any], where: str) -> tuple[bool, Any]:
    """(found, value) of the dotted field `where`; an enclosing field that is not an object is a UsageError."""
    value: Any = raw
    walked: list[str] = []
    for key in where.split("."):
        if value is None and walked:
            return False, None  # `ffn_act_fn: null`: transformers' default
        if not isinstance(value, dict):
            raise UsageError(f"{path}: field {'.'.join(walked)!r} is {value!r}; it must be an object")
        if key not in value:
            return False, None
        value = value[key]
        walked.append(key)
    return True, value
