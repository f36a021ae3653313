"""Workloads whose project recipe is Megatron-Bridge's own: GPT-OSS, Kimi K2, DeepSeek-V4, Qwen3-Next, Nemotron 3,
the Qwen VL MoEs and GLM-5.

These models carry more than the run config's model fields describe (hybrid Mamba stacks, linear attention,
hyper-connections, vision towers), and Megatron-Bridge builds each from its public `config.json`. So their
project recipe is not written out by hand: it is the values of the workload's reference performance recipe as the
real Megatron-Bridge 0.6.2 builds it (the recipe-facts fixture `harness/data/bridge_recipe_facts.json`, written by
`scripts/extract_bridge_recipe_facts.py` from the configs in `harness/data/hf_configs/`). The reference is the
first of the workload's performance recipes in the order pretrain before sft, H100 before the other GPUs, bf16
before other precisions, the canonical recipe before variants, and the default GPU count (the largest).

A GPU job never runs this recipe: it builds the performance recipe the flags name, as for every workload. The
project recipe is what `-g cpu` shrinks for the reference runtime and what `validate -mr NAME` checks without a
GPU target.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.config.overrides import apply_recipe_values
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.recipes._common import make_run

# The package's data, wherever the package is installed (this folder is linked into it as mbridge_epoverlap/recipes).
FACTS = importlib.resources.files("mbridge_epoverlap") / "harness" / "data" / "bridge_recipe_facts.json"
PERF_PREFIX = "megatron.bridge.perf_recipes."
TASK_ORDER = ("pretrain", "sft")
GPU_ORDER = ("h100", "b200", "b300", "gb200", "gb300", "vr200")
PRECISION_ORDER = ("bf16", "fp8cs", "fp8mx", "fp8sc", "fp8ds", "nvfp4")
_NAME = re.compile(r"^(?P<model>.+)_(?P<task>pretrain|sft|peft)_(?P<count>\d+)gpu_(?P<gpu>[a-z0-9]+)_"
                   r"(?P<precision>bf16|fp8cs|fp8mx|fp8sc|fp8ds|nvfp4)(?:_(?P<variant>.+))?_config$")


@dataclass(frozen=True)
class BridgeWorkload:
    """A Megatron-Bridge perf workload whose project recipe is read from Bridge's recipe.

    Attributes:
        name: the workload as `-mr` names it (`gpt_oss_120b`).
        family: the `perf_recipes` package that holds its recipes (`run_script.py -m`).
        title: the model in words.
        vision: whether the model has a vision tower (the reference runtime has none: text-only stand-in).
    """

    name: str
    family: str
    title: str
    vision: bool = False


WORKLOADS = (
    BridgeWorkload("gpt_oss_20b", "gpt_oss", "GPT-OSS 20B (32 experts top-4, attention sinks, biases)"),
    BridgeWorkload("gpt_oss_120b", "gpt_oss", "GPT-OSS 120B (128 experts top-4, attention sinks, biases)"),
    BridgeWorkload("kimi_k2", "kimi", "Kimi K2 (1T, MLA, 384 experts top-8, Muon)"),
    BridgeWorkload("deepseek_v4_flash", "deepseek", "DeepSeek-V4 Flash (hyper-connections, hash-routed layers)"),
    BridgeWorkload("deepseek_v4_pro", "deepseek", "DeepSeek-V4 Pro (hyper-connections, hash-routed layers)"),
    BridgeWorkload("qwen3_next_80b_a3b", "qwen", "Qwen3-Next 80B-A3B (gated DeltaNet + gated attention)"),
    BridgeWorkload("nemotron_3_nano", "nemotronh", "Nemotron 3 Nano 30B-A3B (Mamba-2 / attention / MoE hybrid)"),
    BridgeWorkload("nemotron_3_super", "nemotronh", "Nemotron 3 Super 120B-A12B (Mamba-2 / attention / MoE)"),
    BridgeWorkload("nemotron_3_ultra", "nemotronh", "Nemotron 3 Ultra 550B-A55B (Mamba-2 / attention / MoE)"),
    BridgeWorkload("nemotron_3_5_lightning", "nemotronh", "Nemotron 3.5 Lightning 30B-A3B (hybrid, 2 MTP layers)"),
    BridgeWorkload("nemotronh_56b", "nemotronh", "Nemotron-H 56B (dense Mamba-2 / attention hybrid: no experts)"),
    BridgeWorkload("qwen3_vl_30b_a3b", "qwen_vl", "Qwen3-VL 30B-A3B (vision tower + Qwen3 MoE)", vision=True),
    BridgeWorkload("qwen3_vl_235b_a22b", "qwen_vl", "Qwen3-VL 235B-A22B (vision tower + Qwen3 MoE)", vision=True),
    BridgeWorkload("qwen35_vl_35b_a3b", "qwen_vl", "Qwen3.5 35B-A3B (vision, gated DeltaNet hybrid)", vision=True),
    BridgeWorkload("qwen35_vl_122b_a10b", "qwen_vl", "Qwen3.5 122B-A10B (vision, gated DeltaNet hybrid)", vision=True),
    BridgeWorkload("qwen35_vl_397b_a17b", "qwen_vl", "Qwen3.5 397B-A17B (vision, gated DeltaNet hybrid)", vision=True),
    BridgeWorkload("glm51", "glm_moe_dsa", "GLM-5.1 (MLA with DeepSeek Sparse Attention; SFT recipes only)"),
    BridgeWorkload("glm52", "glm_moe_dsa", "GLM-5.2 (MLA with DeepSeek Sparse Attention; SFT recipes only)"),
)
BY_NAME = {workload.name: workload for workload in WORKLOADS}


@cache
def _facts() -> dict[str, Any]:
    return json.loads(FACTS.read_text(encoding="utf-8"))


def _recipes() -> dict[str, Any]:
    return _facts()["recipes"]


def facts_core_version() -> str:
    """The Megatron-Core release the reference recipes were built with (0.19.2 under Megatron-Bridge 0.6.2): the one
    their values are valid for."""
    return _facts()["core_version"]


def recipe_parts(function: str) -> dict[str, str] | None:
    """The parts of a flat perf recipe name: `model`, `task`, `count`, `gpu`, `precision` (as recipe names spell
    it: fp8mx) and `variant` ("default" for the suffix-less recipe); None for another name."""
    match = _NAME.match(function)
    if match is None:
        return None
    parts = match.groupdict()
    parts["variant"] = parts["variant"] or "default"
    return parts


def _order(parts: dict[str, Any], task: str) -> tuple:
    def rank(value: Any, order: tuple[str, ...]) -> int:
        return order.index(value) if value in order else len(order)

    return (parts["task"] != task, rank(parts["task"], TASK_ORDER), rank(parts["gpu"], GPU_ORDER),
            rank(parts["precision"], PRECISION_ORDER), parts["variant"] != "default", -int(parts["count"]))


def reference_recipe(workload: BridgeWorkload, task: str = "pretrain") -> str:
    """`module.function` of the workload's reference performance recipe in the fixture (see the module text)."""
    candidates = []
    for key in _recipes():
        module, _, function = key.rpartition(".")
        parts = recipe_parts(function)
        if module == PERF_PREFIX + workload.family and parts and parts["model"] == workload.name:
            candidates.append((_order(parts, task), key))
    if not candidates:
        raise UsageError(f"the recipe facts hold no performance recipe of {workload.name}; rebuild them with "
                         "scripts/extract_bridge_recipe_facts.py")
    return min(candidates)[1]


def bridge_model_run(name: str, task: str = "pretrain") -> RunConfig:
    """The project recipe of a Bridge workload: its reference recipe's model, layout, batch and overlap settings."""
    key = reference_recipe(BY_NAME[name], task)
    parts = recipe_parts(key.rpartition(".")[2])  # a key reference_recipe found by its name's parts
    count = int(parts["count"])
    per_node = 4 if parts["gpu"].startswith("gb") else 8
    cfg = make_run(name, task, MoEModelConfig(), num_gpus=count, gpus_per_node=min(per_node, count))
    apply_recipe_values(cfg, _recipes()[key])  # a value the run config cannot hold keeps the project's default
    return cfg


def recipe_functions() -> dict[str, Any]:
    """`name -> recipe function(task)` for every Bridge workload (the table `RECIPES` is built from)."""
    def make(name: str) -> Any:
        def recipe(task: str = "pretrain") -> RunConfig:
            return bridge_model_run(name, task)

        recipe.__name__ = name
        recipe.__doc__ = f"{BY_NAME[name].title}: Megatron-Bridge's reference recipe of {name}."
        return recipe

    return {workload.name: make(workload.name) for workload in WORKLOADS}
