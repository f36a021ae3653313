"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`): DeepSeek-V3's latent attention and MoE
layers (`deepseek_v3`) with DeepSeek Sparse Attention, a lightning indexer per layer (`latent.indexer`: `index_n_heads`
queries of `index_head_dim` from the query bottleneck, one key per token cached beside the latent) choosing the
`index_topk` tokens each query attends to.

- The query bottleneck is always there (`q_lora_rank`, as `transformers`' attention for these models builds it).
- DeepSeek-V3.2's indexer turns its rotary dimensions as two halves; GLM-5's in interleaved pairs.
- GLM-5's `indexer_types` (or the `index_topk_pattern` string of F and S, or `index_topk_freq` /
  `index_skip_topk_offset`) let a "shared" layer reuse the choice of the indexed layer before it: no indexer and
  no indexer keys there.
- `mlp_layer_types` ("dense" / "sparse" per layer), where given, says which layers are MoE; else
  `first_k_dense_replace`.

Refused before any weight is read: a null `q_lora_rank`, an `index_topk`, `index_n_heads` or `index_head_dim` that is
not a positive integer, an `index_head_dim` narrower than `qk_rope_head_dim`, a `layer_types` entry other than
"indexed_attention", an `indexer_types` entry other than "full" / "shared" or a first layer that shares, and an
`mlp_layer_types` entry other than "dense" / "sparse".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mbridge_epoverlap.serving.model.architectures.base import ConfigFields, Source, one
from mbridge_epoverlap.serving.model.architectures.deepseek.deepseek_v3 import DeepseekV3
from mbridge_epoverlap.serving.model.spec import ModelSpec, SparseIndexer

_INDEX_FIELDS = ("hidden_size", "q_lora_rank", "index_n_heads", "index_head_dim")


class DeepseekV32(DeepseekV3):
    name = "DeepseekV32ForCausalLM"
    summary = ("DeepSeek-V3's latent attention and MoE layers with DeepSeek Sparse Attention: a lightning indexer "
               "per layer (its keys cached beside the latents) choosing the `index_topk` tokens each query reads")
    # transformers' DeepseekV32Config defaults beyond DeepSeek-V3's
    defaults = {**DeepseekV3.defaults, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
                "max_position_embeddings": 163840, "layer_types": None, "mlp_layer_types": None}
    index_rope_interleave = False  # the indexer's rotary dimensions turn as two halves

    def read_config(self, cfg: ConfigFields, num_layers: int) -> dict[str, Any]:
        if cfg.get("q_lora_rank") is None:
            raise cfg.bad("q_lora_rank", "a positive integer (the indexer reads the query bottleneck)")
        types = cfg.get("layer_types")
        if types is not None and (not isinstance(types, list) or len(types) != num_layers
                                  or any(t != "indexed_attention" for t in types)):
            raise cfg.bad("layer_types", f"a list of {num_layers} entries, each 'indexed_attention'")
        fields = super().read_config(cfg, num_layers)
        rope = cfg.positive_int("qk_rope_head_dim")
        head_dim = cfg.positive_int("index_head_dim")
        if head_dim < rope:
            raise cfg.bad("index_head_dim", f"at least 'qk_rope_head_dim' ({rope}): the indexer turns that many "
                                            "of its dimensions")
        indexer = SparseIndexer(num_heads=cfg.positive_int("index_n_heads"), head_dim=head_dim,
                                topk=cfg.positive_int("index_topk"), rope_interleave=self.index_rope_interleave,
                                shared_layers=self.shared_layers(cfg, num_layers))
        fields["mla"] = replace(fields["mla"], indexer=indexer)
        moe_layers = self._moe_layers(cfg, num_layers)
        if moe_layers is not None:
            fields["moe_layers"] = moe_layers
            fields["dense_ffn"] = cfg.positive_int("intermediate_size") if not all(moe_layers) else 0
        return fields

    def shared_layers(self, cfg: ConfigFields, num_layers: int) -> tuple[int, ...]:
        """The layers that reuse the selection before them: none in DeepSeek-V3.2."""
        return ()

    @staticmethod
    def _moe_layers(cfg: ConfigFields, num_layers: int) -> tuple[bool, ...] | None:
        kinds = cfg.get("mlp_layer_types")
        if kinds is None:
            return None
        if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
            raise cfg.bad("mlp_layer_types", f"a list of {num_layers} entries, each 'dense' or 'sparse'")
        return tuple(k == "sparse" for k in kinds)

    # --- tensors ------------------------------------------------------------------------------------

    def mixer_tensors(self, spec: ModelSpec, layer: int, prefix: str) -> dict[str, Source]:
        out = super().mixer_tensors(spec, layer, prefix)
        assert spec.mla is not None and spec.mla.indexer is not None and spec.mla.q_lora_rank is not None
        ix = spec.mla.indexer
        if layer in ix.shared_layers:
            return out
        at, h, f = f"{prefix}.self_attn.indexer", spec.hidden_size, _INDEX_FIELDS
        out.update({"indexer.wq_b.weight": one(f"{at}.wq_b.weight", ix.num_heads * ix.head_dim, spec.mla.q_lora_rank,
                                               fields=f),
                    "indexer.wk.weight": one(f"{at}.wk.weight", ix.head_dim, h, fields=f),
                    "indexer.k_norm.weight": one(f"{at}.k_norm.weight", ix.head_dim, fields=f),
                    "indexer.k_norm.bias": one(f"{at}.k_norm.bias", ix.head_dim, fields=f),
                    "indexer.weights_proj.weight": one(f"{at}.weights_proj.weight", ix.num_heads, h, fields=f)})
        return out


class GlmMoeDsa(DeepseekV32):
    name = "GlmMoeDsaForCausalLM"
    summary = ("GLM-5: DeepSeek-V3.2's sparse latent attention with an interleaved-rotary indexer, and layers that "
               "reuse the indexed layer's choice before them (`indexer_types`)")
    # transformers' GlmMoeDsaConfig defaults beyond DeepSeek-V3.2's
    defaults = {**DeepseekV32.defaults, "rms_norm_eps": 1e-5, "n_group": 1, "topk_group": 1, "index_n_heads": 32,
                "q_lora_rank": 2048, "qk_nope_head_dim": 192, "v_head_dim": 256, "max_position_embeddings": 202752,
                "indexer_types": None}
    index_rope_interleave = True

    def shared_layers(self, cfg: ConfigFields, num_layers: int) -> tuple[int, ...]:
        """`indexer_types`, else the F/S `index_topk_pattern`, else every `index_topk_freq`-th layer from
        `index_skip_topk_offset` indexed (transformers' rule; by default every layer)."""
        kinds, field = cfg.get("indexer_types"), "indexer_types"
        if kinds is None and cfg.get("index_topk_pattern") is not None:
            pattern, field = cfg.get("index_topk_pattern"), "index_topk_pattern"
            letters = {"F": "full", "S": "shared"}
            kinds = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
        if kinds is None:
            freq, offset = cfg.get("index_topk_freq") or 1, cfg.get("index_skip_topk_offset")
            offset = 2 if offset is None else offset
            if isinstance(freq, bool) or not isinstance(freq, int) or isinstance(offset, bool) or not isinstance(
                    offset, int):
                raise cfg.bad("index_topk_freq", "an integer, with 'index_skip_topk_offset' an integer")
            kinds = ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(num_layers)]
        if (not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("full", "shared") for k in kinds)
                or kinds[0] != "full"):
            raise cfg.bad(field, f"{num_layers} layer kinds, each 'full' or 'shared' (F or S), the first 'full' (a "
                                 "shared layer reuses the selection of an indexed layer before it)")
        return tuple(i for i, kind in enumerate(kinds) if kind == "shared")

