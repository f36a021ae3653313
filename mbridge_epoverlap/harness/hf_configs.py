"""Hugging Face `config.json` of each model the harness maps to a Megatron-Bridge recipe, in an offline cache.

Megatron-Bridge's recipes build their model with `AutoBridge.from_hf_pretrained(MODEL_ID)`, which reads the
model's `config.json` from the Hugging Face hub. `--check_with_bridge`, its tests and the recipe-facts
generator (`scripts/extract_bridge_recipe_facts.py`) run without the network: they write that file into a
private hub cache (`write_hf_cache`) from the project's recipe, which carries the model's public dimensions.
The few public constants a project recipe does not carry (DeepSeek-V3's latent-attention ranks and rope
scaling, Qwen3's rope base) are written as the released `config.json` has them.

The models whose project recipe is Megatron-Bridge's own (`recipes.bridge_models`: GPT-OSS, Kimi K2, DeepSeek-V4,
Qwen3-Next, Nemotron 3, the Qwen VL MoEs, GLM-5) have their released `config.json` values as data,
`data/hf_configs/<org>--<name>.json` (its `_source` says where each came from; it is not written to the cache),
with, for a model whose config class is remote code, a configuration module of the project's own beside it
(`data/hf_configs/<org>--<name>/*.py`, written into the snapshot as the hub repository holds its code).

`HF_MODELS` maps each project recipe with an upstream recipe to its model ids and writer; the families
without one (Mixtral, DBRX: Megatron-Bridge 0.6.2 has no recipe for them) are not in it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def qwen3_moe_hf_config(model: Any) -> dict[str, Any]:
    """A `qwen3_moe` config.json from a project recipe's model (the public dimensions it carries)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
            "head_dim": model.kv_channels, "hidden_act": "silu", "hidden_size": model.hidden_size,
            "initializer_range": 0.02, "intermediate_size": model.ffn_hidden_size, "max_position_embeddings": 40960,
            "max_window_layers": model.num_layers, "mlp_only_layers": [], "moe_intermediate_size":
            model.moe_ffn_hidden_size, "norm_topk_prob": True, "num_attention_heads": model.num_attention_heads,
            "num_experts": model.num_moe_experts, "num_experts_per_tok": model.moe_router_topk,
            "num_hidden_layers": model.num_layers, "num_key_value_heads": model.num_query_groups,
            "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
            "vocab_size": model.vocab_size}


def deepseek_v3_hf_config(model: Any) -> dict[str, Any]:
    """A `deepseek_v3` config.json from a project recipe's model.

    Layers, widths, heads, experts, the shared expert (its width over the expert width), the leading dense
    layers (`moe_layer_freq`) and the MTP depth come from the recipe; the latent-attention ranks, rope
    dimensions and scaling and the router's grouping are DeepSeek-V3's released values.
    """
    freq = model.moe_layer_freq
    dense = next((i for i, moe in enumerate(freq) if moe), len(freq)) if isinstance(freq, list) else 0
    shared = model.moe_shared_expert_intermediate_size or 0
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": dense,
            "hidden_act": "silu", "hidden_size": model.hidden_size, "initializer_range": 0.02,
            "intermediate_size": model.ffn_hidden_size, "kv_lora_rank": 512, "max_position_embeddings": 163840,
            "moe_intermediate_size": model.moe_ffn_hidden_size, "moe_layer_freq": 1, "n_group": 8,
            "n_routed_experts": model.num_moe_experts, "n_shared_experts": shared // model.moe_ffn_hidden_size,
            "norm_topk_prob": True, "num_attention_heads": model.num_attention_heads,
            "num_experts_per_tok": model.moe_router_topk, "num_hidden_layers": model.num_layers,
            "num_key_value_heads": model.num_attention_heads, "num_nextn_predict_layers": model.mtp_num_layers or 0,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": model.moe_router_score_function,
            "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "use_cache": True, "v_head_dim": model.kv_channels, "vocab_size": model.vocab_size}


HF_CONFIG_DATA = Path(__file__).resolve().parent / "data" / "hf_configs"


def _slug(model_id: str) -> str:
    """A hub id as the hub cache and this data name their folders (`org/name` -> `org--name`)."""
    return model_id.replace("/", "--")


def released_config(model_id: str) -> dict[str, Any]:
    """The released `config.json` of a model kept as data (without its `_source` note)."""
    path = HF_CONFIG_DATA / f"{_slug(model_id)}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    return {key: value for key, value in data.items() if key != "_source"}


def remote_code_files(model_id: str) -> dict[str, str]:
    """File name -> text of the configuration code kept beside a model's config (remote-code models only)."""
    folder = HF_CONFIG_DATA / _slug(model_id)
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(folder.glob("*.py"))}


# Project recipe -> (Hugging Face model id its Megatron-Bridge recipes load, or None; config.json writer from the
# project recipe's model, or None where the config is the released one kept as data).
HF_MODELS: dict[str, tuple[str | None, Callable[[Any], dict[str, Any]] | None]] = {
    "qwen3_30b_a3b": ("Qwen/Qwen3-30B-A3B", qwen3_moe_hf_config),
    "qwen3_235b_a22b": ("Qwen/Qwen3-235B-A22B", qwen3_moe_hf_config),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", deepseek_v3_hf_config),
}
# Recipes of the Bridge workloads -> the models they load (a workload's recipes may load more than one).
RELEASED_MODELS: dict[str, tuple[str, ...]] = {
    "gpt_oss_20b": ("openai/gpt-oss-20b",),
    "gpt_oss_120b": ("openai/gpt-oss-120b",),
    "kimi_k2": ("moonshotai/Kimi-K2-Instruct",),
    "deepseek_v4_flash": ("deepseek-ai/DeepSeek-V4-Flash",),
    "deepseek_v4_pro": ("deepseek-ai/DeepSeek-V4-Pro",),
    "qwen3_next_80b_a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct",),
    "nemotron_3_nano": ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",),
    "nemotron_3_super": ("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",),
    "nemotron_3_ultra": ("nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16",),
    # its library recipes start from Nano's model
    "nemotron_3_5_lightning": ("nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16",
                               "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"),
    "nemotronh_56b": (),  # its recipes build the model from Megatron-Bridge's own provider, no config.json
    "qwen3_vl_30b_a3b": ("Qwen/Qwen3-VL-30B-A3B-Instruct",),
    "qwen3_vl_235b_a22b": ("Qwen/Qwen3-VL-235B-A22B-Instruct",),
    "qwen35_vl_35b_a3b": ("Qwen/Qwen3.5-35B-A3B",),
    "qwen35_vl_122b_a10b": ("Qwen/Qwen3.5-122B-A10B",),
    "qwen35_vl_397b_a17b": ("Qwen/Qwen3.5-397B-A17B",),
    "glm51": ("zai-org/GLM-5.1",),
    "glm52": ("zai-org/GLM-5.2",),
}
HF_MODELS.update({name: (ids[0] if ids else None, None) for name, ids in RELEASED_MODELS.items()})


def model_ids(recipe: str) -> tuple[str, ...]:
    """The Hugging Face model ids a project recipe's Megatron-Bridge recipes load (none for a recipe Bridge has not,
    or whose recipes build the model from Bridge's own provider)."""
    if recipe in RELEASED_MODELS:
        return RELEASED_MODELS[recipe]
    return (HF_MODELS[recipe][0],) if recipe in HF_MODELS else ()


def hf_models(recipe: str, model: Any = None) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """Every (model id, config.json, remote-code files) a project recipe's Megatron-Bridge recipes load. The
    hand-written recipes' configs are written from their model (`model`, by default the project recipe's); the
    others are the released values kept as data."""
    if recipe in RELEASED_MODELS:
        return [(model_id, released_config(model_id), remote_code_files(model_id)) for model_id in model_ids(recipe)]
    if recipe not in HF_MODELS:
        return []
    if model is None:
        from mbridge_epoverlap.recipes.loader import load_recipe

        model = load_recipe(recipe).model
    model_id, writer = HF_MODELS[recipe]
    return [(model_id, writer(model), {})] if model_id and writer else []


def write_hf_cache(home: Path, model_id: str, config: dict[str, Any], revisions: set[str],
                   code: dict[str, str] | None = None) -> None:
    """An offline Hugging Face hub cache under `home` holding only `config.json` of `model_id` (and its configuration
    code, for a remote-code model), at `main` and at each pinned revision (recipes pin one)."""
    repo = home / "hub" / f"models--{_slug(model_id)}"
    main = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(main)
    for revision in {main} | revisions:
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))
        for name, text in (code or {}).items():
            (snapshot / name).write_text(text)


def pinned_revisions(model_id: str) -> set[str]:
    """The revisions of `model_id` that the imported Megatron-Bridge library and performance recipes pin
    (`*_MODEL_REVISION` next to a `*_MODEL_ID` naming it)."""
    found = set()
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(("megatron.bridge.recipes", "megatron.bridge.perf_recipes")):
            continue
        for name, value in list(vars(module).items()):
            if name.endswith("_MODEL_ID") and value == model_id:
                revision = getattr(module, name.removesuffix("_MODEL_ID") + "_MODEL_REVISION", None)
                if isinstance(revision, str):
                    found.add(revision)
    return found


def offline() -> bool:
    """Whether the Hugging Face libraries are told to stay offline here (`HF_HUB_OFFLINE` / `TRANSFORMERS_OFFLINE`)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache() -> Path:
    """The Hugging Face hub cache the libraries read (`HF_HUB_CACHE`, else `HF_HOME`/hub, else ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def missing_offline_configs(recipe: str) -> list[str]:
    """The model ids a recipe's Megatron-Bridge recipes load whose `config.json` is in no snapshot of the hub cache
    (what an offline job would retry for and then fail on)."""
    cache = hub_cache()
    return [model_id for model_id in model_ids(recipe)
            if not any((cache / f"models--{_slug(model_id)}" / "snapshots").glob("*/config.json"))]
