"""The rules of Megatron-Bridge main and Megatron-Core main (0.20), the fields they read, and release names.

Each new rule must fire alone on a config that passes everything else, name its setting, its fix and its upstream
file and pull request; the releases that lack it must not run it; fields a job's release does not have and release
names the validator does not know are usage errors (exit 2) that name the releases.
"""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from mbridge_epoverlap.config import CommOverlapConfig, Environment
from mbridge_epoverlap.config.container import DatasetConfig, DDPConfig, RunConfig
from mbridge_epoverlap.config.release_fields import release_field_problems
from mbridge_epoverlap.config.versions import bridge_rules, core_rules
from tests.unit_tests.training.conftest import good_model, rules_of

NCCLEP = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="ncclep")
FUSED = dict(use_transformer_engine_op_fuser=True, moe_grouped_gemm=True)
V2 = DDPConfig(use_megatron_fsdp=True, megatron_fsdp_version=2, data_parallel_sharding_strategy="optim_grads_params")


def env(bridge: str = "main", mcore: str = "0.20.0", gpu: str = "b200") -> Environment:
    return Environment.for_gpu(gpu, te_version="2.12.0", torch_version="2.8.0", mcore_version=mcore,
                               bridge_version=bridge)


def cli(*args: str) -> tuple[int, str, str]:
    """`mbridge-epoverlap ARGS` in process: (exit status, stdout, stderr)."""
    from mbridge_epoverlap.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


OFF = CommOverlapConfig(overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False)
# rule -> (switches, model changes, DDP config, the upstream pull request its message cites)
BREAKERS = {
    "rank_capacity_backend": (OFF, dict(moe_expert_rank_capacity_factor=1.5), None, None),
    "rank_capacity_hybridep_fuser": (OFF, dict(moe_token_dispatcher_type="flex",
                                               moe_flex_dispatcher_backend="hybridep",
                                               moe_expert_rank_capacity_factor=1.5), None, "#6000"),
    "ncclep_static_fused_gemm": (OFF, dict(**NCCLEP, moe_expert_rank_capacity_factor=1.5), None, "#6229"),
    "ncclep_zero_copy": (OFF, dict(**NCCLEP, **FUSED, moe_ncclep_zero_copy=True), None, "#6229"),
    "ncclep_drop_and_pad": (OFF, dict(**NCCLEP, moe_pad_expert_input_to_capacity=True,
                                      moe_expert_capacity_factor=1.0), None, "#6229"),
    "a2a_dtype_needs_ncclep": (OFF, dict(**FUSED, moe_dispatch_fwd_dtype="mxfp8"), None, "#6524"),
    "a2a_mxfp8_fused_gemm": (OFF, dict(**NCCLEP, moe_combine_bwd_dtype="mxfp8"), None, "#6524"),
    "ncclep_grouped_tensor_fuser": (OFF, dict(**NCCLEP, moe_use_grouped_tensor=True), None, "#6000"),
    "grouped_tensor_needs_grouped_gemm": (OFF, dict(moe_use_grouped_tensor=True, moe_grouped_gemm=False), None,
                                          "#6000"),
    "fsdp_v2_dp_only": (OFF, dict(num_moe_experts=None, expert_model_parallel_size=1, tensor_model_parallel_size=2),
                        V2, "#5395"),
    "fsdp_v2_moe": (OFF, dict(expert_model_parallel_size=1), V2, "#5395"),
    "fsdp_v2_cuda_graph": (OFF, dict(num_moe_experts=None, expert_model_parallel_size=1,
                                     cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]), V2, "#5395"),
}


@pytest.mark.parametrize("rule_id", sorted(BREAKERS))
def test_each_main_rule_fails_alone_naming_its_fix_and_upstream_pr(rule_id):
    switches, changes, ddp, pr = BREAKERS[rule_id]
    violations = switches.validate(good_model(**changes), ddp, env())
    assert rules_of(violations) == {rule_id}, [(v.rule, v.message) for v in violations]
    (violation,) = violations
    assert violation.severity == "error" and violation.fix
    if pr:
        assert pr in violation.message, violation.message


def test_main_only_rules_do_not_exist_on_0_6_or_0_19():
    """0.6.x behaves as before: the same configs, checked for 0.6.2 on 0.19, break none of main's rules."""
    main_only = {"fsdp_v2_moe", "packing_clears_overlap", "a2a_dtype_needs_ncclep", "ncclep_drop_and_pad",
                 "grouped_tensor_needs_grouped_gemm"}
    for rule_id, (switches, changes, ddp, _pr) in BREAKERS.items():
        found = rules_of(switches.validate(good_model(**changes), ddp, env("0.6.2", "0.19.2")))
        assert not found & main_only, (rule_id, found)


def test_fsdp_v2_refuses_delayed_wgrad_and_is_not_v1():
    """Megatron-Core main's v2 wrapper refuses delayed wgrad (#5865); the v1 EP-overlap checks are v1's only."""
    both = CommOverlapConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    ddp = DDPConfig(use_megatron_fsdp=True, megatron_fsdp_version=2, fsdp_double_buffer=True)
    found = rules_of(both.validate(good_model(), ddp, env()), "error")
    assert {"fsdp_v2_delay_wgrad", "fsdp_v2_moe", "fsdp_v2_dp_only"} <= found and "fsdp_double_buffer" not in found
    ddp.megatron_fsdp_version = 1
    assert rules_of(both.validate(good_model(), ddp, env()), "error") == {"fsdp_double_buffer"}


def test_native_packing_switches_overlap_off_on_main_only():
    """Megatron-Bridge main clears both switches for native Energon packing (#5285) and says so; the rules of
    overlap then do not apply (full recompute passes); 0.6.x keeps them as set."""
    both = CommOverlapConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    model = good_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    packed = DatasetConfig(packing_buffer_size=8)
    violations = both.validate(model, None, env(), dataset=packed)
    assert [(v.rule, v.severity) for v in violations] == [("packing_clears_overlap", "warning")]
    assert "#5285" in violations[0].message and "dataset.packing_buffer_size=null" in violations[0].fix
    assert both.effective_switches(model, env(), packed) == (False, False)
    assert both.finalize(model, None, env(), packed)[0].rule == "packing_clears_overlap"
    assert (model.overlap_moe_expert_parallel_comm, model.delay_wgrad_compute) == (False, False)

    old = env("0.6.2", "0.19.2")
    assert {"recompute_full", "recompute_method", "recompute_layers"} <= rules_of(both.validate(model, None, old,
                                                                                               dataset=packed))
    assert both.effective_switches(model, old, packed) == (True, True)


def test_packing_clears_a_switch_set_only_on_the_model():
    """Bridge main clears what the model asks for too, so the model-switch warning gives way to the packing one."""
    unset = CommOverlapConfig()
    model = good_model(overlap_moe_expert_parallel_comm=True)
    found = rules_of(unset.validate(model, None, env(), dataset=DatasetConfig(packing_buffer_size=4)))
    assert found == {"packing_clears_overlap"}
    assert rules_of(unset.validate(model, None, env(), dataset=DatasetConfig())) == {"model_switch_overwritten"}


def test_ncclep_on_a_gpu_without_it_is_a_warning_on_main():
    """Megatron-Bridge main does not gate ncclep by GPU (it does not know the backend); 0.6.x refuses it."""
    model = good_model(**NCCLEP)
    on_main = OFF.validate(model, None, env(gpu="a100"))
    assert [(v.rule, v.severity) for v in on_main] == [("flex_backend_gpu", "warning")]
    assert [(v.rule, v.severity) for v in OFF.validate(model, None, env("0.6.2", "0.19.2", "a100"))] == [
        ("flex_backend_gpu", "error")]


def test_zero_copy_with_overlap_warns_about_the_extra_copy():
    both = CommOverlapConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    model = good_model(**NCCLEP, **FUSED, moe_expert_rank_capacity_factor=1.5, moe_ncclep_zero_copy=True)
    assert [(v.rule, v.severity) for v in both.validate(model, None, env())] == [
        ("ncclep_zero_copy_overlap", "warning")]


def test_release_fields_name_the_release_that_brought_or_took_them():
    cfg = RunConfig()
    cfg.model.moe_use_grouped_tensor = True
    cfg.ddp.megatron_fsdp_version = 2
    on_06 = release_field_problems(cfg, bridge_rules("0.6.2"), core_rules("0.20"))
    assert len(on_06) == 2 and all("Megatron-Core main (0.20" in p and "--bridge-version main" in p for p in on_06)
    assert release_field_problems(cfg, bridge_rules("main"), core_rules("0.20")) == []
    (old_core,) = release_field_problems(cfg, bridge_rules("main"), core_rules("0.19"),
                                         keys=["ddp.megatron_fsdp_version"])
    assert "Megatron-Core 0.20" in old_core and "#5865" in old_core and "--mcore-version 0.20" in old_core

    cfg = RunConfig()
    cfg.model.moe_ncclep_static_shape = True
    (removed,) = release_field_problems(cfg, bridge_rules("main"), core_rules("0.20"))
    assert "removed it" in removed and "moe_expert_rank_capacity_factor" in removed and "#6229" in removed
    assert release_field_problems(cfg, bridge_rules("0.6"), core_rules("0.19")) == []
    cfg = RunConfig()
    cfg.model.moe_expert_rank_capacity_factor = 1.5
    (too_old,) = release_field_problems(cfg, bridge_rules("0.6"), core_rules("0.16"))
    assert "Megatron-Core 0.18 introduced it" in too_old
    cfg.model.moe_dispatch_fwd_dtype = "fp8"
    assert any("must be one of 'bf16', 'mxfp8'" in p for p in release_field_problems(cfg, bridge_rules("main"),
                                                                                      core_rules("0.20")))


def test_validate_knows_main_fields_and_applies_main_rules():
    """Item 1: every field main introduced is a known key on main (exit 0/1, not "unknown config key")."""
    keys = ["dataset.packing_buffer_size=8", "ddp.megatron_fsdp_version=1",
            "model.moe_expert_rank_capacity_factor=1.5", "model.moe_ncclep_zero_copy=true",
            "model.moe_dispatch_fwd_dtype=mxfp8", "model.moe_combine_bwd_dtype=mxfp8",
            "model.moe_use_grouped_tensor=true", "model.use_transformer_engine_op_fuser=true",
            "model.moe_hybridep_num_sms=64", "model.moe_permute_fusion_into_hybridep=true",
            "model.moe_token_dispatcher_type=flex", "model.moe_flex_dispatcher_backend=ncclep"]
    code, out, err = cli("validate", "--json", "-g", "b200", "--te-version", "2.12", "--torch-version", "2.8",
                         "--bridge-version", "main", *keys)
    assert code == 0, err
    report = json.loads(out)
    assert report["environment"]["mcore_version"] == "0.20"  # main is checked with Megatron-Core main
    assert report["violations"] == []


def test_a_main_field_on_0_6_is_a_usage_error_naming_the_release():
    code, _out, err = cli("validate", "-g", "b200", "--bridge-version", "0.6.2", "model.moe_use_grouped_tensor=true")
    assert code == 2
    assert "model.moe_use_grouped_tensor=True" in err and "Megatron-Core main (0.20" in err
    assert "--bridge-version main" in err and "Traceback" not in err


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--bridge-version", "0.5", "knows Megatron-Bridge 0.6.x and main"),
    ("--bridge-version", "0.7", "use main"),
    ("--bridge-version", "nightly", "knows Megatron-Bridge 0.6.x and main"),
    ("--mcore-version", "0.14", "Megatron-Core 0.15, 0.16, 0.17, 0.18, 0.19, 0.20"),
])
def test_an_unknown_release_exits_2_naming_the_known_ones(flag, value, says):
    code, _out, err = cli("validate", "-g", "h100", flag, value)
    assert code == 2 and says in err and "Traceback" not in err, err


def test_list_rules_per_release():
    code, out, _err = cli("validate", "--list-rules", "--json", "--bridge-version", "main")
    on_main = {row["rule"] for row in json.loads(out)}
    _code, out, _err = cli("validate", "--list-rules", "--json", "--bridge-version", "0.6", "--mcore-version", "0.19")
    on_06 = {row["rule"] for row in json.loads(out)}
    assert code == 0 and set(BREAKERS) | {"packing_clears_overlap", "fsdp_v2_delay_wgrad"} <= on_main
    assert not on_06 & {"packing_clears_overlap", "fsdp_v2_moe", "a2a_dtype_needs_ncclep", "ncclep_drop_and_pad"}
    assert {"rank_capacity_backend", "ncclep_zero_copy", "flex_backend_gpu"} <= on_06 < on_main


def test_the_validator_reads_new_fields_from_any_config_object():
    """A Megatron-Core 0.20 TransformerConfig-like object (attribute names) is read like the run config."""
    obj = SimpleNamespace(**{**vars(good_model()), "moe_dispatch_fwd_dtype": "mxfp8"})
    assert rules_of(OFF.validate(obj, None, env())) == {"a2a_dtype_needs_ncclep", "a2a_mxfp8_fused_gemm"}
