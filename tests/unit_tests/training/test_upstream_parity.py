"""Megatron-Bridge's own cases for EP overlap, flex dispatch and CUDA-graph scopes, re-expressed here.

Each test names the upstream test it mirrors (NVIDIA-NeMo/Megatron-Bridge `tests/unit_tests/training/
test_comm_overlap.py`, `test_deepep.py`). Upstream checks for Megatron-Core 0.20 (what its HEAD pins), so
the environment here is 0.20 and Megatron-Bridge main unless a case is about an older release (the NCCL EP
cases are the 0.6.2 wheel's, whose main has no ncclep yet). Where upstream patches the GPU
probe, these tests describe the GPU through `Environment.for_gpu` (the catalog), or fake only the CUDA
calls a CPU machine cannot make, named as such.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.config import (
    CommOverlapConfig,
    Environment,
    FlexDispatcherWarning,
    apply_flex_dispatcher_backend,
    validate_flex_dispatcher_backend,
)
from mbridge_epoverlap.config.container import DDPConfig
from mbridge_epoverlap.config.environment import GpuProbeError
from tests.unit_tests.requirements import import_or_skip
from tests.unit_tests.training.conftest import good_model, rules_of

UPSTREAM_CORE = "0.20.0"


def env(te: str | None = "2.18.0", mcore: str | None = UPSTREAM_CORE, gpu: str = "h100",
        bridge: str = "main") -> Environment:
    return Environment.for_gpu(gpu, te_version=te, torch_version="2.13.0", mcore_version=mcore, bridge_version=bridge)


def minimal_moe(**changes):
    """Upstream's `create_gpt_config(...)` for the EP-overlap cases: EP 2, 2 experts, alltoall, bf16."""
    base = dict(num_layers=4, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                expert_model_parallel_size=2, num_moe_experts=2, moe_token_dispatcher_type="alltoall", bf16=True,
                fp16=False, recompute_granularity=None, moe_shared_expert_overlap=False, add_bias_linear=False)
    base.update(changes)
    return good_model(**base)


OVERLAP = CommOverlapConfig(overlap_moe_expert_parallel_comm=True)
DELAY = CommOverlapConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)


# ---- test_comm_overlap.py::TestMegatronCommOverlapConfig ---------------------------------------------------


@pytest.mark.parametrize("mtp_num_layers", [None, 0, 1])
def test_moe_ep_overlap_config_validation(mtp_num_layers):
    """Mirrors test_moe_ep_overlap_config_validation: mtp None/0/1 with PP 1 pass on 0.20."""
    assert OVERLAP.validate(minimal_moe(mtp_num_layers=mtp_num_layers), DDPConfig(), env()) == []


def test_moe_ep_overlap_rejects_multiple_mtp_layers():
    """Mirrors test_moe_ep_overlap_rejects_multiple_mtp_layers."""
    assert rules_of(OVERLAP.validate(minimal_moe(mtp_num_layers=2), DDPConfig(), env()), "error") == {"mtp_layers"}


@pytest.mark.parametrize("mcore", ["0.15.0", "0.16.1", UPSTREAM_CORE])
def test_moe_ep_overlap_rejects_moe_in_recompute_modules(mcore):
    """Mirrors test_moe_ep_overlap_rejects_moe_in_recompute_modules (Megatron-Bridge's own check: every core)."""
    model = minimal_moe(recompute_granularity="selective", recompute_modules=["moe"])
    assert rules_of(OVERLAP.validate(model, DDPConfig(), env(mcore=mcore)), "error") == {"recompute_moe"}


def test_delay_wgrad_config_validation():
    """Mirrors test_delay_wgrad_config_validation."""
    assert DELAY.validate(minimal_moe(), DDPConfig(overlap_grad_reduce=False), env()) == []


def test_delay_wgrad_config_validation_with_overlap_grad_reduce():
    """Mirrors test_delay_wgrad_config_validation_with_overlap_grad_reduce (TE >= 2.7 given)."""
    model = minimal_moe(gradient_accumulation_fusion=True)
    assert DELAY.validate(model, DDPConfig(overlap_grad_reduce=True), env()) == []
    old_te = rules_of(DELAY.validate(model, DDPConfig(overlap_grad_reduce=True), env(te="2.6.0")), "error")
    assert old_te == {"delay_te_grad_reduce", "delay_te_grad_accum"}


def test_delay_wgrad_requires_ep_overlap():
    """Mirrors test_delay_wgrad_requires_ep_overlap."""
    cfg = CommOverlapConfig(overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=True)
    assert rules_of(cfg.validate(minimal_moe(), DDPConfig(), env()), "error") == {"delay_needs_overlap"}


# Upstream's cases leave cuda_graph_impl at "none" and set the modules the 0.18+ way (`cuda_graph_modules`,
# as upstream's set_cuda_graph_modules does). Bridge's checks read the modules whatever the implementation,
# and in a real run they run first: runtime_config_update calls comm_overlap.setup (these checks) before
# cfg.validate(), which is where the modules of a "none" config are cleared.
def _attn_graph(impl: str = "none", **changes):
    model = SimpleNamespace(**vars(minimal_moe(cuda_graph_impl=impl, **changes)))
    model.cuda_graph_modules, model.cuda_graph_scope = ["attn"], None
    return model


def test_delay_wgrad_cuda_graph_attn_requires_grad_accum_fusion():
    """Mirrors test_delay_wgrad_cuda_graph_attn_requires_grad_accum_fusion."""
    model = _attn_graph(add_qkv_bias=False, gradient_accumulation_fusion=False)
    assert rules_of(DELAY.validate(model, DDPConfig(), env()), "error") == {"delay_graph_grad_accum"}


def test_delay_wgrad_cuda_graph_attn_rejects_attention_bias():
    """Mirrors test_delay_wgrad_cuda_graph_attn_rejects_attention_bias."""
    model = _attn_graph(add_bias_linear=True, gradient_accumulation_fusion=True)
    assert rules_of(DELAY.validate(model, DDPConfig(), env()), "error") == {"delay_graph_attn_bias"}


def test_delay_wgrad_cuda_graph_attn_validation_passes_with_supported_settings():
    """Mirrors test_delay_wgrad_cuda_graph_attn_validation_passes_with_supported_settings."""
    model = _attn_graph(add_qkv_bias=False, gradient_accumulation_fusion=True)
    assert DELAY.validate(model, DDPConfig(), env()) == []


@pytest.mark.parametrize("impl", ["none", "transformer_engine"])
def test_delay_wgrad_graph_checks_ignore_the_implementation(impl):
    """has_cuda_graph_module reads the modules whatever cuda_graph_impl says: old TE fails either way."""
    model = _attn_graph(impl, gradient_accumulation_fusion=True)
    assert "delay_graph_te" in rules_of(DELAY.validate(model, DDPConfig(), env(te="2.11.0")), "error")


# ---- CUDA-graph modules on real TransformerConfig objects, written both ways (core 0.18 moved the field) ----


def _real_config_with_scope(scope: list[str]):
    """A real installed-release TransformerConfig whose graph scope is set the pre-0.18 way."""
    import_or_skip("megatron.core", "megatron_core")
    real = good_model(num_moe_experts=8).to_transformer_config()
    real.cuda_graph_impl = "transformer_engine"
    real.cuda_graph_scope = list(scope)
    return real


def _moved_to_modules(real):
    """The same object as a 0.18+ `__post_init__` leaves it: modules in the new field, the old one cleared."""
    real.cuda_graph_modules, real.cuda_graph_scope = list(real.cuda_graph_scope), None
    return real


@pytest.mark.parametrize("written", ["cuda_graph_scope", "cuda_graph_modules"])
@pytest.mark.parametrize("mcore", ["0.18.0", "0.19.0", UPSTREAM_CORE])
def test_graph_rules_read_both_fields(written, mcore):
    """Mirrors upstream's utils/cuda_graph.py has_cuda_graph_module: the delayed-wgrad graph rules and the
    overlap graph rule fire whichever field holds the modules."""
    attn = _real_config_with_scope(["attn"])
    moe = _real_config_with_scope(["moe"])
    if written == "cuda_graph_modules":
        attn, moe = _moved_to_modules(attn), _moved_to_modules(moe)
    assert "delay_graph_grad_accum" in rules_of(DELAY.validate(attn, DDPConfig(), env(mcore=mcore)), "error")
    assert "cuda_graph_moe" in rules_of(OVERLAP.validate(moe, DDPConfig(), env(mcore=mcore)), "error")


@pytest.mark.parametrize(("mcore", "impl", "rejected"), [
    ("0.15.0", "local", False), ("0.16.1", "local", True), ("0.17.0", "local", True), ("0.18.0", "local", False),
    (UPSTREAM_CORE, "local", False), (UPSTREAM_CORE, "full_iteration", False), ("0.17.0", "full_iteration", True),
])
def test_cuda_graph_impl_with_overlap_by_core_release(mcore, impl, rejected):
    """transformer_layer/TransformerConfig history: 0.16-0.17 accept only transformer_engine graphs with
    overlap; 0.18 lifts it and adds the full_iteration implementation. (A local graph is the full iteration's:
    Megatron-Bridge runs no other, see below.)"""
    scope = ["full_iteration"] if impl == "local" else []
    model = minimal_moe(cuda_graph_impl=impl, cuda_graph_scope=scope)
    errors = rules_of(OVERLAP.validate(model, DDPConfig(), env(mcore=mcore)), "error")
    assert bool(errors) is rejected, errors


@pytest.mark.parametrize("bridge", ["0.6.2", "main"])
@pytest.mark.parametrize("mcore", ["0.15.0", "0.18.0", UPSTREAM_CORE])
def test_local_graphs_only_for_the_full_iteration(mcore, bridge):
    """utils/cuda_graph.py validate_cuda_graph_configuration: local graphs of modules raise in Bridge's config
    validation whatever the core release and the overlap."""
    off = CommOverlapConfig(overlap_moe_expert_parallel_comm=False)
    scoped = minimal_moe(cuda_graph_impl="local", cuda_graph_scope=["attn"])
    assert rules_of(off.validate(scoped, DDPConfig(), env(mcore=mcore, bridge=bridge)), "error") == {
        "cuda_graph_local_scoped"}
    whole = minimal_moe(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])
    assert off.validate(whole, DDPConfig(), env(mcore=mcore, bridge=bridge)) == []


def test_full_iteration_scope_stands_alone():
    """The perf script: "full_iteration CUDA graph scope cannot be combined with other scopes", nor with
    transformer_engine graphs."""
    off = CommOverlapConfig(overlap_moe_expert_parallel_comm=False)
    for impl, scope in (("local", ["full_iteration", "attn"]), ("transformer_engine", ["full_iteration"])):
        model = minimal_moe(cuda_graph_impl=impl, cuda_graph_scope=scope)
        assert "cuda_graph_full_iteration_mixed" in rules_of(off.validate(model, DDPConfig(), env()), "error")


@pytest.mark.parametrize("impl", ["local", "transformer_engine", "full_iteration"])
def test_any_graph_needs_the_te_rng_tracker(impl):
    """GPTModelProvider.provide asserts use_te_rng_tracker with any CUDA graph (run_script.py switches it on)."""
    off = CommOverlapConfig(overlap_moe_expert_parallel_comm=False)
    scope = ["full_iteration"] if impl == "local" else ["attn"] if impl == "transformer_engine" else []
    model = minimal_moe(cuda_graph_impl=impl, cuda_graph_scope=scope, use_te_rng_tracker=False)
    assert rules_of(off.validate(model, DDPConfig(), env()), "error") == {"cuda_graph_rng_tracker"}
    model.use_te_rng_tracker = True
    assert off.validate(model, DDPConfig(), env()) == []


@pytest.mark.parametrize(("mcore", "rejected"), [("0.15.0", False), ("0.16.1", True), (UPSTREAM_CORE, True)])
def test_whole_layer_te_graph_with_overlap_is_caught_before_launch(mcore, rejected):
    """TransformerConfig accepts it; transformer_layer.py fails at build time ("EP overlap must be disabled
    when CUDA graph captures the whole MLP/MoE part"), from 0.16 (0.15's layer has no such assertion)."""
    model = minimal_moe(cuda_graph_impl="transformer_engine", cuda_graph_scope=[])
    expected = {"cuda_graph_whole_layer"} if rejected else set()
    assert rules_of(OVERLAP.validate(model, DDPConfig(), env(mcore=mcore)), "error") == expected


@pytest.mark.parametrize(("mcore", "rejected"), [("0.15.0", True), ("0.16.1", True), ("0.17.0", False),
                                                 (UPSTREAM_CORE, False)])
def test_legacy_grouped_gemm_with_delay_by_core_release(mcore, rejected):
    model = minimal_moe(moe_use_legacy_grouped_gemm=True)
    assert bool(rules_of(DELAY.validate(model, DDPConfig(), env(mcore=mcore)), "error")) is rejected


# ---- test_deepep.py ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_apply_flex_dispatcher_backend_sets_configs_for_moe_model(gpu):
    """Mirrors test_apply_flex_dispatcher_backend_sets_configs_for_moe_model_on_ampere / _on_hopper, with
    upstream's keyword."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend=None,
                            moe_shared_expert_overlap=True)
    apply_flex_dispatcher_backend(model, moe_flex_dispatcher_backend="deepep", env=env(gpu=gpu))
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", "deepep")
    assert model.moe_shared_expert_overlap is False


def test_apply_flex_dispatcher_backend_overrides_existing_configs_for_moe_model():
    """Mirrors test_apply_flex_dispatcher_backend_overrides_existing_configs_for_moe_model."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="allgather",
                            moe_flex_dispatcher_backend="hybridep", moe_shared_expert_overlap=True)
    apply_flex_dispatcher_backend(model, "deepep", env=env())
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", "deepep")


def test_apply_flex_dispatcher_backend_preserves_cuda_probe_errors(monkeypatch):
    """Mirrors test_apply_flex_dispatcher_backend_preserves_cuda_probe_errors. Fake (no GPU here): CUDA reports
    itself available and the device query fails, as a broken driver does."""
    import torch

    def broken(*_args, **_kwargs):
        raise RuntimeError("CUDA initialization failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    detected = Environment.detect()
    assert detected.gpu_probe_error and "CUDA initialization failed" in detected.gpu_probe_error
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall")
    with pytest.raises(GpuProbeError, match="CUDA probe.*CUDA initialization failed"):
        apply_flex_dispatcher_backend(model, moe_flex_dispatcher_backend="deepep")
    assert model.moe_token_dispatcher_type == "alltoall"  # never switched unchecked
    with pytest.raises(GpuProbeError, match=r"CUDA probe.*CUDA initialization failed; fix the CUDA setup.*-g/--gpu"):
        validate_flex_dispatcher_backend(SimpleNamespace(moe_token_dispatcher_type="flex",
                                                         moe_flex_dispatcher_backend="deepep"))
    violations = CommOverlapConfig().validate(good_model(moe_token_dispatcher_type="flex",
                                                         moe_flex_dispatcher_backend="deepep"), None, detected)
    assert [(v.rule, v.severity) for v in violations] == [("flex_backend_gpu", "error")]


@pytest.mark.parametrize("experts", [None, 0])
def test_apply_flex_dispatcher_backend_warns_for_non_moe_model(experts):
    """Mirrors test_apply_flex_dispatcher_backend_warns_for_non_moe_model_none_experts / _zero_experts."""
    model = SimpleNamespace(num_moe_experts=experts, moe_token_dispatcher_type="alltoall")
    with pytest.warns(FlexDispatcherWarning, match="without experts"):
        apply_flex_dispatcher_backend(model, moe_flex_dispatcher_backend="deepep", env=env())
    assert model.moe_token_dispatcher_type == "alltoall"


def test_one_expert_is_not_skipped():
    """Upstream skips only None and 0 experts; one expert goes through the GPU check."""
    model = SimpleNamespace(num_moe_experts=1, moe_token_dispatcher_type="alltoall")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_flex_dispatcher_backend(model, "deepep", env=env())
    assert model.moe_token_dispatcher_type == "flex"


@pytest.mark.parametrize("capability", [(7, 0), (6, 0)], ids=["volta", "pascal"])
def test_apply_flex_dispatcher_backend_warns_for_unsupported_gpu(capability):
    """Mirrors test_apply_flex_dispatcher_backend_warns_for_unsupported_gpu_volta / _pascal."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend=None,
                            moe_shared_expert_overlap=True)
    with pytest.warns(FlexDispatcherWarning, match="falling back to the alltoall"):
        apply_flex_dispatcher_backend(model, "deepep",
                                      env=Environment(gpu_name="NVIDIA Tesla", compute_capability=capability))
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("alltoall", None)
    assert model.moe_shared_expert_overlap is True


def test_none_backend_override_falls_back_to_alltoall():
    """Mirrors TestFlexDispatcherFallback.test_none_backend_override_falls_back_to_alltoall."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend=None,
                            moe_shared_expert_overlap=True)
    apply_flex_dispatcher_backend(model, moe_flex_dispatcher_backend="deepep", env=env())
    model.moe_flex_dispatcher_backend = None
    validate_flex_dispatcher_backend(model, env())
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("alltoall", None)


def test_none_backend_is_an_error_before_launch_on_bridge_06():
    """Megatron-Bridge 0.6.2 has no fallback (#5740 is main only): the job would stop at model build."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=None)
    with pytest.raises(ValueError, match="Invalid backend: None"):
        validate_flex_dispatcher_backend(model, env(bridge="0.6.2"))
    assert model.moe_token_dispatcher_type == "flex"
    violations = CommOverlapConfig().validate(good_model(moe_token_dispatcher_type="flex"), None, env(bridge="0.6.2"))
    assert [(v.rule, v.severity) for v in violations] == [("flex_without_backend", "error")]
    violations = CommOverlapConfig().validate(good_model(moe_token_dispatcher_type="flex"), None, env())
    assert [(v.rule, v.severity) for v in violations] == [("flex_without_backend", "warning")]


@pytest.mark.parametrize(("backend", "gpu_env"), [
    ("deepep", Environment.for_gpu("gb200")),
    ("hybridep", Environment(gpu_name="NVIDIA X200", compute_capability=(11, 0))),
], ids=["deepep-gb200", "hybridep-unsupported"])
def test_unsupported_backend_falls_back_to_alltoall(backend, gpu_env):
    """Mirrors TestFlexDispatcherFallback.test_unsupported_backend_falls_back_to_alltoall."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall",
                            moe_flex_dispatcher_backend=backend, moe_shared_expert_overlap=True)
    with pytest.warns(FlexDispatcherWarning):
        apply_flex_dispatcher_backend(model, moe_flex_dispatcher_backend=backend, env=gpu_env)
    validate_flex_dispatcher_backend(model, gpu_env)
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("alltoall", None)
    assert model.moe_shared_expert_overlap is True


@pytest.mark.parametrize(("backend", "gpu", "ok"), [
    ("deepep", "a100", True), ("deepep", "h100", True), ("deepep", "b200", True), ("deepep", "gb200", False),
    ("hybridep", "gb200", True), ("hybridep", "gb300", True), ("hybridep", "h100", True),
])
def test_validate_flex_dispatcher_backend(backend, gpu, ok):
    """Mirrors TestValidateDeepEP / TestValidateHybridEP (ampere/hopper pass, unsupported raises)."""
    model = SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
    if ok:
        validate_flex_dispatcher_backend(model, Environment.for_gpu(gpu))
    else:
        with pytest.raises(ValueError, match="does not support"):
            validate_flex_dispatcher_backend(model, Environment.for_gpu(gpu))


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_validate_flex_dispatcher_backend_future_gpu_raises_error(backend):
    """Mirrors test_validate_flex_dispatcher_backend_future_gpu_raises_error (DeepEP and HybridEP)."""
    model = SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
    with pytest.raises(ValueError, match="does not support NVIDIA Future GPU"):
        validate_flex_dispatcher_backend(model, Environment(gpu_name="NVIDIA Future GPU", compute_capability=(200, 0)))


def test_validate_flex_dispatcher_backend_disabled_no_validation():
    """Mirrors test_validate_flex_dispatcher_backend_disabled_no_validation."""
    model = SimpleNamespace(moe_token_dispatcher_type="alltoall")
    validate_flex_dispatcher_backend(model, Environment.for_gpu("gb200"))
    assert model.moe_token_dispatcher_type == "alltoall"


def test_apply_without_cuda_sets_flex_unchecked():
    """Upstream: no CUDA (a recipe built on a CPU machine) sets flex without probing."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall")
    apply_flex_dispatcher_backend(model, moe_flex_dispatcher_backend="hybridep", env=Environment(torch_version="2.13"))
    assert (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend) == ("flex", "hybridep")


# ---- the 0.6.2 wheel's NCCL EP gate (flex_dispatcher_backend.py: Hopper and Blackwell) ---------------------


@pytest.mark.parametrize(("gpu", "ok"), [("h100", True), ("h200", True), ("b200", True), ("gb200", True),
                                         ("gb300", True), ("a100", False), ("l40s", False)])
def test_ncclep_is_gated_to_hopper_and_blackwell(gpu, ok):
    """validate_flex_dispatcher_backend raises "NCCL EP is supported for Hopper and Blackwell GPUs" elsewhere;
    apply_flex_dispatcher_backend warns and falls back."""
    bridge = env(gpu=gpu, bridge="0.6.2")
    model = SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep")
    applied = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True)
    if ok:
        validate_flex_dispatcher_backend(model, bridge)
        apply_flex_dispatcher_backend(applied, "ncclep", env=bridge)
        assert (applied.moe_token_dispatcher_type, applied.moe_flex_dispatcher_backend) == ("flex", "ncclep")
    else:
        with pytest.raises(ValueError, match="Hopper and Blackwell"):
            validate_flex_dispatcher_backend(model, bridge)
        with pytest.warns(FlexDispatcherWarning, match="falling back"):
            apply_flex_dispatcher_backend(applied, "ncclep", env=bridge)
        assert (applied.moe_token_dispatcher_type, applied.moe_flex_dispatcher_backend) == ("alltoall", None)
    model_cfg = good_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep")
    assert bool(rules_of(CommOverlapConfig().validate(model_cfg, None, bridge), "error")) is not ok


def test_ncclep_is_not_a_backend_on_bridge_main():
    """Megatron-Bridge main (067f987) warns "Not a valid flex dispatcher backend" and leaves the dispatcher."""
    model = SimpleNamespace(num_moe_experts=8, moe_token_dispatcher_type="alltoall")
    with pytest.warns(FlexDispatcherWarning, match="not one of deepep, hybridep"):
        apply_flex_dispatcher_backend(model, "ncclep", env=env())
    assert model.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize(("mcore", "rejected"), [("0.18.0", True), ("0.19.0", False), (UPSTREAM_CORE, False)])
def test_ncclep_needs_core_019(mcore, rejected):
    model = good_model(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep")
    errors = rules_of(CommOverlapConfig().validate(model, None, env(mcore=mcore, bridge="0.6.2")), "error")
    assert errors == ({"flex_backend_gpu"} if rejected else set())


def test_ncclep_overlap_rejects_expert_fc1_offload():
    """Megatron-Core 0.19 TransformerConfig: "overlap_moe_expert_parallel_comm with ncclep does not support
    offloading 'expert_fc1'"; other modules, or no fine-grained offloading, pass."""
    bridge = env(bridge="0.6.2")
    model = minimal_moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep",
                        fine_grained_activation_offloading=True, offload_modules=["expert_fc1", "moe_act"])
    assert rules_of(OVERLAP.validate(model, DDPConfig(), bridge), "error") == {"ncclep_offload_expert_fc1"}
    model.offload_modules = ["moe_act"]
    assert OVERLAP.validate(model, DDPConfig(), bridge) == []
    model.offload_modules, model.fine_grained_activation_offloading = ["expert_fc1"], False
    assert OVERLAP.validate(model, DDPConfig(), bridge) == []
    model.fine_grained_activation_offloading = True
    assert OVERLAP.validate(model, DDPConfig(), env(mcore="0.18.0", bridge="0.6.2")) != []  # ncclep unknown there
    assert "ncclep_offload_expert_fc1" not in rules_of(OVERLAP.validate(model, DDPConfig(),
                                                                         env(mcore="0.18.0", bridge="0.6.2")))


def test_ncclep_names_the_flex_dispatcher():
    """Megatron-Core 0.19: "moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'"."""
    model = good_model(moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend="ncclep")
    assert rules_of(CommOverlapConfig().validate(model, None, env(bridge="0.6.2")), "error") == {"ncclep_needs_flex"}
    assert CommOverlapConfig().validate(model, None, env(mcore="0.18.0", bridge="0.6.2")) == []


# ---- Megatron-FSDP with EP overlap (Megatron-Core distributed/fsdp/mcore_fsdp_adapter.py, 0.18+) -----------


def _fsdp(**changes) -> DDPConfig:
    ddp = DDPConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    for name, value in changes.items():
        setattr(ddp, name, value)
    return ddp


@pytest.mark.parametrize(("mcore", "checked"), [("0.17.0", False), ("0.18.0", True), (UPSTREAM_CORE, True)])
def test_fsdp_with_overlap_rejects_double_buffer_and_per_layer_graphs(mcore, checked):
    double = OVERLAP.validate(minimal_moe(), _fsdp(fsdp_double_buffer=True), env(mcore=mcore))
    assert rules_of(double, "error") == ({"fsdp_double_buffer"} if checked else set())
    graphs = minimal_moe(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "moe_router"])
    assert rules_of(OVERLAP.validate(graphs, _fsdp(), env(mcore=mcore)), "error") == (
        {"fsdp_cuda_graph"} if checked else set())


def test_fsdp_with_overlap_accepts_no_graphs_or_the_full_iteration():
    assert OVERLAP.validate(minimal_moe(), _fsdp(), env()) == []
    assert OVERLAP.validate(minimal_moe(cuda_graph_impl="full_iteration"), _fsdp(), env()) == []
    off = CommOverlapConfig(overlap_moe_expert_parallel_comm=False)
    assert off.validate(minimal_moe(), _fsdp(fsdp_double_buffer=True), env()) == []


@pytest.mark.parametrize(("te", "rejected"), [("2.2.0", True), ("2.3.0", False), (None, True)])
def test_dispatch_wgrad_overlap_needs_te_23(te, rejected):
    """TransformerConfig 0.18+: "TE version >= 2.3.0 is required for overlap_dispatch_backward_with_experts_wgrad"."""
    off = CommOverlapConfig(overlap_moe_expert_parallel_comm=False)
    model = minimal_moe(overlap_dispatch_backward_with_experts_wgrad=True)
    errors = rules_of(off.validate(model, DDPConfig(), env(te=te)), "error")
    assert errors == ({"dispatch_wgrad_overlap_te"} if rejected else set())
    assert off.validate(model, DDPConfig(), env(te="2.2.0", mcore="0.17.0")) == []
