"""Where each weight of a Hugging Face Mixtral / Qwen3-MoE checkpoint lives, and its expected shape.

The serving modules store the query, key and value projections as one matrix, and each SwiGLU's gate and
up projections as one (gate rows first), as `moe.attention` and `moe.experts` do; a `Source` lists the
checkpoint tensors that are concatenated (along dim 0) into one parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from mbridge_epoverlap.serving.model.spec import ModelSpec

MIXTRAL = "MixtralForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
ARCHITECTURES = (MIXTRAL, QWEN3_MOE)


@dataclass(frozen=True)
class Source:
    """Checkpoint tensors (name, shape) concatenated along dim 0 into one parameter, and the config.json
    fields their shapes come from (named when a shape does not match)."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    fields: tuple[str, ...] = ("hidden_size",)


def _one(name: str, *shape: int, fields: tuple[str, ...] = ("hidden_size",)) -> Source:
    return Source(((name, tuple(shape)),), fields)


def _cat(*parts: tuple[str, tuple[int, ...]], fields: tuple[str, ...] = ("hidden_size",)) -> Source:
    return Source(tuple(parts), fields)


_ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def _moe_prefix(spec: ModelSpec, layer: int) -> str:
    block = "block_sparse_moe" if spec.architecture == MIXTRAL else "mlp"
    return f"model.layers.{layer}.{block}"


def attention_sources(spec: ModelSpec) -> dict[str, Source]:
    """Parameter name of `serving.model.parts.AttentionPart` -> its checkpoint tensors."""
    h, d, hq, hkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    vocab = ("vocab_size", "hidden_size")
    out = {"embedding": _one("model.embed_tokens.weight", spec.vocab_size, h, fields=vocab),
           "final_norm.weight": _one("model.norm.weight", h)}
    if not spec.tie_word_embeddings:
        out["head.weight"] = _one("lm_head.weight", spec.vocab_size, h, fields=vocab)
    for i in range(spec.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn = f"{hf}.self_attn"
        out[f"{ours}.input_norm.weight"] = _one(f"{hf}.input_layernorm.weight", h)
        out[f"{ours}.post_norm.weight"] = _one(f"{hf}.post_attention_layernorm.weight", h)
        out[f"{ours}.attention.qkv.weight"] = _cat(
            (f"{attn}.q_proj.weight", (hq * d, h)), (f"{attn}.k_proj.weight", (hkv * d, h)),
            (f"{attn}.v_proj.weight", (hkv * d, h)), fields=_ATTENTION_FIELDS)
        out[f"{ours}.attention.proj.weight"] = _one(f"{attn}.o_proj.weight", h, hq * d, fields=_ATTENTION_FIELDS)
        if spec.qk_norm:
            out[f"{ours}.attention.q_norm.weight"] = _one(f"{attn}.q_norm.weight", d, fields=_ATTENTION_FIELDS)
            out[f"{ours}.attention.k_norm.weight"] = _one(f"{attn}.k_norm.weight", d, fields=_ATTENTION_FIELDS)
        if spec.is_moe(i):
            out[f"{ours}.router.weight"] = _one(f"{_moe_prefix(spec, i)}.gate.weight", spec.num_experts, h,
                                                fields=("num_local_experts", "hidden_size"))
        else:
            f, fields = spec.dense_ffn, ("intermediate_size", "hidden_size")
            out[f"{ours}.mlp.fc1.weight"] = _cat((f"{hf}.mlp.gate_proj.weight", (f, h)),
                                                 (f"{hf}.mlp.up_proj.weight", (f, h)), fields=fields)
            out[f"{ours}.mlp.fc2.weight"] = _one(f"{hf}.mlp.down_proj.weight", h, f, fields=fields)
    return out


def expert_sources(spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
    """(gate and up projections -> `w1[e]` [2*ffn, hidden], down projection -> `w2[e]` [hidden, ffn])."""
    h, f = spec.hidden_size, spec.expert_ffn
    prefix = f"{_moe_prefix(spec, layer)}.experts.{expert}"
    if spec.architecture == MIXTRAL:
        gate, up, down = f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight"
        fields = ("intermediate_size", "hidden_size")
    else:
        gate, up, down = f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"
        fields = ("moe_intermediate_size", "hidden_size")
    return _cat((gate, (f, h)), (up, (f, h)), fields=fields), _one(down, h, f, fields=fields)


def all_sources(spec: ModelSpec) -> list[Source]:
    """Every tensor the model reads, attention part first, then experts by layer and id."""
    sources = list(attention_sources(spec).values())
    for layer in spec.moe_layer_ids:
        for e in range(spec.num_experts):
            sources.extend(expert_sources(spec, layer, e))
    return sources
