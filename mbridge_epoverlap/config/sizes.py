"""Sizes and counts of a run config must be positive, whether a flag, a dotted override or a recipe file set them.

`run_script.py`'s flags reject `-ep 0` while parsing; `check_size` gives dotted overrides
(`model.expert_model_parallel_size=0`) the same check, naming the flag, before anything is validated
or launched. `size_problems` checks a whole config (recipe files).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mbridge_epoverlap.errors import UsageError

# Dotted key -> (the run_script.py flag that sets it, or "", whether null is allowed).
SIZE_KEYS: dict[str, tuple[str, bool]] = {
    "num_gpus": ("-ng", False),
    "gpus_per_node": ("-gn", False),
    "train.global_batch_size": ("-gb", False),
    "train.micro_batch_size": ("-mb", False),
    "train.train_iters": ("-ms", False),
    "model.seq_length": ("-sl", False),
    "model.tensor_model_parallel_size": ("-tp", False),
    "model.pipeline_model_parallel_size": ("-pp", False),
    "model.context_parallel_size": ("-cp", False),
    "model.expert_model_parallel_size": ("-ep", False),
    "model.virtual_pipeline_model_parallel_size": ("-vp", True),
    "model.expert_tensor_parallel_size": ("-et", True),
    "model.recompute_num_layers": ("-rl", True),
    "model.num_layers": ("", False),
    "model.hidden_size": ("", False),
    "model.num_attention_heads": ("", False),
    "model.num_query_groups": ("", True),
    "model.kv_channels": ("", True),
    "model.ffn_hidden_size": ("", True),
    "model.vocab_size": ("", True),  # None: the tokenizer's
    "model.num_moe_experts": ("", True),
    "model.moe_router_topk": ("", False),
    "model.moe_ffn_hidden_size": ("", True),
    "model.moe_shared_expert_intermediate_size": ("", True),
    "model.moe_layer_freq": ("", False),  # or a list of 0/1 per layer
    "model.mtp_num_layers": ("", True),  # 0 allowed (see ZERO_ALLOWED)
}
# Sizes for which 0 is meaningful (no MTP layers).
ZERO_ALLOWED = frozenset({"model.mtp_num_layers"})


def size_problem(key: str, value: Any) -> str | None:
    """Why `value` is not a valid size for `key`, or None (also None for keys that are not sizes)."""
    if key not in SIZE_KEYS:
        return None
    flag, nullable = SIZE_KEYS[key]
    if value is None and nullable:
        return None
    if key == "model.moe_layer_freq" and isinstance(value, list):
        return None
    least = 0 if key in ZERO_ALLOWED else 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return None
    fix = f"{'a non-negative' if least == 0 else 'a positive'} integer{' or null' if nullable else ''}"
    same_as = f" (as its flag {flag} requires)" if flag else ""
    return f"{key}={value!r}: must be {fix}{same_as}; set it to one, e.g. {key}=1"


def check_size(key: str, value: Any) -> None:
    """Raise UsageError when a dotted override sets a size to zero, a negative number or null."""
    problem = size_problem(key, value)
    if problem:
        raise UsageError(problem)


def size_problems(cfg: Any) -> list[str]:
    """Every size of a whole run config that is not positive."""
    problems = []
    for key in SIZE_KEYS:
        owner, found = cfg, True
        for part in key.split("."):
            if dataclasses.is_dataclass(owner) and hasattr(owner, part):
                owner = getattr(owner, part)
            else:
                found = False
                break
        if found:
            problem = size_problem(key, owner)
            if problem:
                problems.append(problem)
    return problems
