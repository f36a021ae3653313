"""GLM-4.5 (`serving.model.architectures.glm4_moe`) decodes its checkpoints exactly as `transformers` does, and refuses
what it cannot serve before any weight is read.

On the tiny checkpoint of the serving fixtures (a dense first layer, half of each head rotated, q/k RMSNorm and
biases, grouped sigmoid routing whose group limit and correction bias both change choices, a shared expert):
routing equals `Glm4MoeTopkRouter`'s, greedy tokens equal `generate(do_sample=False)`, fp32 and bf16 prefill logits
equal the eager model's bit for bit, experts split over parts and the disaggregated engine give the same tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.moe.router import GroupedSigmoidRouter
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.model.spec import GroupedRouting
from tests.unit_tests.serving.conftest import GLM4_MOE_SCALING
from tests.unit_tests.serving.engine_runs import assert_refused_before_weights, config_only

MAX_NEW = 10


def test_spec_reads_what_glm4_moe_has(tiny_glm4_moe_dir) -> None:
    spec = load_spec(tiny_glm4_moe_dir)
    assert spec.architecture == "Glm4MoeForCausalLM"
    assert spec.moe_layers == (False, True, True) and (spec.dense_ffn, spec.expert_ffn, spec.shared_expert_ffn) == (
        40, 24, 24)
    assert (spec.num_experts, spec.top_k, spec.head_dim, spec.rotary_dim, spec.rope_dim) == (8, 2, 16, 8, 8)
    assert (spec.qkv_bias, spec.qk_norm, spec.qk_norm_scope, spec.norm_topk_prob) == (True, True, "head", True)
    assert spec.grouped_routing == GroupedRouting(n_group=4, topk_group=2, routed_scaling_factor=GLM4_MOE_SCALING)
    assert not spec.shared_expert_gate and not spec.router_weights_in_dtype


def _their_router(n_group: int, topk_group: int, norm: bool):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=norm)
    router = Glm4MoeTopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        router.e_score_correction_bias.normal_(0.0, 0.2)
    return router


def _ours(router) -> GroupedSigmoidRouter:
    ours = GroupedSigmoidRouter(32, router.num_experts, router.top_k, n_group=router.num_group,
                                topk_group=router.topk_group, scaling=router.routed_scaling_factor,
                                normalize=router.norm_topk_prob)
    with torch.no_grad():
        ours.weight.copy_(router.weight)
        ours.e_score_correction_bias.copy_(router.e_score_correction_bias)
    return ours


@pytest.mark.parametrize(("n_group", "topk_group", "norm"), [(4, 2, True), (8, 3, False), (1, 1, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_equals_transformers(n_group, topk_group, norm, dtype) -> None:
    """The same expert ids and the same fp32 weights, bit for bit, from inputs in either model dtype."""
    router = _their_router(n_group, topk_group, norm)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(n_group)).to(dtype)
    _, their_weights, their_ids = router(x)
    routing = _ours(router).route(x)
    ids, weights = routing.experts, routing.weights
    assert weights.dtype == torch.float32 == their_weights.dtype
    assert torch.equal(ids, their_ids) and torch.equal(weights, their_weights)


def test_the_group_limit_and_the_correction_bias_change_choices() -> None:
    """Without the group limit, or without the bias, some tokens would pick other experts: both are exercised."""
    router = _their_router(4, 2, True)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    ours = _ours(router)
    ids = ours.route(x).experts.sort(dim=-1).values
    ungrouped = GroupedSigmoidRouter(32, 16, 4, n_group=1, topk_group=1, scaling=2.5, normalize=True)
    unbiased = _ours(router)
    with torch.no_grad():
        ungrouped.weight.copy_(router.weight)
        ungrouped.e_score_correction_bias.copy_(router.e_score_correction_bias)
        unbiased.e_score_correction_bias.zero_()
    assert not torch.equal(ids, ungrouped.route(x).experts.sort(dim=-1).values)
    assert not torch.equal(ids, unbiased.route(x).experts.sort(dim=-1).values)


# Tokens, logits, split experts and the disaggregated engine: `test_architectures.py` (FAMILIES).


# --- refused before any weight is read --------------------------------------------------------------

@pytest.mark.parametrize(("changes", "named"), [
    ({"topk_method": "greedy"}, ["'topk_method'", "'greedy'", "'noaux_tc'"]),
    ({"scoring_func": "softmax"}, ["'scoring_func'", "'softmax'", "'sigmoid'"]),
    ({"n_group": 3}, ["'n_group' (3)", "'n_routed_experts' (8)"]),
    ({"topk_group": 5}, ["'topk_group' (5)", "between 1 and n_group 4"]),
    ({"n_group": 0}, ["'n_group'", "is 0"]),
    ({"rope_parameters.partial_rotary_factor": 0.2}, ["'rope_parameters.partial_rotary_factor'", "0.2", "= 3"]),
    ({"first_k_dense_replace": -1}, ["'first_k_dense_replace'", "-1"]),
    ({"routed_scaling_factor": 0}, ["'routed_scaling_factor'", "is 0"]),
])
def test_unsupported_values_are_named_before_weights_load(tiny_glm4_moe_dir, tmp_path, changes, named) -> None:
    assert_refused_before_weights(config_only(tiny_glm4_moe_dir, tmp_path, **changes), named, tmp_path)


def test_a_missing_correction_bias_is_named(tiny_glm4_moe_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    directory = Path(shutil.copytree(tiny_glm4_moe_dir, tmp_path / "ckpt"))
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"model\.layers\.2\.mlp\.gate\.e_score_correction_bias"):
        load_spec(directory)
