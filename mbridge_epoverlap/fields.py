"""Reading and writing a named field of a config that may be an object or a dict.

Configs arrive as dataclasses, Megatron-Core `TransformerConfig`s, Megatron-Bridge providers,
namespaces or plain dicts (from YAML); these helpers are the one place that tells them apart.
"""

from __future__ import annotations

from typing import Any

MISSING: Any = object()  # default sentinel: absent fields raise instead of returning a default


def get_field(owner: Any, name: str, default: Any = MISSING) -> Any:
    """`owner[name]` for a dict, `owner.name` otherwise; `default` when absent (raises without one)."""
    if isinstance(owner, dict):
        return owner[name] if default is MISSING else owner.get(name, default)
    return getattr(owner, name) if default is MISSING else getattr(owner, name, default)


def set_field(owner: Any, name: str, value: Any) -> None:
    """`owner[name] = value` for a dict, `owner.name = value` otherwise."""
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


def get_path(owner: Any, dotted: str) -> Any:
    """The field at a dotted path (`"model.num_moe_experts"`), through objects and dicts alike."""
    for part in dotted.split("."):
        owner = get_field(owner, part)
    return owner
