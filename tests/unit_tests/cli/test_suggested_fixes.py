"""A fix that is pasted makes its rule pass: every suggested alternative is applied and re-validated.

The broken configs are the rules' own reproducers (one per rule, as the docs show them) plus layouts with
pipeline parallelism, where the expert-parallel fix must account for the pipeline stages. Each
violation's fix is split into its alternatives ("A, or B"); an alternative made of overrides or flags
is applied to the same config, and the rule must no longer fire. When two rules suggest an EP size,
they suggest the same one.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from mbridge_epoverlap.config.environment import Environment
from mbridge_epoverlap.config.overrides import apply_overrides
from mbridge_epoverlap.config.rules import all_rules
from mbridge_epoverlap.recipes.loader import load_recipe
from tests.unit_tests.cli_runner import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("generate_docs", REPO / "scripts" / "generate_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate_docs"] = module
    spec.loader.exec_module(module)
    return module


# Flags that fixes name, as the dotted keys they set.
FLAG_KEYS = {
    "-ng": "num_gpus", "-gb": "train.global_batch_size", "-mb": "train.micro_batch_size",
    "-tp": "model.tensor_model_parallel_size", "-pp": "model.pipeline_model_parallel_size",
    "-cp": "model.context_parallel_size", "-ep": "model.expert_model_parallel_size",
    "-vp": "model.virtual_pipeline_model_parallel_size", "-et": "model.expert_tensor_parallel_size",
    "--cuda_graph_scope": "model.cuda_graph_scope",
    "--moe_a2a_overlap": "comm_overlap.overlap_moe_expert_parallel_comm",
    "--delay_wgrad_compute": "comm_overlap.delay_wgrad_compute",
}
_DOTTED = re.compile(r"(?<![\w.])((?:model|comm_overlap|train|ddp|dataset)\.[a-z0-9_]+|num_gpus)=(\S+)")
_FLAG = re.compile(r"(?<!\S)(-{1,2}[a-z_]+) (\[[^\]]*\]|[\w.,-]+)")


def pasteable(fix: str) -> list[list[str]]:
    """The alternatives of a fix that are overrides or flags, each as dotted overrides."""
    alternatives = []
    for alternative in re.split(r",? or ", fix):
        dotted = [f"{key}={value.rstrip(',;')}" for key, value in _DOTTED.findall(alternative)]
        if dotted:  # "key=value (flag -x value)": the flag in brackets says the same thing
            alternatives.append(dotted)
            continue
        if alternative.strip().startswith("--moe_flex_dispatcher_backend"):
            backend = alternative.split()[1]
            alternatives.append(["model.moe_token_dispatcher_type=flex",
                                 f"model.moe_flex_dispatcher_backend={backend}"])
            continue
        flags = [(flag, value) for flag, value in _FLAG.findall(alternative) if flag in FLAG_KEYS]
        if flags:
            alternatives.append([f"{FLAG_KEYS[flag]}={value}" for flag, value in flags])
    return alternatives


def _validate(recipe: str, gpu: str, versions: dict[str, str], overrides: list[str]):
    env = Environment.for_gpu(gpu, **versions)
    cfg = load_recipe(recipe)
    apply_overrides(cfg, overrides)
    return cfg.validate(env)


def _replace(overrides: list[str], new: list[str]) -> list[str]:
    keys = {item.split("=", 1)[0] for item in new}
    return [item for item in overrides if item.split("=", 1)[0] not in keys] + new


def broken_configs() -> list[tuple[str, str, str, dict[str, str], list[str]]]:
    """(id, recipe, gpu, versions, overrides) of configs that break at least one rule."""
    gen = _generator()
    names = {"--torch-version": "torch_version", "--te-version": "te_version", "--mcore-version": "mcore_version",
             "--bridge-version": "bridge_version"}
    configs = []
    for rule in all_rules():
        versions = dict(gen.BASE_VERSIONS)
        versions.update(dict(rule.example_versions))
        configs.append((rule.id, "qwen3_30b_a3b", rule.example_gpu, {names[k]: v for k, v in versions.items()},
                        list(rule.example)))
    newest = {"torch_version": "2.7", "te_version": "2.9", "mcore_version": "0.16"}
    for ng, ep in ((16, 8), (32, 16), (16, 16), (24, 8)):
        configs.append((f"mixtral-ng{ng}-ep{ep}", "mixtral_8x22b", "h100", newest,
                        [f"num_gpus={ng}", f"model.expert_model_parallel_size={ep}"]))
    return configs


CONFIGS = broken_configs()


@pytest.mark.parametrize(("recipe", "gpu", "versions", "overrides"), [c[1:] for c in CONFIGS],
                         ids=[c[0] for c in CONFIGS])
def test_every_pasted_fix_makes_its_rule_pass(recipe, gpu, versions, overrides):
    violations = _validate(recipe, gpu, versions, overrides)
    assert violations, "the config should break a rule"
    tried = 0
    for violation in violations:
        for alternative in pasteable(violation.fix):
            after = _validate(recipe, gpu, versions, _replace(overrides, alternative))
            assert violation.rule not in {v.rule for v in after}, (
                f"pasting {alternative} (from the fix {violation.fix!r}) leaves {violation.rule} broken")
            tried += 1
    if any(v.severity == "error" for v in violations):
        assert tried, f"no fix of {[v.fix for v in violations]} could be pasted"


@pytest.mark.parametrize(("ng", "ep"), [(16, 16), (32, 16), (64, 16)])
def test_rules_suggesting_an_ep_size_agree(ng, ep):
    newest = {"torch_version": "2.7", "te_version": "2.9", "mcore_version": "0.16"}
    overrides = [f"num_gpus={ng}", f"model.expert_model_parallel_size={ep}"]
    violations = _validate("mixtral_8x22b", "h100", newest, overrides)
    suggested = {int(size) for v in violations for size in re.findall(r"-ep (\d+)", v.fix)}
    assert len(suggested) == 1, [v.fix for v in violations]


def test_the_fix_parser_reads_the_shapes_fixes_take():
    assert pasteable("-ep 4, or -ng 32 (GPUs a multiple of PP x lcm(TP x CP, EP x ETP))") == [
        ["model.expert_model_parallel_size=4"], ["num_gpus=32"]]
    assert pasteable("model.expert_model_parallel_size=8 (flag -ep 8; a divisor of 8)") == [
        ["model.expert_model_parallel_size=8"]]
    assert pasteable("use TE >= 2.7, or model.gradient_accumulation_fusion=false, or "
                     "comm_overlap.delay_wgrad_compute=false") == [
        ["model.gradient_accumulation_fusion=false"], ["comm_overlap.delay_wgrad_compute=false"]]
