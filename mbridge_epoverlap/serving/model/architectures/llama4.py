"""Llama 4 (`Llama4ForCausalLM`, the text model): what no other architecture here has, per `transformers`' model:

- NoPE layers: `no_rope_layers` (1: rope, 0: none; by default every `no_rope_layer_interval`-th layer has none);
  those layers attend globally and scale their queries by the attention temperature (`attn_temperature_tuning`,
  `floor_scale`, `attn_scale`);
- chunked attention on the layers `layer_types` calls "chunked_attention" (by default the rope layers): a query
  sees only the keys of its own chunk of `attention_chunk_size` positions;
- the rope turns adjacent pairs of each head as complex numbers, optionally with Llama 3's scaling (`rope_type`
  "llama3"); on the rope layers queries and keys are then divided by their RMS per head, without a weight
  (`use_qk_norm`);
- MoE layers where `moe_layers` says (by default every `interleave_moe_layer_step`-th), the others a dense SwiGLU of
  `intermediate_size_mlp`; routing by the largest logit, whose sigmoid multiplies the expert's input (not its
  output), plus a shared expert always added; the experts stored fused per layer, `gate_up_proj`
  [experts, hidden, 2 * ffn] (gate columns, then up) and `down_proj` [experts, ffn, hidden], both [in, out].

Refused before any weight is read: more than one expert per token (`transformers` sums the experts' outputs in one
reduction the engine's combine does not reproduce; the released models route to one), a rope type other than the
default or Llama 3's, a partial rotary factor, a `layer_types` entry other than chunked or full attention (or
chunked without `attention_chunk_size`), and any quantized checkpoint.

The releases themselves (Scout, Maverick) are `Llama4ForConditionalGeneration`: the same text model under
`language_model.` with a vision model beside it and its config under `text_config`; served as text
(`Llama4Vision`), the vision model is not read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, one, text_config
from mbridge_epoverlap.serving.model.spec import ModelSpec, RopeScaling

_LAYER_TYPES = ("chunked_attention", "full_attention")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class Llama4(Architecture):
    name = "Llama4ForCausalLM"
    summary = ("NoPE layers with attention temperature; chunked attention on the rope layers; pairwise rope "
               "(Llama 3 scaling); q/k RMS norm without weights; MoE and dense layers interleaved; top-1 sigmoid "
               "score scaling the expert's input, a shared expert; fused experts")
    # transformers' Llama4TextConfig defaults
    defaults = {"num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "rope_theta": 500000.0, "eos_token_id": 2, "num_local_experts": 16,
                "num_experts_per_tok": 1, "intermediate_size_mlp": 16384, "moe_layers": None,
                "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layers": None,
                "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "layer_types": None,
                "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1, "attention_bias": False,
                "max_position_embeddings": 131072}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
    moe_block = "feed_forward"
    expert_ffn_field = "intermediate_size"
    rope_types = ("default", "llama3")
    quantizations = ()

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        top_k = cfg.positive_int("num_experts_per_tok")
        if top_k != 1:
            raise UsageError(f"{cfg.path}: field 'num_experts_per_tok' is {top_k}; Llama 4 is served with one routed "
                             "expert per token (its router score scales that expert's input), as released")
        moe_layers = self._moe_layers(cfg, num_layers)
        rope_layers = self._rope_layers(cfg, num_layers)
        ffn = cfg.positive_int("intermediate_size")
        temperature = None
        if cfg.boolean("attn_temperature_tuning"):
            attn_scale = cfg.get("attn_scale")
            number = isinstance(attn_scale, int | float) and not isinstance(attn_scale, bool)
            if not number or not math.isfinite(attn_scale):
                raise cfg.bad("attn_scale", "a number")
            temperature = (cfg.positive_float("floor_scale"), float(attn_scale))
        bias = cfg.boolean("attention_bias")
        return {"moe_layers": moe_layers, "expert_ffn": ffn, "shared_expert_ffn": ffn,
                "dense_ffn": 0 if all(moe_layers) else cfg.positive_int("intermediate_size_mlp"),
                "qkv_bias": bias, "attention_out_bias": bias, "rope_layers": rope_layers, "rope_pairs": True,
                "qk_l2_norm": cfg.boolean("use_qk_norm"), "attn_temperature": temperature,
                "layer_chunks": self._layer_chunks(cfg, rope_layers), "router_sigmoid_after_topk": True,
                "router_scales_input": True, "expert_weights_in_out": True, "rope_scaling": self._rope_scaling(cfg)}

    @staticmethod
    def _moe_layers(cfg: ConfigFields, num_layers: int) -> tuple[bool, ...]:
        """`moe_layers` where the config lists them, else every `interleave_moe_layer_step`-th layer."""
        if cfg.get("moe_layers") is None:
            step = cfg.positive_int("interleave_moe_layer_step")
            if step > num_layers:
                raise cfg.bad("interleave_moe_layer_step", f"at most the {num_layers} layers (expert-parallel serving "
                                                           "needs experts)")
            return tuple((i + 1) % step == 0 for i in range(num_layers))
        listed = cfg.int_list("moe_layers", below=num_layers)
        if not listed:
            raise cfg.bad("moe_layers", "a non-empty list of layer indices (expert-parallel serving needs experts)")
        return tuple(i in listed for i in range(num_layers))

    @staticmethod
    def _rope_layers(cfg: ConfigFields, num_layers: int) -> tuple[bool, ...]:
        """Per layer whether it has rope: `no_rope_layers` (1 or 0 per layer), or when empty every layer but each
        `no_rope_layer_interval`-th."""
        listed = cfg.get("no_rope_layers")
        if not listed:
            interval = cfg.positive_int("no_rope_layer_interval")
            return tuple((i + 1) % interval != 0 for i in range(num_layers))
        if not isinstance(listed, list) or len(listed) < num_layers or any(v not in (0, 1) for v in listed):
            raise cfg.bad("no_rope_layers", f"a list of at least {num_layers} entries, each 1 (rope) or 0 (none)")
        return tuple(bool(v) for v in listed[:num_layers])

    @staticmethod
    def _layer_chunks(cfg: ConfigFields, rope_layers: tuple[bool, ...]) -> tuple[int | None, ...]:
        """Per layer its attention chunk: `attention_chunk_size` on the layers `layer_types` calls chunked (by
        default those with rope, where a chunk size is set), None on the others."""
        size = None if cfg.get("attention_chunk_size") is None else cfg.positive_int("attention_chunk_size")
        types = cfg.get("layer_types")
        if types is None:
            types = [_LAYER_TYPES[0] if rope and size is not None else _LAYER_TYPES[1] for rope in rope_layers]
        if not isinstance(types, list) or len(types) != len(rope_layers) or any(t not in _LAYER_TYPES for t in types):
            raise cfg.bad("layer_types", f"a list of {len(rope_layers)} entries, each 'chunked_attention' or "
                                         "'full_attention'")
        if size is None and _LAYER_TYPES[0] in types:
            raise UsageError(f"{cfg.path}: field 'layer_types' has chunked layers but 'attention_chunk_size' is null; "
                             "give the chunk size")
        return tuple(size if t == _LAYER_TYPES[0] else None for t in types)

    @staticmethod
    def _rope_scaling(cfg: ConfigFields) -> RopeScaling | None:
        """Llama 3's rope scaling where the config asks for it (the rope type itself is checked by `checkpoint`),
        else None; a partial rotary factor is refused (Llama 4 turns the whole head)."""
        field = "rope_scaling" if cfg.get("rope_scaling") and not cfg.get("rope_parameters") else "rope_parameters"
        params = cfg.get(field) or {}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise UsageError(f"{cfg.path}: field '{field}.partial_rotary_factor' is "
                             f"{params['partial_rotary_factor']!r}; Llama 4 turns the whole head (only 1.0)")
        if params.get("rope_type", params.get("type", "default")) != "llama3":
            return None
        fields = ConfigFields(cfg.path, {f"{field}.{k}": v for k, v in params.items()})
        for name in _LLAMA3_FIELDS:
            if params.get(name) is None:
                raise UsageError(f"{cfg.path}: field '{field}.{name}' is missing; Llama 3 rope scaling needs "
                                 f"{', '.join(_LLAMA3_FIELDS)}")
        factor, low, high = (fields.positive_float(f"{field}.{n}") for n in _LLAMA3_FIELDS[:3])
        return RopeScaling(kind="llama3", factor=factor, beta_fast=0.0, beta_slow=0.0,
                           original_max_position_embeddings=fields.positive_int(
                               f"{field}.original_max_position_embeddings"),
                           truncate=False, attention_factor=1.0, low_freq_factor=low, high_freq_factor=high)

    # --- tensors ------------------------------------------------------------------------------------

    def attention_sources(self, spec: ModelSpec) -> dict[str, Source]:
        out = super().attention_sources(spec)
        for i in range(spec.num_layers):  # the dense layers' MLP lives under `feed_forward` too
            if not spec.is_moe(i):
                dense = self.mlp_tensors(f"model.layers.{i}.{self.moe_block}", spec.dense_ffn, spec.hidden_size,
                                         "intermediate_size_mlp")
                out.update({f"layers.{i}.mlp.{k}": v for k, v in dense.items()})
        return out

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        h = spec.hidden_size
        out = {"router.weight": one(f"{prefix}.router.weight", spec.num_experts, h,
                                    fields=("num_local_experts", "hidden_size"))}
        shared = self.mlp_tensors(f"{prefix}.shared_expert", spec.shared_expert_ffn, h, "intermediate_size")
        out.update({f"shared_expert.mlp.{k}": v for k, v in shared.items()})
        return out

    def expert_sources(self, spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
        """The fused tensors (every expert of the layer) an expert is read from, for the checks of `load_spec`;
        `expert_weights` reads them."""
        h, f, n = spec.hidden_size, spec.expert_ffn, spec.num_experts
        prefix = f"model.layers.{layer}.{self.moe_block}.experts"
        fields = ("num_local_experts", "hidden_size", "intermediate_size")
        return (Source(((f"{prefix}.gate_up_proj", (n, h, 2 * f)),), fields),
                Source(((f"{prefix}.down_proj", (n, f, h)),), fields))

    def expert_weights(self, reader: Any, spec: ModelSpec, layer: int, expert: int) -> dict[str, Any]:
        """Expert `expert`'s entry of the fused [in, out] tensors, transposed to the serving layout (`w1`: the gate
        rows, then the up rows)."""
        prefix = f"model.layers.{layer}.{self.moe_block}.experts"
        gate_up = reader.rows(f"{prefix}.gate_up_proj", expert, expert + 1)[0]
        down = reader.rows(f"{prefix}.down_proj", expert, expert + 1)[0]
        return {"w1": gate_up.t(), "w2": down.t()}


class Llama4Vision(Llama4):
    name = "Llama4ForConditionalGeneration"
    summary = ("the Llama 4 releases: the text model (`text_config`, tensors under `language_model.`) served on text "
               "prompts; the vision model is not read")
    tensor_prefixes = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        flat, names = super().flatten_config(path, text_config(path, raw))
        return flat, {**{k: f"text_config.{k}" for k in raw.get("text_config", {})}, **names}
