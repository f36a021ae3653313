"""Nemotron-H (`NemotronHForCausalLM`, NVIDIA's Nemotron 3 MoE models): a stack of single blocks under `backbone.`,
each a norm and one mixer, by `layers_block_type` (or the older `hybrid_override_pattern`: M, *, E, -):

- "linear_attention" (M): Mamba-2 (`serving.model.linear.mamba2`), its state in the state cache;
- "full_attention" (*): grouped-query attention without any rotary embedding;
- "moe" (E): routed experts without a gate projection (relu(up x)^2), DeepSeek-V3's grouped sigmoid routing with
  a correction bias (fp32 router), and a shared expert of the same kind;
- "mlp" (-): a dense MLP of that kind.

The engine's layer is a token mixer then an MLP, so the blocks pair up in order: a mixer block and the MLP block
after it form one layer; a mixer block followed by another mixer block is a layer without an MLP, an MLP block after
an MLP block a layer without a mixer (`ModelSpec.blocks` keeps each layer's block indices). The norms multiply by the
weight in fp32 and round once. Latent MoE projections (`moe_latent_size`) are refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import Architecture, ConfigFields, Source, checked_routing, one
from mbridge_epoverlap.serving.model.spec import GroupedRouting, Mamba2, ModelSpec

PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
MIXERS, MLPS = ("linear_attention", "full_attention"), ("moe", "mlp")
# names older configs give these fields (`NemotronHConfig.__post_init__` reads them so)
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
           "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias", "n_routed_experts":
           "num_local_experts", "layer_norm_epsilon": "rms_norm_eps"}
MAMBA_FIELDS = ("hidden_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel")


def pair_blocks(kinds: list[str]) -> list[tuple[int, int]]:
    """Each engine layer's (mixer block, MLP block), -1 where it has none: a mixer block takes the MLP block that
    follows it."""
    layers: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if kind in MIXERS:
            layers.append([i, -1])
        elif layers and layers[-1][0] >= 0 and layers[-1][1] < 0:
            layers[-1][1] = i
        else:
            layers.append([-1, i])
    return [(m, f) for m, f in layers]


class NemotronH(Architecture):
    name = "NemotronHForCausalLM"
    summary = ("hybrid blocks (`layers_block_type`): Mamba-2 with a state cache, attention without rope, relu^2 MoE "
               "with grouped sigmoid routing and a shared expert, relu^2 MLPs")
    # transformers' NemotronHConfig defaults (under the names `checkpoint` reads)
    defaults = {"num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "rope_theta": 10000.0, "eos_token_id": 2, "attention_bias": False,
                "sliding_window": None, "mlp_hidden_act": "relu2", "mlp_bias": False, "mamba_hidden_act": "silu",
                "use_bias": False, "use_conv_bias": True, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
                "time_step_limit": [0.0, math.inf], "ssm_state_size": 128, "mamba_num_heads": 128,
                "mamba_head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0, "norm_topk_prob": True, "moe_latent_size": None,
                "intermediate_size": 21504, "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688}
    required = ("hidden_size", "num_attention_heads", "vocab_size")
    quantizations = ()

    def flatten_config(self, path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        out, names = dict(raw), {}
        for old, new in _LEGACY.items():
            if old in raw and new not in raw:
                out[new] = out.pop(old)
                names[new] = old
        kinds = raw.get("layers_block_type")
        if kinds is None and isinstance(raw.get("hybrid_override_pattern"), str):
            pattern = raw["hybrid_override_pattern"]
            unknown = sorted(set(pattern) - set(PATTERN))
            if unknown:
                raise UsageError(f"{path}: field 'hybrid_override_pattern' has {unknown}; the engine serves "
                                 f"{', '.join(f'{k} ({v})' for k, v in PATTERN.items())}")
            kinds = [PATTERN[c] for c in pattern]
            names["layers_block_type"] = "hybrid_override_pattern"
        if not isinstance(kinds, list) or not kinds:
            raise UsageError(f"{path}: field 'layers_block_type' (or 'hybrid_override_pattern') is missing or empty; "
                             "it names each block's kind")
        out["layers_block_type"] = kinds
        out["num_hidden_layers"] = len(kinds)  # the blocks; `read_config` pairs them into the engine's layers
        limit = out.get("time_step_limit")
        if isinstance(limit, list):  # JSON has no infinity: transformers writes {"__float__": "Infinity"}
            out["time_step_limit"] = [math.inf if isinstance(v, dict) and v.get("__float__") == "Infinity" else v
                                      for v in limit]
        return out, names

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        kinds = cfg.get("layers_block_type")
        for i, kind in enumerate(kinds):
            if kind not in MIXERS + MLPS:
                raise UsageError(f"{cfg.path}: field {cfg.name('layers_block_type')!r} has {kind!r} for block {i}; "
                                 f"the engine serves {', '.join(repr(k) for k in MIXERS + MLPS)}")
        for name, only in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("moe_latent_size", None),
                           ("attention_bias", False), ("mlp_bias", False), ("sliding_window", None)):
            cfg.require(name, only, f"{name} {cfg.get(name)!r}")
        blocks = pair_blocks(kinds)
        ffn_kinds = [kinds[f] if f >= 0 else None for _, f in blocks]
        routing = checked_routing(cfg, GroupedRouting(
            n_group=cfg.positive_int("n_group"), topk_group=cfg.positive_int("topk_group"),
            routed_scaling_factor=cfg.positive_float("routed_scaling_factor")))
        has_mamba = "linear_attention" in kinds
        return {"num_layers": len(blocks), "blocks": tuple(blocks),
                "moe_layers": tuple(kind == "moe" for kind in ffn_kinds),
                "mamba_layers": tuple(m >= 0 and kinds[m] == "linear_attention" for m, _ in blocks),
                "expert_ffn": cfg.positive_int("moe_intermediate_size"),
                "dense_ffn": cfg.positive_int("intermediate_size") if "mlp" in kinds else 0,
                "shared_expert_ffn": cfg.positive_int("moe_shared_expert_intermediate_size"),
                "expert_activation": "relu2", "mlp_activation": "relu2", "rope": False,
                "norm_topk_prob": cfg.boolean("norm_topk_prob"), "grouped_routing": routing,
                "norm_round_after_weight": True, "mamba": self.mamba2(cfg) if has_mamba else None}

    @staticmethod
    def mamba2(cfg: ConfigFields) -> Mamba2:
        limit = cfg.get("time_step_limit")
        numbers = isinstance(limit, list | tuple) and len(limit) == 2 and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in limit)
        if not numbers or limit[0] > limit[1]:
            raise cfg.bad("time_step_limit", "[low, high] with low <= high")
        m = Mamba2(num_heads=cfg.positive_int("mamba_num_heads"), head_dim=cfg.positive_int("mamba_head_dim"),
                   state_size=cfg.positive_int("ssm_state_size"), n_groups=cfg.positive_int("n_groups"),
                   conv_kernel=cfg.positive_int("conv_kernel"), chunk_size=cfg.positive_int("chunk_size"),
                   conv_bias=cfg.boolean("use_conv_bias"), proj_bias=cfg.boolean("use_bias"),
                   time_step_limit=(float(limit[0]), float(limit[1])))
        if m.num_heads % m.n_groups:
            raise UsageError(f"{cfg.path}: field 'mamba_num_heads' ({m.num_heads}) is not a multiple of "
                             f"{cfg.name('n_groups')!r} ({m.n_groups})")
        return m

    # --- tensors ------------------------------------------------------------------------------------

    def attention_sources(self, spec: ModelSpec) -> dict[str, Source]:
        h = spec.hidden_size
        out = self.model_ends(spec, "backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight")
        for i, (mixer, ffn) in enumerate(spec.blocks):
            ours = f"layers.{i}"
            if mixer >= 0:
                block = f"backbone.layers.{mixer}"
                out[f"{ours}.input_norm.weight"] = one(f"{block}.norm.weight", h)
                tensors = (self.mamba_tensors(spec, f"{block}.mixer") if spec.is_mamba(i)
                           else self.attention_tensors(spec, f"{block}.mixer"))
                out.update({f"{ours}.attention.{k}": v for k, v in tensors.items()})
            if ffn >= 0:
                block = f"backbone.layers.{ffn}"
                out[f"{ours}.post_norm.weight"] = one(f"{block}.norm.weight", h)
                if spec.is_moe(i):
                    out.update({f"{ours}.{k}": v for k, v in self.moe_tensors(spec, f"{block}.mixer").items()})
                else:
                    out.update({f"{ours}.mlp.{k}": v for k, v in relu2_mlp(f"{block}.mixer", spec.dense_ffn, h,
                                                                          "intermediate_size").items()})
        return out

    @staticmethod
    def mamba_tensors(spec: ModelSpec, prefix: str) -> dict[str, Source]:
        m = spec.mamba
        assert m is not None
        h, f = spec.hidden_size, MAMBA_FIELDS
        projected = m.inner + m.conv_dim + m.num_heads
        out = {"in_proj.weight": one(f"{prefix}.in_proj.weight", projected, h, fields=f),
               "conv_weight": one(f"{prefix}.conv1d.weight", m.conv_dim, 1, m.conv_kernel, fields=f),
               "dt_bias": one(f"{prefix}.dt_bias", m.num_heads, fields=f),
               "A_log": one(f"{prefix}.A_log", m.num_heads, fields=f),
               "D": one(f"{prefix}.D", m.num_heads, fields=f),
               "norm.weight": one(f"{prefix}.norm.weight", m.inner, fields=f),
               "out_proj.weight": one(f"{prefix}.out_proj.weight", h, m.inner, fields=f)}
        if m.conv_bias:
            out["conv_bias"] = one(f"{prefix}.conv1d.bias", m.conv_dim, fields=f)
        if m.proj_bias:
            out["in_proj_bias"] = one(f"{prefix}.in_proj.bias", projected, fields=f)
            out["out_proj_bias"] = one(f"{prefix}.out_proj.bias", h, fields=f)
        return out

    def moe_tensors(self, spec: ModelSpec, prefix: str) -> dict[str, Source]:
        fields = ("n_routed_experts", "hidden_size")
        out = {"router.weight": one(f"{prefix}.gate.weight", spec.num_experts, spec.hidden_size, fields=fields),
               "router.e_score_correction_bias": one(f"{prefix}.gate.e_score_correction_bias", spec.num_experts,
                                                     fields=fields)}
        shared = relu2_mlp(f"{prefix}.shared_experts", spec.shared_expert_ffn, spec.hidden_size,
                           "moe_shared_expert_intermediate_size")
        out.update({f"shared_expert.mlp.{k}": v for k, v in shared.items()})
        return out

    def expert_sources(self, spec: ModelSpec, layer: int, expert: int) -> tuple[Source, Source]:
        """(up projection -> `w1[e]` [ffn, hidden], down projection -> `w2[e]` [hidden, ffn])."""
        h, f = spec.hidden_size, spec.expert_ffn
        prefix = f"backbone.layers.{spec.blocks[layer][1]}.mixer.experts.{expert}"
        fields = ("moe_intermediate_size", "hidden_size")
        return (one(f"{prefix}.up_proj.weight", f, h, fields=fields),
                one(f"{prefix}.down_proj.weight", h, f, fields=fields))


def relu2_mlp(prefix: str, ffn: int, hidden: int, field: str) -> dict[str, Source]:
    """An MLP without a gate projection (`up_proj`, `down_proj`) -> `layers.ReluSquaredMLP` (`up`, `down`)."""
    fields = (field, "hidden_size")
    return {"up.weight": one(f"{prefix}.up_proj.weight", ffn, hidden, fields=fields),
            "down.weight": one(f"{prefix}.down_proj.weight", hidden, ffn, fields=fields)}
