"""CommOverlapConfig validation: every rule failing and passing, combinations, versions, finalize."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mbridge_epoverlap.config import CommOverlapConfig, ConfigValidationError, Environment, Violation
from mbridge_epoverlap.config.rules import all_rules
from tests.unit_tests.requirements import import_or_skip
from tests.unit_tests.training.conftest import good_model, h100, rules_of

REQUIRED_RULE_IDS = {
    "ep_size", "num_experts", "dispatcher", "precision", "torch_version", "pp_needs_vpp", "recompute_full",
    "recompute_method", "recompute_layers", "recompute_moe", "shared_expert_overlap", "mtp_layers", "cuda_graph_moe",
    "delay_needs_overlap", "delay_te_grad_reduce", "delay_te_grad_accum", "delay_graph_te", "delay_graph_grad_accum",
    "delay_graph_attn_bias",
}

# rule id -> (model changes, environment) that break exactly that rule on the good config.
BREAKERS = {
    "ep_size": (dict(expert_model_parallel_size=1), h100()),
    "num_experts": (dict(num_moe_experts=1, expert_model_parallel_size=2), h100()),
    "dispatcher": (dict(moe_token_dispatcher_type="allgather"), h100()),
    "precision": (dict(bf16=False, fp16=False), h100()),
    "torch_version": ({}, h100(torch_version="2.5.1")),
    "pp_needs_vpp": (dict(pipeline_model_parallel_size=2), h100()),
    "recompute_full": (dict(recompute_granularity="full"), h100()),
    "recompute_method": (dict(recompute_method="uniform"), h100()),
    "recompute_layers": (dict(recompute_num_layers=2), h100()),
    "recompute_moe": (dict(recompute_granularity="selective", recompute_modules=["moe", "core_attn"]),
                      h100(mcore="0.17.0")),
    "shared_expert_overlap": (dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True), h100()),
    "mtp_layers": (dict(mtp_num_layers=2), h100()),
    "cuda_graph_moe": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe"]), h100()),
    "cuda_graph_local": (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), h100()),
    "delay_te_grad_accum": (dict(gradient_accumulation_fusion=True), h100(te="2.6.0")),
    "delay_cuda_graph_te": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router"]),
                            h100(te="2.9.0")),
    "delay_graph_te": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"],
                            gradient_accumulation_fusion=True), h100(te="2.11.0")),
    "delay_graph_grad_accum": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]), h100()),
    "delay_graph_attn_bias": (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"],
                                   gradient_accumulation_fusion=True, add_qkv_bias=True), h100()),
    "delay_legacy_grouped_gemm": (dict(moe_use_legacy_grouped_gemm=True), h100()),
    "ep_divides_experts": (dict(num_moe_experts=12), h100()),
    "flex_backend_gpu": (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"),
                         Environment.for_gpu("gb200", te_version="2.12", torch_version="2.8")),
}


def test_registry_has_every_documented_rule_once():
    ids = [r.id for r in all_rules()]
    assert len(ids) == len(set(ids))
    assert REQUIRED_RULE_IDS <= set(ids)
    assert all(r.summary and r.source and r.when in ("overlap", "delay_wgrad", "always", "layout")
               and r.symptom and r.cause and r.where and r.example for r in all_rules())


def test_good_config_passes_every_rule(overlap_on, ddp):
    assert overlap_on.validate(good_model(), ddp, h100()) == []


@pytest.mark.parametrize("rule_id", sorted(BREAKERS))
def test_each_rule_fails_alone_with_a_fix(rule_id, overlap_on, ddp):
    changes, env = BREAKERS[rule_id]
    if rule_id == "delay_te_grad_accum":
        ddp = None  # with overlap_grad_reduce the old TE also breaks delay_te_grad_reduce
    violations = overlap_on.validate(good_model(**changes), ddp, env)
    assert rules_of(violations, "error") == {rule_id}
    (violation,) = violations
    assert isinstance(violation, Violation)
    assert violation.message and violation.fix
    assert "<" not in violation.fix.replace("<=", ""), "fixes are pasteable, not templates"


def test_delay_te_grad_reduce_follows_ddp_and_comm_overlap(overlap_on, ddp):
    """Megatron-Bridge reads `ddp.overlap_grad_reduce or comm_overlap.overlap_grad_reduce`: either on asks for
    TE >= 2.7, even when comm_overlap's False will later override DDP's True."""
    old_te = h100(te="2.6.0")
    assert rules_of(overlap_on.validate(good_model(), ddp, old_te)) == {"delay_te_grad_reduce"}
    assert overlap_on.validate(good_model(), None, old_te) == []
    overlap_on.overlap_grad_reduce = False
    assert rules_of(overlap_on.validate(good_model(), ddp, old_te)) == {"delay_te_grad_reduce"}
    overlap_on.overlap_grad_reduce = True
    assert rules_of(overlap_on.validate(good_model(), None, old_te)) == {"delay_te_grad_reduce"}


def test_te_not_installed_counts_as_too_old(overlap_on, ddp):
    assert "delay_te_grad_reduce" in rules_of(overlap_on.validate(good_model(), ddp, h100(te=None)))


def test_delay_needs_overlap(ddp):
    cfg = CommOverlapConfig(overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=True)
    assert rules_of(cfg.validate(good_model(), ddp, h100())) == {"delay_needs_overlap"}


def test_overlap_rules_skip_when_overlap_off(ddp):
    cfg = CommOverlapConfig(overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False)
    broken = good_model(expert_model_parallel_size=1, bf16=False, recompute_granularity="full", mtp_num_layers=3)
    assert cfg.validate(broken, ddp, h100()) == []


def test_all_violations_reported_at_once(overlap_on, ddp):
    broken = good_model(expert_model_parallel_size=1, bf16=False, moe_token_dispatcher_type="allgather",
                        pipeline_model_parallel_size=2, recompute_granularity="full", recompute_method="block",
                        recompute_num_layers=1, mtp_num_layers=3, gradient_accumulation_fusion=True)
    errors = rules_of(overlap_on.validate(broken, ddp, h100(te="2.6.0", torch_version="2.4.0")), "error")
    assert errors == {"ep_size", "dispatcher", "precision", "torch_version", "pp_needs_vpp", "recompute_full",
                      "recompute_method", "recompute_layers", "mtp_layers", "delay_te_grad_reduce",
                      "delay_te_grad_accum"}


def test_wgrad_in_graph_via_router_with_unoverlapped_shared_expert(overlap_on, ddp):
    model = good_model(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router", "moe_preprocess"],
                       moe_shared_expert_intermediate_size=64)
    assert rules_of(overlap_on.validate(model, ddp, h100(te="2.11.0"))) == {"delay_graph_te", "delay_graph_grad_accum"}
    model.moe_shared_expert_intermediate_size = None  # no shared expert: the router graph holds no weights
    assert overlap_on.validate(model, ddp, h100(te="2.11.0")) == []


@pytest.mark.parametrize("mcore", ["0.15.2", "0.16.1", "0.17.0", "0.19.0", "0.20.0", None])
def test_recompute_moe_is_an_error_whatever_the_core_version(mcore, overlap_on, ddp):
    """Megatron-Bridge rejects "moe" in recompute_modules with overlap itself, on every core release."""
    model = good_model(recompute_granularity="selective", recompute_modules=["moe"])
    (violation,) = overlap_on.validate(model, ddp, h100(mcore=mcore))
    assert (violation.rule, violation.severity) == ("recompute_moe", "error")
    assert violation.fix == "model.recompute_modules=null"


@pytest.mark.parametrize(("mcore", "rejected"), [("0.15.0", False), ("0.16.1", True), ("0.17.3", True),
                                                 ("0.18.0", False), ("0.19.0", False), ("0.20.0", False),
                                                 (None, False)])
def test_mtp_one_needs_pp_by_core_version(mcore, rejected, overlap_on, ddp):
    violations = overlap_on.validate(good_model(mtp_num_layers=1), ddp, h100(mcore=mcore))
    assert [(v.rule, v.severity) for v in violations] == ([("mtp_layers", "error")] if rejected else [])
    with_pp = good_model(mtp_num_layers=1, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert overlap_on.validate(with_pp, ddp, h100(mcore=mcore)) == []


@pytest.mark.parametrize(("mcore", "zero_ok"), [("0.16.1", False), ("0.18.0", False), ("0.19.0", True), (None, True)])
def test_mtp_zero_allowed_from_019(mcore, zero_ok, overlap_on, ddp):
    errors = rules_of(overlap_on.validate(good_model(mtp_num_layers=0), ddp, h100(mcore=mcore)), "error")
    assert (errors == set()) is zero_ok


@pytest.mark.parametrize(("mcore", "severity"), [("0.15.0", "warning"), ("0.16.0", "error"), (None, "error")])
def test_delay_with_te_graphs_needs_te_210_from_core_016(mcore, severity, overlap_on, ddp):
    model = good_model(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router"])
    violations = overlap_on.validate(model, ddp, h100(te="2.9.0", mcore=mcore))
    assert [(v.rule, v.severity) for v in violations] == [("delay_cuda_graph_te", severity)]


@pytest.mark.parametrize("scope", ["attn,moe", ["attn", "moe"], [SimpleNamespace(name="attn"),
                                                                   SimpleNamespace(name="moe")]],
                         ids=["string", "names", "enum-like"])
def test_graph_scope_spellings(overlap_on, ddp, scope):
    model = SimpleNamespace(**vars(good_model(cuda_graph_impl="transformer_engine",
                                              gradient_accumulation_fusion=True)))
    model.cuda_graph_scope = scope
    assert "cuda_graph_moe" in rules_of(overlap_on.validate(model, ddp, h100()))


def test_absent_attributes_take_megatron_core_defaults(ddp):
    """A bare namespace: core defaults are EP=1, allgather, fp32, no experts -> those rules fire."""
    cfg = CommOverlapConfig(overlap_moe_expert_parallel_comm=True)
    assert rules_of(cfg.validate(SimpleNamespace(), ddp, h100())) == {"ep_size", "num_experts", "dispatcher",
                                                                       "precision"}


def test_dict_model_config(overlap_on, ddp):
    assert overlap_on.validate(vars(good_model()).copy(), ddp, h100()) == []


def test_none_switches_are_off_as_in_megatron_bridge(ddp):
    """Megatron-Bridge writes False onto the model for an unset comm_overlap switch: the overlap checks do not
    fire, and the user whose model-level switch is overwritten is told which comm_overlap key to set."""
    model = good_model(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=False, expert_model_parallel_size=1)
    unset = CommOverlapConfig()
    assert unset.effective_overlap(model) is False and unset.effective_delay_wgrad(model) is False
    (warning,) = unset.validate(model, ddp, h100())
    assert (warning.rule, warning.severity) == ("model_switch_overwritten", "warning")
    assert "comm_overlap.overlap_moe_expert_parallel_comm=true" in warning.fix
    assert CommOverlapConfig(overlap_moe_expert_parallel_comm=False).validate(model, ddp, h100()) == []
    assert rules_of(CommOverlapConfig(overlap_moe_expert_parallel_comm=True).validate(model, ddp, h100())) == {
        "ep_size"}
    unset.finalize(model, ddp, h100())
    assert (model.overlap_moe_expert_parallel_comm, model.delay_wgrad_compute) == (False, False)


def test_both_overwritten_switches_are_named(ddp):
    model = good_model(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    (warning,) = CommOverlapConfig().validate(model, ddp, h100())
    assert warning.fix == ("comm_overlap.overlap_moe_expert_parallel_comm=true comm_overlap.delay_wgrad_compute=true, "
                           "or model.overlap_moe_expert_parallel_comm=false model.delay_wgrad_compute=false")
    set_delay = CommOverlapConfig(delay_wgrad_compute=False)
    assert "delay_wgrad_compute" not in set_delay.validate(model, ddp, h100())[0].message


def test_finalize_raises_with_every_error_and_writes_switches(overlap_on, ddp):
    with pytest.raises(ConfigValidationError, match=r"^2 EP-overlap configuration error\(s\):") as info:
        overlap_on.finalize(good_model(expert_model_parallel_size=1, bf16=False), ddp, h100())
    assert isinstance(info.value, ValueError)
    assert {v.rule for v in info.value.violations} == {"ep_size", "precision"}
    assert "ep_size" in str(info.value) and "precision" in str(info.value)
    model = good_model(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe_router"])
    warnings_found = overlap_on.finalize(model, ddp, h100(te="2.9.0", mcore="0.15.0"))
    assert [w.rule for w in warnings_found] == ["delay_cuda_graph_te"]
    assert model.overlap_moe_expert_parallel_comm is True and model.delay_wgrad_compute is True


def test_finalize_works_on_a_real_transformer_config(ddp):
    """The validated config builds a real Megatron-Core TransformerConfig, which the validator reads back."""
    import_or_skip("megatron.core", "megatron_core")
    model = good_model()
    CommOverlapConfig(overlap_moe_expert_parallel_comm=True).finalize(model, ddp, h100())
    real = model.to_transformer_config()
    assert real.overlap_moe_expert_parallel_comm is True
    overlap = CommOverlapConfig(overlap_moe_expert_parallel_comm=True)
    assert overlap.validate(real, ddp, h100()) == []
    real.expert_model_parallel_size = 1
    assert rules_of(overlap.validate(real, ddp, h100())) == {"ep_size"}


def test_environment_versions_and_catalog():
    env = Environment.for_gpu("B200", te_version="2.10.0rc1")
    assert env.compute_capability == (10, 0) and env.gpu_name.startswith("NVIDIA B200")
    with pytest.raises(ValueError, match="unknown GPU 'v100'.*known: a100"):
        Environment.for_gpu("v100")
    with pytest.raises(ValueError, match="te_version"):
        Environment(te_version="two point nine")
    detected = Environment.detect()
    assert detected.torch_version is not None and detected.te_version is None  # CPU machine without TE


@pytest.mark.parametrize(("version", "minimum", "expected"), [
    ("2.12", "2.12.0", True), ("2.12.0", "2.12", True), ("2.12.0rc1", "2.12.0", True), ("2.12.0+cu12", "2.12.0", True),
    ("2.11.9", "2.12.0", False), ("2.9", "2.10.0", False), ("3", "2.12.0", True), (None, "2.7.0", False)])
def test_versions_compare_as_releases(version, minimum, expected):
    """`--te_version 2.12` is TE 2.12.0: a release written with fewer parts is the same release."""
    from mbridge_epoverlap.config.environment import version_at_least

    assert version_at_least(version, minimum) is expected


@pytest.mark.parametrize("name", ["a100", "h100", "h200", "h20", "l40s", "b200", "b300", "gb200", "gb300", "vr200",
                                  "r100", "H100"])
def test_every_catalog_gpu_is_a_gpu(name):
    assert Environment.for_gpu(name).has_gpu
