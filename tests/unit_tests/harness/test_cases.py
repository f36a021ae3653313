"""A/B cases: names, switches, validation of every case before launch, launch environment."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.cases import (
    ValidationFailed,
    build_cases,
    case_specs,
    same_except_switches,
)
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.resolve import resolve

GPU = ("-g", "h100", "-ng", "16", "--te_version", "2.12")  # the TE the recipe's graphs with delayed wgrad need


def resolved(*argv: str):
    args = build_parser().parse_intermixed_args(list(argv))
    args.gpu = args.gpu or "cpu"
    return resolve(args)


def cases_for(ab: str | None, *argv: str):
    r = resolved(*argv)
    return build_cases(r, case_specs(ab, r.cfg, r.explicit))


def test_ep_overlap_cases_differ_only_in_the_two_switches():
    cases, warnings = cases_for("ep_overlap", *GPU)
    assert [c.name for c in cases] == ["ep_overlap_off", "ep_overlap_on", "ep_overlap_on_delay_wgrad"]
    switches = [(c.cfg.model.overlap_moe_expert_parallel_comm, c.cfg.model.delay_wgrad_compute) for c in cases]
    assert switches == [(False, False), (True, False), (True, True)]
    assert same_except_switches(cases) == []
    assert cases[1].overrides == ["comm_overlap.overlap_moe_expert_parallel_comm=true",
                                  "comm_overlap.delay_wgrad_compute=false"]
    assert warnings == []


def test_ep_overlap_refuses_a_user_set_switch():
    with pytest.raises(UsageError, match="--ab ep_overlap sets"):
        cases_for("ep_overlap", *GPU, "--moe_a2a_overlap", "true")
    with pytest.raises(UsageError, match="--ab ep_overlap sets"):
        cases_for("ep_overlap", *GPU, "comm_overlap.delay_wgrad_compute=false")


def test_flag_ab_flips_each_key_from_its_value():
    """Megatron-Bridge's 16-GPU H100 recipe has permute fusion and EP overlap on: each case turns one off."""
    cases, _ = cases_for("model.moe_permute_fusion,comm_overlap.overlap_moe_expert_parallel_comm", *GPU)
    assert [c.name for c in cases] == ["baseline", "moe_permute_fusion_off", "overlap_moe_expert_parallel_comm_off"]
    assert cases[1].cfg.model.moe_permute_fusion is False and cases[0].cfg.model.moe_permute_fusion is True
    assert cases[2].cfg.model.overlap_moe_expert_parallel_comm is False
    assert same_except_switches(cases) == []
    cpu, _ = cases_for("model.moe_permute_fusion", "-g", "cpu")  # the project's recipe: off, so the case turns it on
    assert [c.name for c in cpu] == ["baseline", "moe_permute_fusion_on"]


def test_flag_ab_flips_true_to_off():
    cases, _ = cases_for("model.moe_permute_fusion", *GPU, "model.moe_permute_fusion=true")
    assert cases[1].name == "moe_permute_fusion_off" and cases[1].cfg.model.moe_permute_fusion is False


@pytest.mark.parametrize(("ab", "message"), [("model.hidden_size", "not a switch"),
                                             ("model.nope", "unknown config key"),
                                             ("env_vars.NCCL_DEBUG", "environment"),
                                             ("ep_overlap,model.moe_permute_fusion", "separate")])
def test_flag_ab_rejects(ab, message):
    with pytest.raises(UsageError, match=message):
        cases_for(ab, *GPU)


def test_every_error_of_every_case_is_reported_before_launch():
    with pytest.raises(ValidationFailed, match=r"configuration error\(s\) for -g h100 .*nothing was launched") as exc:
        cases_for("ep_overlap", "-g", "h100", "-ng", "16", "--recompute_granularity", "full")
    rules = {v.rule: names for v, names in exc.value.errors}
    assert rules["recompute_full"] == ["ep_overlap_on", "ep_overlap_on_delay_wgrad"]
    assert rules["delay_te_grad_reduce"] == ["ep_overlap_on_delay_wgrad"]  # no TE version given
    report = exc.value.report()
    assert "[recompute_full]" in report and "fix:" in report and "nothing was launched" in report


def test_cases_carry_their_launch_environment():
    """-tp recomputes the connection count from the recipe's backend (hybridep: 32), 1 where TP runs without EP
    overlap; the recipe's other variables (its HybridEP topology among them) come along."""
    cases, _ = cases_for("ep_overlap", *GPU, "-tp", "2")
    envs = [c.launch_env["CUDA_DEVICE_MAX_CONNECTIONS"] for c in cases]
    assert envs == ["1", "32", "32"]  # TP>1 without EP overlap wants 1; overlap needs more
    assert all(c.cfg.env_vars == c.launch_env for c in cases)
    assert cases[0].launch_env["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "8"
    assert cases[0].launch_env["NVTE_FWD_LAYERNORM_SM_MARGIN"] == "20"  # the recipe's own environment
    alltoall, _ = cases_for("ep_overlap", *GPU, "-tp", "2", "--moe_flex_dispatcher_backend", "None")
    assert [c.launch_env["CUDA_DEVICE_MAX_CONNECTIONS"] for c in alltoall] == ["1", "32", "32"]  # the recipe's backend
    cpu, _ = cases_for("ep_overlap", "-g", "cpu", "-ng", "2")
    assert "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN" not in cpu[0].launch_env  # exported with hybridep only


def test_cpu_ab_validates_on_this_machine():
    cases, _ = cases_for("ep_overlap", "-g", "cpu", "-ng", "2")
    assert len(cases) == 3 and all(c.cfg.num_gpus == 2 for c in cases)


def test_fsdp_with_overlap_and_partial_graphs_is_caught_before_launch():
    """Megatron-FSDP + EP overlap + the recommended partial TE graphs used to pass and fail at model wrap."""
    with pytest.raises(ValidationFailed, match="fsdp_cuda_graph"):
        cases_for("ep_overlap", *GPU, "--mcore_version", "0.19", "--use_megatron_fsdp", "true", "--cuda_graph_impl",
                  "transformer_engine", "--cuda_graph_scope", "attn,moe_router,moe_preprocess")
