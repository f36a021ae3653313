"""Flex dispatcher (DeepEP / HybridEP) gating per GPU, fallback, strict mode."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.config import (
    Environment,
    FlexDispatcherWarning,
    apply_flex_dispatcher_backend,
    validate_flex_dispatcher_backend,
)
from mbridge_epoverlap.config.flex import backend_supports_gpu
from tests.unit_tests.training.conftest import good_model

SUPPORT = {
    # gpu: (deepep, hybridep)
    "a100": (True, True),
    "h100": (True, True),
    "h200": (True, True),
    "h20": (True, True),
    "l40s": (True, True),
    "b200": (True, True),
    "b300": (True, True),
    "gb200": (False, True),
    "gb300": (False, True),
}


@pytest.mark.parametrize("gpu", sorted(SUPPORT))
def test_support_matrix(gpu):
    env = Environment.for_gpu(gpu)
    assert (backend_supports_gpu("deepep", env), backend_supports_gpu("hybridep", env)) == SUPPORT[gpu]


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
@pytest.mark.parametrize("gpu", ["h100", "b200", "a100"])
def test_apply_switches_to_flex_and_disables_shared_expert_overlap(gpu, backend):
    model = good_model(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = apply_flex_dispatcher_backend(model, backend, env=Environment.for_gpu(gpu))
    assert result is model
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", backend)
    assert model.moe_shared_expert_overlap is False
    validate_flex_dispatcher_backend(model, Environment.for_gpu(gpu))


def test_gb200_deepep_falls_back_to_alltoall_loudly():
    model = good_model()
    with pytest.warns(FlexDispatcherWarning, match="deepep flex dispatcher does not support NVIDIA GB200"):
        apply_flex_dispatcher_backend(model, "deepep", env=Environment.for_gpu("gb200"))
    assert model.moe_token_dispatcher_type == "alltoall"
    assert model.moe_flex_dispatcher_backend is None


def test_gb200_deepep_strict_raises():
    model = good_model()
    with pytest.raises(ValueError, match="GB200.*hybridep"):
        apply_flex_dispatcher_backend(model, "deepep", env=Environment.for_gpu("gb200"), strict=True)
    assert model.moe_token_dispatcher_type == "alltoall"


def test_gb200_hybridep_applies():
    model = apply_flex_dispatcher_backend(good_model(), "hybridep", env=Environment.for_gpu("gb200"))
    assert model.moe_token_dispatcher_type == "flex"


def test_unknown_gpu_by_capability_only():
    env = Environment(compute_capability=(7, 0))
    with pytest.warns(FlexDispatcherWarning):
        model = apply_flex_dispatcher_backend(good_model(), "hybridep", env=env)
    assert model.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("gpu", ["vr200", "r100"])
def test_a_target_without_public_device_facts_is_not_judged(gpu):
    # Megatron-Bridge 0.6.2 ships qwen3_30b_a3b_pretrain_8gpu_vr200_bf16_config with HybridEP: the device decides.
    env = Environment.for_gpu(gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = apply_flex_dispatcher_backend(good_model(), "hybridep", env=env)
    assert model.moe_token_dispatcher_type == "flex"
    validate_flex_dispatcher_backend(model, env=env)


def test_no_gpu_known_sets_flex_without_probing():
    model = apply_flex_dispatcher_backend(good_model(), "deepep", env=Environment(torch_version="2.8"))
    assert model.moe_token_dispatcher_type == "flex"


@pytest.mark.parametrize("backend", [None, "None", "none", ""])
def test_backend_none_leaves_model_unchanged(backend):
    model = good_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_flex_dispatcher_backend(model, backend, env=Environment.for_gpu("h100"))
    assert model.moe_token_dispatcher_type == "alltoall"


def test_invalid_backend_unchanged_or_raises_when_strict():
    model = good_model()
    with pytest.warns(FlexDispatcherWarning, match="not one of deepep, hybridep"):
        apply_flex_dispatcher_backend(model, "nccl", env=Environment.for_gpu("h100"))
    assert model.moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ValueError, match="nccl"):
        apply_flex_dispatcher_backend(model, "nccl", env=Environment.for_gpu("h100"), strict=True)


def test_non_moe_model_warns_and_is_unchanged():
    model = SimpleNamespace(num_moe_experts=None, moe_token_dispatcher_type="allgather")
    with pytest.warns(FlexDispatcherWarning, match="without experts"):
        apply_flex_dispatcher_backend(model, "deepep", env=Environment.for_gpu("h100"))
    assert model.moe_token_dispatcher_type == "allgather"


def test_validate_raises_for_flex_on_unsupported_gpu():
    model = good_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    with pytest.raises(ValueError, match="GB300"):
        validate_flex_dispatcher_backend(model, Environment.for_gpu("gb300"))
    validate_flex_dispatcher_backend(model, Environment.for_gpu("h100"))
    validate_flex_dispatcher_backend(good_model(), Environment.for_gpu("gb300"))  # alltoall: nothing to check


def test_dict_model_config_is_updated():
    model = {"num_moe_experts": 8, "moe_token_dispatcher_type": "alltoall"}
    apply_flex_dispatcher_backend(model, "hybridep", env=Environment.for_gpu("h200"))
    assert model["moe_token_dispatcher_type"] == "flex" and model["moe_shared_expert_overlap"] is False
