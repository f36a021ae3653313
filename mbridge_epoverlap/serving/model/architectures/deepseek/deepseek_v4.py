"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): compressed attention over a sliding window (`serving.model.compressed`),
hyper-connections between `hc_mult` residual streams, and MoE layers (every layer) with a clamped SwiGLU, a shared
expert, sqrtsoftplus or sigmoid scores with a correction bias, and the first layers hash-routed (`tid2eid`).

Tensors are read under the names `transformers` saves (DeepSeek's own: `attn.wq_a`, `attn.compressor.ape`,
`ffn.experts.{e}.w1` / `w3` / `w2`, `hc_attn_fn`, ...).

The older fields of released config.json files (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, a flat
YaRN `rope_scaling` for the compress rope) are read as `transformers` folds them in (`v4_config`).

Refused before any weight is read: more than one key/value head, a `sliding_window` under 2, a `layer_types` or
`mlp_layer_types` entry outside V4's, a compress rate that is not a positive integer, a `scoring_func` other than
"sqrtsoftplus" or "sigmoid", a rope other than the default or YaRN (or YaRN's `mscale` pair without an
`attention_factor`) on either rope type, or with another `partial_rotary_factor`, an odd or too wide rotary part,
heads that do not split into `o_groups`, an `index_head_dim` narrower than the rotary part, `n_shared_experts`
other than 1, MLP biases, and a quantized checkpoint (the released FP8 / FP4 weights included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, cat, one
from mbridge_epoverlap.serving.model.architectures.deepseek import v4_config
from mbridge_epoverlap.serving.model.spec import CompressedAttention, ModelSpec

_TYPES = ("sliding_attention", v4_config.CSA, v4_config.HCA)
_F = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank")


class DeepseekV4(Architecture):
    name = "DeepseekV4ForCausalLM"
    summary = ("compressed sparse / heavily compressed attention over a sliding window of one shared key-value head "
               "(pooled entries and a lightning indexer), attention sinks, grouped output projection; "
               "hyper-connections; clamped SwiGLU experts, sqrtsoftplus routing, hash-routed first layers")
    # transformers' DeepseekV4Config defaults (`n_routed_experts` read as `num_local_experts`)
    defaults = {"num_key_value_heads": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                "rope_theta": 10000.0, "eos_token_id": 1, "num_local_experts": 256, "num_experts_per_tok": 6,
                "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
                "moe_intermediate_size": 2048, "head_dim": 512, "q_lora_rank": 1024, "compress_rope_theta": 160000.0,
                "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128,
                "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
                "mlp_bias": False, "max_position_embeddings": 1048576}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    rope_types = ("default", "yarn")
    quantizations = ()

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """`n_routed_experts` as `num_local_experts`; the older fields folded in and the two ropes apart
        (`v4_config.complete`: the main rope's parameters as `rope_parameters`, where the shared reader takes the
        rotary base from)."""
        flat, names = v4_config.complete(path, raw, self.defaults)
        if "n_routed_experts" in flat:
            flat["num_local_experts"] = flat.pop("n_routed_experts")
            names["num_local_experts"] = "n_routed_experts"
        return flat, names

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        if cfg.positive_int("num_key_value_heads") != 1:
            raise cfg.bad("num_key_value_heads", "1 (one key head, which is also the value)")
        cfg.require("mlp_bias", False, "a bias on the shared expert")  # `attention_bias`: unread by transformers
        cfg.require("n_shared_experts", 1, "another number of shared experts")
        window = cfg.positive_int("sliding_window")
        if window < 2:
            raise cfg.bad("sliding_window", "at least 2")
        rates, indexed = self._layer_rates(cfg, num_layers)
        kinds = cfg.get("mlp_layer_types")
        if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("hash_moe", "moe") for k in kinds):
            raise cfg.bad("mlp_layer_types", f"a list of {num_layers} entries, each 'hash_moe' or 'moe'")
        scoring = cfg.get("scoring_func")
        if scoring not in ("sqrtsoftplus", "sigmoid"):
            raise cfg.bad("scoring_func", "'sqrtsoftplus' or 'sigmoid'")
        heads, head_dim = cfg.positive_int("num_attention_heads"), cfg.positive_int("head_dim")
        rope_dim = self._rope_dim(cfg, head_dim)
        groups = cfg.positive_int("o_groups")
        if heads % groups:
            raise cfg.bad("o_groups", f"a divisor of 'num_attention_heads' ({heads})")
        index_dim = cfg.positive_int("index_head_dim")
        if any(indexed) and index_dim < rope_dim:
            raise cfg.bad("index_head_dim", f"at least the rotary part ({rope_dim})")
        compressed = CompressedAttention(
            q_lora_rank=cfg.positive_int("q_lora_rank"), o_groups=groups, o_lora_rank=cfg.positive_int("o_lora_rank"),
            rope_dim=rope_dim, rope_theta=self._theta(cfg, "rope_parameters", "rope_theta"),
            compress_rope_theta=self._theta(cfg, "compress_rope", "compress_rope_theta"), sliding_window=window,
            rope_scaling=v4_config.yarn_of(cfg, "rope_parameters"),
            compress_rope_scaling=v4_config.yarn_of(cfg, "compress_rope"),
            layer_rates=rates, indexed=indexed, index_heads=cfg.positive_int("index_n_heads"),
            index_head_dim=index_dim, index_topk=cfg.positive_int("index_topk"), hc_mult=cfg.positive_int("hc_mult"),
            hc_sinkhorn_iters=cfg.positive_int("hc_sinkhorn_iters"), hc_eps=cfg.positive_float("hc_eps"),
            hash_layers=tuple(i for i, k in enumerate(kinds) if k == "hash_moe"), scoring=scoring,
            routed_scaling_factor=cfg.positive_float("routed_scaling_factor"))
        ffn = cfg.positive_int("moe_intermediate_size")
        return {"moe_layers": (True,) * num_layers, "expert_ffn": ffn, "shared_expert_ffn": ffn,
                "attention_sinks": True, "expert_activation": "limited_swiglu",
                "swiglu_limit": cfg.positive_float("swiglu_limit"), "sliding_window": window,
                "compressed": compressed}

    @staticmethod
    def _layer_rates(cfg: ConfigFields, num_layers: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        """Per layer its compress rate (0: sliding window alone) and whether it has the indexer (CSA)."""
        types, rates = cfg.get("layer_types"), cfg.get("compress_rates")
        if not isinstance(types, list) or len(types) != num_layers or any(t not in _TYPES for t in types):
            raise cfg.bad("layer_types", f"a list of {num_layers} entries, each one of {', '.join(_TYPES)}")
        if not isinstance(rates, dict):
            raise cfg.bad("compress_rates", "an object of a rate per attention type")
        rates = {**v4_config.DEFAULT_RATES, **rates}
        for kind in ("compressed_sparse_attention", "heavily_compressed_attention"):
            rate = rates[kind]
            if kind in types and (isinstance(rate, bool) or not isinstance(rate, int) or rate < 1):
                raise UsageError(f"{cfg.path}: field 'compress_rates.{kind}' is {rate!r}; it must be a positive "
                                 "integer")
        return (tuple(0 if t == "sliding_attention" else rates[t] for t in types),
                tuple(t == "compressed_sparse_attention" for t in types))

    @staticmethod
    def _rope_dim(cfg: ConfigFields, head_dim: int) -> int:
        factor = cfg.get("partial_rotary_factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise cfg.bad("partial_rotary_factor", "a number in (0, 1]")
        dim = int(head_dim * factor)
        if dim < 2 or dim % 2:
            raise cfg.bad("partial_rotary_factor", f"a fraction of 'head_dim' ({head_dim}) giving an even rotary part")
        for key in ("rope_parameters", "compress_rope"):
            params = cfg.get(key) or {}
            if not isinstance(params, dict):
                raise cfg.bad(key, "an object")
            if cfg.name(key).startswith("rope_parameters.") and "partial_rotary_factor" not in params:
                raise UsageError(f"{cfg.path}: field '{cfg.name(key)}' has no 'partial_rotary_factor'; "
                                 "`transformers` would turn the whole head there, which is not supported")
            if params.get("partial_rotary_factor", factor) != factor:
                raise UsageError(f"{cfg.path}: field '{cfg.name(key)}.partial_rotary_factor' is "
                                 f"{params['partial_rotary_factor']!r}; only 'partial_rotary_factor' ({factor!r}) "
                                 "is supported")
        return dim

    @staticmethod
    def _theta(cfg: ConfigFields, key: str, field: str) -> float:
        params = cfg.get(key)
        if isinstance(params, dict) and "rope_theta" in params:
            return ConfigFields(cfg.path, {f"{cfg.name(key)}.rope_theta": params["rope_theta"]}).positive_float(
                f"{cfg.name(key)}.rope_theta")
        return cfg.positive_float(field)

    # --- tensors ------------------------------------------------------------------------------------

    def attention_sources(self, spec: ModelSpec) -> dict[str, Source]:
        c = spec.compressed
        if c is None:
            raise ValueError(f"{spec.source}: a DeepSeek-V4 spec needs its compressed attention")
        h, n = spec.hidden_size, c.hc_mult
        out = {**self.model_ends(spec, "model.embed_tokens.weight", "model.norm.weight", "head.weight"),
               "hc_head.fn": one("model.hc_head.hc_fn", n, n * h, fields=("hc_mult", "hidden_size")),
               "hc_head.base": one("model.hc_head.hc_base", n, fields=("hc_mult",)),
               "hc_head.scale": one("model.hc_head.hc_scale", 1, fields=("hc_mult",))}
        for i in range(spec.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            out[f"{ours}.input_norm.weight"] = one(f"{hf}.attn_norm.weight", h)
            out[f"{ours}.post_norm.weight"] = one(f"{hf}.ffn_norm.weight", h)
            for block in ("attn", "ffn"):
                width, fields = (2 + n) * n, ("hc_mult", "hidden_size")
                out[f"{ours}.{block}_hc.fn"] = one(f"{hf}.hc_{block}_fn", width, n * h, fields=fields)
                out[f"{ours}.{block}_hc.base"] = one(f"{hf}.hc_{block}_base", width, fields=fields)
                out[f"{ours}.{block}_hc.scale"] = one(f"{hf}.hc_{block}_scale", 3, fields=fields)
            out.update({f"{ours}.attention.{k}": v for k, v in self._attention(spec, i, f"{hf}.attn").items()})
            out.update({f"{ours}.{k}": v for k, v in self._moe(spec, i, f"{hf}.ffn").items()})
        return out

    @staticmethod
    def _attention(spec: ModelSpec, layer: int, at: str) -> dict[str, Source]:
        c = spec.compressed
        assert c is not None
        h, heads, d = spec.hidden_size, spec.num_heads, spec.head_dim
        out = {"q_a_proj.weight": one(f"{at}.wq_a.weight", c.q_lora_rank, h, fields=_F),
               "q_a_norm.weight": one(f"{at}.q_norm.weight", c.q_lora_rank, fields=_F),
               "q_b_proj.weight": one(f"{at}.wq_b.weight", heads * d, c.q_lora_rank, fields=_F),
               "kv_proj.weight": one(f"{at}.wkv.weight", d, h, fields=_F),
               "kv_norm.weight": one(f"{at}.norm.weight", d, fields=_F),
               "o_a_proj": one(f"{at}.wo_a.weight", c.o_groups * c.o_lora_rank, heads * d // c.o_groups,
                               fields=(*_F, "o_groups", "o_lora_rank")),
               "o_b_proj.weight": one(f"{at}.wo_b.weight", h, c.o_groups * c.o_lora_rank,
                                      fields=("hidden_size", "o_groups", "o_lora_rank")),
               "sinks": one(f"{at}.attn_sink", heads, fields=("num_attention_heads",))}
        rate = c.layer_rates[layer]
        if rate:
            width = 2 * d if c.indexed[layer] else d
            out.update(_pool("compressor", f"{at}.compressor", h, d, width, rate))
        if rate and c.indexed[layer]:
            di, hi = c.index_head_dim, c.index_heads
            out.update(_pool("indexer", f"{at}.indexer.compressor", h, di, 2 * di, rate))
            fields = ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim")
            out["indexer.q_b_proj.weight"] = one(f"{at}.indexer.wq_b.weight", hi * di, c.q_lora_rank, fields=fields)
            out["indexer.weights_proj.weight"] = one(f"{at}.indexer.weights_proj.weight", hi, h, fields=fields)
        return out

    @staticmethod
    def _moe(spec: ModelSpec, layer: int, at: str) -> dict[str, Source]:
        c = spec.compressed
        assert c is not None
        h, f, e = spec.hidden_size, spec.shared_expert_ffn, spec.num_experts
        fields = ("moe_intermediate_size", "hidden_size")
        out = {"router.weight": one(f"{at}.gate.weight", e, h, fields=("num_local_experts", "hidden_size")),
               "shared_expert.gate_proj.weight": one(f"{at}.shared_experts.w1.weight", f, h, fields=fields),
               "shared_expert.up_proj.weight": one(f"{at}.shared_experts.w3.weight", f, h, fields=fields),
               "shared_expert.down_proj.weight": one(f"{at}.shared_experts.w2.weight", h, f, fields=fields)}
        if layer in c.hash_layers:
            out["router.tid2eid"] = one(f"{at}.gate.tid2eid", spec.vocab_size, spec.top_k,
                                        fields=("vocab_size", "num_experts_per_tok"))
        else:
            out["router.bias"] = one(f"{at}.gate.bias", e, fields=("num_local_experts",))
        return out

    def expert_sources(self, spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
        h, f = spec.hidden_size, spec.expert_ffn
        prefix = f"model.layers.{layer}.ffn.experts.{expert}"
        fields = ("moe_intermediate_size", "hidden_size")
        return (cat((f"{prefix}.w1.weight", (f, h)), (f"{prefix}.w3.weight", (f, h)), fields=fields),
                one(f"{prefix}.w2.weight", h, f, fields=fields))


def _pool(ours: str, at: str, hidden: int, head_dim: int, width: int, rate: int) -> dict[str, Source]:
    """A compressor's tensors (`wkv`, `wgate`, `ape`, `norm`) as `Pool`'s parameters under `ours`."""
    fields = ("hidden_size", "head_dim", "index_head_dim", "compress_rates")
    return {f"{ours}.kv_proj.weight": one(f"{at}.wkv.weight", width, hidden, fields=fields),
            f"{ours}.gate_proj.weight": one(f"{at}.wgate.weight", width, hidden, fields=fields),
            f"{ours}.position_bias": one(f"{at}.ape", rate, width, fields=fields),
            f"{ours}.kv_norm.weight": one(f"{at}.norm.weight", head_dim, fields=fields)}
