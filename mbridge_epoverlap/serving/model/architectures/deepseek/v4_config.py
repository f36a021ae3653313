"""DeepSeek-V4's config.json as `transformers`' `DeepseekV4Config.__post_init__` completes it.

Released checkpoints state their layers the older way: per layer `compress_ratios` (0: sliding window, 4: compressed
sparse, 128: heavily compressed attention, one entry past the layers for the multi-token-prediction layer),
`compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`, and one flat rope (`rope_scaling`
or `rope_parameters`) that is the compress rope's (the main rope being the default one at `rope_theta`).
`complete` folds them into `layer_types`, `compress_rates`, `mlp_layer_types`, `partial_rotary_factor` and the two
ropes (`rope_parameters`: the main one, `compress_rope`), each named in messages by the field it came from.
`yarn_of` reads a rope's YaRN parameters as `transformers` computes them for V4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.model.architectures.base import ConfigFields
from mbridge_epoverlap.serving.model.spec import RopeScaling

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TYPES = {0: "sliding_attention", 4: CSA, 128: HCA}
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
DEFAULT_ROTARY_FACTOR = 64 / 512


def complete(path: Path, raw: dict[str, Any], defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the fields with the older ones folded in, field -> the name it has in the file where it came from another)."""
    flat, names = dict(raw), {}
    n = raw.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return flat, names  # the shared reader refuses it
    rates = flat.get("compress_rates")
    if rates is None or isinstance(rates, dict):
        rates = {**DEFAULT_RATES, **(rates or {})}
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if flat.get(legacy) is not None:
                rates[kind] = flat[legacy]
        flat["compress_rates"] = rates
    if flat.get("layer_types") is None and flat.get("compress_ratios") is not None:
        ratios = flat["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in _RATIO_TYPES for r in ratios):
            raise UsageError(f"{path}: field 'compress_ratios' is {ratios!r}; it must be a list of 0, 4 and 128")
        flat["layer_types"], names["layer_types"] = [_RATIO_TYPES[r] for r in ratios], "compress_ratios"
    if flat.get("layer_types") is None:
        flat["layer_types"] = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if flat.get("mlp_layer_types") is None:
        hashed = flat.get("num_hash_layers", DEFAULT_HASH_LAYERS)
        if isinstance(hashed, bool) or not isinstance(hashed, int) or hashed < 0:
            raise UsageError(f"{path}: field 'num_hash_layers' is {hashed!r}; it must be a non-negative integer")
        flat["mlp_layer_types"] = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        names["mlp_layer_types"] = "num_hash_layers" if "num_hash_layers" in flat else "mlp_layer_types"
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(flat[key], list):
            flat[key] = flat[key][:n]
    if flat.get("partial_rotary_factor") is None:
        rope_dim, head_dim = flat.get("qk_rope_head_dim"), flat.get("head_dim", defaults["head_dim"])
        flat["partial_rotary_factor"] = (DEFAULT_ROTARY_FACTOR if rope_dim is None or not head_dim
                                         else rope_dim / head_dim)
        if rope_dim is not None:
            names["partial_rotary_factor"] = "qk_rope_head_dim"
    _ropes(path, flat, names)
    return flat, names


def _ropes(path: Path, flat: dict[str, Any], names: dict[str, str]) -> None:
    """The main rope as `rope_parameters`, the compress rope as `compress_rope`, from the nested `rope_parameters`
    (`main`, `compress`) `transformers` saves, or from a flat one (or `rope_scaling`) that is the compress rope's."""
    rope = flat.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        flat["rope_parameters"], flat["compress_rope"] = rope["main"], rope["compress"]
        names.update({"rope_parameters": "rope_parameters.main", "compress_rope": "rope_parameters.compress"})
        return
    field = "rope_parameters" if isinstance(rope, dict) and rope else "rope_scaling"
    given = flat.get(field) or {}
    if not isinstance(given, dict):
        raise UsageError(f"{path}: field {field!r} is {given!r}; it must be an object")
    compress = {k: v for k, v in given.items() if k not in ("main", "compress", "rope_theta")}
    if "type" in compress and "rope_type" not in compress:
        compress["rope_type"] = compress.pop("type")
    compress.setdefault("rope_type", "default")
    compress["rope_theta"] = flat.get("compress_rope_theta", 160000.0)
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # transformers: V4's YaRN does not scale cos and sin
    flat["rope_parameters"] = {"rope_type": "default", "rope_theta": flat.get("rope_theta", 10000.0)}
    flat["compress_rope"] = compress
    names.update({"rope_parameters": "rope_theta", "compress_rope": field})
    flat.pop("rope_scaling", None)


def yarn_of(cfg: ConfigFields, key: str) -> RopeScaling | None:
    """The YaRN parameters of the rope `key` (`rope_parameters` or `compress_rope`), None for the default rope; any
    other rope type is a UsageError. As `transformers`: `factor` null means max_position_embeddings / original; no
    `attention_factor` means YaRN's mscale of the factor; the correction range is always truncated (V4's nested
    `rope_parameters` hides the `truncate` key from the reader)."""
    import math

    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise cfg.bad(key, "an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    name = cfg.name(key)
    if kind != "yarn":
        raise UsageError(f"{cfg.path}: field '{name}.rope_type' is {kind!r}; only the default rope and 'yarn' are "
                         "supported")
    fields = ConfigFields(cfg.path, {f"{name}.{k}": v for k, v in params.items()})
    original = fields.positive_int(f"{name}.original_max_position_embeddings")
    factor = (fields.positive_float(f"{name}.factor") if params.get("factor") is not None
              else cfg.positive_int("max_position_embeddings") / original)
    if params.get("attention_factor") is not None:
        attention = fields.positive_float(f"{name}.attention_factor")
    else:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        if params.get("mscale") and params.get("mscale_all_dim"):
            raise UsageError(f"{cfg.path}: fields '{name}.mscale' and '{name}.mscale_all_dim' are not supported "
                             "without 'attention_factor'")
    beta_fast = fields.positive_float(f"{name}.beta_fast") if params.get("beta_fast") else 32.0
    beta_slow = fields.positive_float(f"{name}.beta_slow") if params.get("beta_slow") else 1.0
    return RopeScaling(kind="yarn", factor=factor, beta_fast=beta_fast, beta_slow=beta_slow,
                       original_max_position_embeddings=original, truncate=True, attention_factor=attention)
