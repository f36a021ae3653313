"""Dotted `key=value` overrides on a run config, with OmegaConf dotlist value semantics.

`apply_overrides(cfg, ["model.bf16=true", "comm_overlap.delay_wgrad_compute=false"])` parses each
value the way OmegaConf's dotlist does (`true`, `null`, `3`, `[attn,moe_router]`), checks it against
the field's type and sets it. An unknown key names the nearest valid keys; a malformed item or a
value of the wrong type names the setting and what it accepts. Nothing is changed when any item is
bad: all items are checked before the first is applied.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Union

from mbridge_epoverlap.config.sizes import check_size
from mbridge_epoverlap.errors import UsageError

OVERLAP_FIELD = "overlap_moe_expert_parallel_comm"
DELAY_FIELD = "delay_wgrad_compute"


def parse_override(item: str) -> tuple[str, Any]:
    """Split `a.b=value` and parse the value (YAML scalars/lists, as OmegaConf's dotlist does)."""
    if "=" not in item:
        raise UsageError(f"override {item!r} is not KEY=VALUE; write e.g. comm_overlap.delay_wgrad_compute=true")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise UsageError(f"override {item!r}: {key!r} is not a dotted key such as model.bf16")
    if raw.strip() == "":
        raise UsageError(f"override {item!r} has no value; write {key}=VALUE (null for None)")
    from omegaconf import OmegaConf

    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=True)["v"]
    except Exception as exc:  # OmegaConf and YAML parse errors share no narrower base
        raise UsageError(f"override {item!r}: cannot parse value {raw!r} ({type(exc).__name__})") from None
    return key, value


def valid_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted key that can be overridden on `cfg`."""
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += valid_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def resolve_key(cfg: Any, key: str) -> tuple[Any, str, Any]:
    """(owner object, field name, field type) for a dotted key; dict fields accept any sub-key."""
    parts = key.split(".")
    owner = cfg
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(owner, dict):
            if not last:
                raise _unknown(cfg, key)
            return owner, part, Any
        names = {f.name for f in dataclasses.fields(owner)}
        if part not in names:
            raise _unknown(cfg, key)
        value = getattr(owner, part)
        if last:
            if dataclasses.is_dataclass(value):
                raise UsageError(f"override {key!r} names a section; set one of its keys, e.g. {key}."
                                 f"{dataclasses.fields(value)[0].name}=...")
            return owner, part, _type_hints(type(owner))[part]
        owner = value
    raise _unknown(cfg, key)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A config class's field types, evaluated once: `typing.get_type_hints` compiles each string annotation on every
    call, and resolving the keys of the shipped recipes called it 55,000 times (57 of the 62 s `make docs` took)."""
    return typing.get_type_hints(cls)


def _unknown(cfg: Any, key: str) -> UsageError:
    keys = valid_keys(cfg)
    near = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if not near:
        leaf = key.split(".")[-1]
        near = [k for k in keys if k.split(".")[-1] == leaf][:3] or difflib.get_close_matches(
            leaf, [k.split(".")[-1] for k in keys], n=3, cutoff=0.6)
    sections = sorted({k.split(".")[0] for k in keys})
    hint = f"; did you mean {', '.join(near)}?" if near else f"; sections are {sections}"
    return UsageError(f"unknown config key {key!r}{hint}")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check `value` against a field annotation; convert "a,b" to a list for list fields."""
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if (value is None or value == "None") and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key)
            except UsageError as exc:
                errors.append(str(exc))
        raise UsageError(f"{key}={value!r}: expected {_type_name(annotation)}")
    if origin is list:
        (item_type,) = typing.get_args(annotation) or (Any,)
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list):
            raise UsageError(f"{key}={value!r}: expected a list such as [a,b]")
        return [coerce(item, item_type, key) for item in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise UsageError(f"{key}={value!r}: expected a mapping")
        return {str(k): str(v) for k, v in value.items()}
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise UsageError(f"{key}={value!r}: expected true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UsageError(f"{key}={value!r}: expected an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UsageError(f"{key}={value!r}: expected a number")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UsageError(f"{key}={value!r}: expected a string")
    return value


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("NoneType", "null")


def apply_overrides(cfg: Any, items: Iterable[str]) -> Any:
    """Apply dotted `key=value` overrides to a run config (all checked first, then all applied)."""
    return _apply(cfg, [parse_override(item) for item in items])


def apply_mapping(cfg: Any, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Apply a nested mapping (e.g. a saved YAML config) as overrides."""
    return _apply(cfg, _flatten(data, prefix))


def _apply(cfg: Any, pairs: list[tuple[str, Any]]) -> Any:
    # Resolve and type-check every pair before setting any, so a bad item leaves cfg untouched.
    planned = []
    for key, value in pairs:
        owner, name, annotation = resolve_key(cfg, key)
        value = coerce(value, annotation, key)
        check_size(key, value)  # the same bounds as the key's flag (-ep 0 and model.expert_model_parallel_size=0)
        planned.append((owner, name, value))
    for owner, name, value in planned:
        if isinstance(owner, dict):
            owner[name] = str(value)
        else:
            setattr(owner, name, value)
    return cfg


def _flatten(data: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    items = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and key != "tp_comm_overlap_cfg":
            if key == "env_vars" and not prefix:
                items += [(f"env_vars.{k}", v) for k, v in value.items()]
            else:
                items += _flatten(value, f"{dotted}.")
        else:
            items.append((dotted, value))
    return items


def apply_recipe_values(cfg: Any, facts: Mapping[str, Any]) -> list[str]:
    """Write a Megatron-Bridge recipe's values (`harness.recipe_facts.recipe_values`: dotted run-config keys, and
    whether it has a comm-overlap config) onto a run config, as the recipe Bridge would build, before the user's
    flags and overrides; return the keys whose value the run config cannot hold, left unchanged.

    A recipe without a comm-overlap config gets the one a GPU job creates to carry the EP switches
    (`CommOverlapConfig.created_by_job`), every switch unset.
    """
    from mbridge_epoverlap.config.comm_overlap import CommOverlapConfig

    if not facts["comm_overlap"]:
        cfg.comm_overlap = CommOverlapConfig.created_by_job()
    skipped = []
    for key, value in facts["values"].items():
        section, name = key.split(".", 1)
        try:
            apply_mapping(cfg, {section: {name: value}})
        except UsageError:
            skipped.append(key)
    return skipped


def set_moe_a2a_overlap_overrides(cfg: Any, overlap: bool | None, delay_wgrad: bool | None) -> Any:
    """Set the two EP switches independently; None keeps the recipe's value.

    `overlap=False` really turns EP overlap off, and `delay_wgrad` is its own switch: neither is ever a
    side effect of the other. Only `comm_overlap.*` is written; the model gets the effective values
    when the config is finalized.
    """
    target = cfg.comm_overlap if hasattr(cfg, "comm_overlap") else cfg
    for name, value in ((OVERLAP_FIELD, overlap), (DELAY_FIELD, delay_wgrad)):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise UsageError(f"{name}: expected true, false or unset, got {value!r}")
        setattr(target, name, value)
    return cfg
