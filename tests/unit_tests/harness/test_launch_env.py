"""Launch environment: CUDA_DEVICE_MAX_CONNECTIONS and the HybridEP topology, by Megatron-Bridge's rules.

Cases mirror Megatron-Bridge's `tests/unit_tests/scripts/performance/test_recipe_environment.py` (named
per test) and its `scripts/performance/utils/overrides.py` connection rule.
"""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.launch_env import (
    HYBRID_EP_RANKS,
    HYBRID_EP_TOPOLOGY,
    MAX_CONNECTIONS,
    NVLINK_DOMAIN_SIZE,
    USE_MNNVL,
    RecipeLaunch,
    cuda_device_max_connections,
    launch_environment,
)
from mbridge_epoverlap.recipes.loader import load_recipe


def cfg(tp: int = 1, cp: int = 1, ep: int = 16, overlap: bool = False, dispatcher: str = "alltoall",
        backend: str | None = None):
    c = load_recipe("qwen3_30b_a3b")
    c.model.tensor_model_parallel_size, c.model.context_parallel_size = tp, cp
    c.model.expert_model_parallel_size = ep
    c.model.moe_token_dispatcher_type, c.model.moe_flex_dispatcher_backend = dispatcher, backend
    c.comm_overlap.overlap_moe_expert_parallel_comm = overlap
    return c


@pytest.mark.parametrize(("kwargs", "gpu", "expected"), [
    ({}, "h100", 8),
    ({"overlap": True}, "h100", 8),
    ({"tp": 2}, "h100", 1),
    ({"cp": 2}, "h100", 1),
    ({"tp": 2, "overlap": True}, "h100", 8),
    ({"dispatcher": "flex", "backend": "deepep"}, "h100", 32),
    ({"dispatcher": "flex", "backend": "hybridep", "tp": 2}, "h100", 1),  # TP without overlap wins over the backend
    ({"dispatcher": "flex", "backend": "hybridep", "tp": 2, "overlap": True}, "h100", 32),
    ({"tp": 2}, "b200", 32),
    ({}, "gb300", 32),
    ({"tp": 2}, "vr200", 32),  # mirrors test_vr200_argparse_overrides_keep_sm100_cuda_connection_count
    ({"tp": 2}, "r100", 1),  # r100 is not in upstream's 32-connection set
])
def test_cuda_device_max_connections(kwargs, gpu, expected):
    assert cuda_device_max_connections(cfg(**kwargs), gpu) == expected


# Mirrors test_target_topology_adapts_only_hybridep (h100/gb200/vr200 rows) plus the other targets.
@pytest.mark.parametrize(("gpu", "ep", "ranks", "domain", "mnnvl"), [
    ("h100", 32, "8", "8", "0"), ("gb200", 32, "32", "72", "1"), ("vr200", 64, "64", "72", "1"),
    ("h100", 4, "4", "8", "0"), ("b200", 64, "8", "8", "0"), ("b300", 8, "8", "8", "0"),
    ("gb300", 72, "72", "72", "1"), ("r100", 16, "16", "72", "1"),
])
def test_target_topology_adapts_only_hybridep(gpu, ep, ranks, domain, mnnvl):
    env, _ = launch_environment(cfg(ep=ep, dispatcher="flex", backend="hybridep"), gpu)
    assert (env[HYBRID_EP_RANKS], env[NVLINK_DOMAIN_SIZE], env[USE_MNNVL]) == (ranks, domain, mnnvl)


@pytest.mark.parametrize(("dispatcher", "backend"), [("alltoall", None), ("flex", "deepep")])
def test_target_topology_removes_disabled_hybridep_values(dispatcher, backend):
    env, _ = launch_environment(cfg(dispatcher=dispatcher, backend=backend), "h100")
    assert not set(HYBRID_EP_TOPOLOGY) & set(env)


def test_target_topology_rejects_nonpositive_ep_size():
    with pytest.raises(UsageError, match="positive"):
        launch_environment(cfg(ep=0, dispatcher="flex", backend="hybridep"), "h100")


def test_nvl72_topology_rejects_ep_beyond_the_domain():
    with pytest.raises(UsageError, match="72-rank NVLink domain"):
        launch_environment(cfg(ep=128, dispatcher="flex", backend="hybridep"), "gb300")


def test_cpu_has_no_nvlink_domain():
    env, _ = launch_environment(cfg(dispatcher="flex", backend="hybridep"), "cpu")
    assert HYBRID_EP_RANKS not in env and env[MAX_CONNECTIONS] == "32"


def test_explicit_environment_map_protects_target_topology_values():
    c = cfg(dispatcher="flex", backend="hybridep")
    c.env_vars[NVLINK_DOMAIN_SIZE] = "4"
    env, _ = launch_environment(c, "h100")
    assert env[NVLINK_DOMAIN_SIZE] == "4" and env[HYBRID_EP_RANKS] == "8"


def test_explicit_env_var_wins_with_a_warning_when_it_serializes_overlap():
    c = cfg(overlap=True)
    c.env_vars[MAX_CONNECTIONS] = "1"
    env, warnings = launch_environment(c, "h100")
    assert env[MAX_CONNECTIONS] == "1"
    assert warnings and "serializes" in warnings[0]


# CUDA_DEVICE_MAX_CONNECTIONS of a GPU job, as Megatron-Bridge's run_script.py sets it
# (scripts/performance/utils/overrides.py, _apply_flat_cli_environment_compatibility): the recipe's value
# unless -tp, -cp or --moe_a2a_overlap is given, then recomputed from the recipe's own flex backend.
HYBRIDEP_RECIPE = RecipeLaunch({MAX_CONNECTIONS: "1", "NVTE_FWD_LAYERNORM_SM_MARGIN": "20"}, "hybridep", False)


def test_without_a_connection_flag_the_recipe_value_stays():
    env, _ = launch_environment(cfg(tp=2, dispatcher="flex", backend="deepep"), "h100", recipe=HYBRIDEP_RECIPE)
    assert env[MAX_CONNECTIONS] == "1" and env["NVTE_FWD_LAYERNORM_SM_MARGIN"] == "20"


def test_a_recipe_without_a_value_exports_none_without_a_connection_flag():
    env, _ = launch_environment(cfg(tp=2), "b200", recipe=RecipeLaunch({}, None, False))
    assert MAX_CONNECTIONS not in env  # CUDA's default, as upstream leaves it


@pytest.mark.parametrize("flag", ["tp", "cp"])
def test_tp_or_cp_given_recomputes_from_the_recipe_backend(flag):
    """The user switched the recipe's HybridEP off, but upstream judges by the recipe's backend: 32, not 8."""
    env, _ = launch_environment(cfg(**{flag: 1}, overlap=True), "h100", recipe=HYBRIDEP_RECIPE, reconnect=True)
    assert env[MAX_CONNECTIONS] == "32"


def test_tp_given_without_overlap_recomputes_one():
    env, _ = launch_environment(cfg(tp=2), "h100", recipe=HYBRIDEP_RECIPE, reconnect=True)
    assert env[MAX_CONNECTIONS] == "1"


def test_moe_a2a_overlap_given_recomputes_with_the_new_overlap():
    env, warnings = launch_environment(cfg(tp=2, overlap=True), "h100", recipe=HYBRIDEP_RECIPE, reconnect=True)
    assert env[MAX_CONNECTIONS] == "32" and warnings == []


def test_a_recipe_backend_upstream_does_not_count_gives_eight():
    """run_script.py asks for 32 after deepep and hybridep only; an ncclep recipe gets 8."""
    recipe = RecipeLaunch({MAX_CONNECTIONS: "32"}, "ncclep", True)
    env, _ = launch_environment(cfg(overlap=True, dispatcher="flex", backend="ncclep"), "h100", recipe=recipe,
                                reconnect=True)
    assert env[MAX_CONNECTIONS] == "8"


def test_blackwell_recomputes_thirty_two():
    env, _ = launch_environment(cfg(tp=2), "gb200", recipe=HYBRIDEP_RECIPE, reconnect=True)
    assert env[MAX_CONNECTIONS] == "32"


def test_a_user_env_override_stays_final():
    c = cfg(tp=2, overlap=True)
    c.env_vars[MAX_CONNECTIONS] = "4"
    env, _ = launch_environment(c, "h100", recipe=HYBRIDEP_RECIPE, reconnect=True)
    assert env[MAX_CONNECTIONS] == "4"


def test_the_recipe_value_that_serializes_overlap_is_named():
    env, warnings = launch_environment(cfg(tp=2, overlap=True), "h100", recipe=HYBRIDEP_RECIPE)
    assert env[MAX_CONNECTIONS] == "1"
    assert warnings and "the recipe's CUDA_DEVICE_MAX_CONNECTIONS=1 serializes" in warnings[0]
    assert "--moe_a2a_overlap true" in warnings[0]


def _cases(*argv: str):
    return _cases_of("deepseek_v3", "1024", *argv)


def test_deepseek_h100_recipe_keeps_its_one_connection_until_a_flag_asks():
    """Megatron-Bridge's 1024-GPU H100 DeepSeek-V3 recipe exports 1 (TP 2, EP overlap off, HybridEP)."""
    (plain,), _ = _cases()
    assert plain.launch_env[MAX_CONNECTIONS] == "1"
    (dotted,), warnings = _cases("comm_overlap.overlap_moe_expert_parallel_comm=true")  # no flag: upstream keeps 1
    assert dotted.launch_env[MAX_CONNECTIONS] == "1" and any("serializes" in w for w in warnings)
    (flagged,), _ = _cases("--moe_a2a_overlap", "true")
    assert flagged.launch_env[MAX_CONNECTIONS] == "32"
    ab, _ = _cases("--ab", "ep_overlap")  # each case is the run --moe_a2a_overlap false/true would give
    assert [c.launch_env[MAX_CONNECTIONS] for c in ab] == ["1", "32", "32"]


def test_a_dotted_overlap_override_does_not_change_the_recomputation():
    """With -tp given, upstream judges by --moe_a2a_overlap, else by the recipe's switch (True here): a dotted
    `comm_overlap.overlap_moe_expert_parallel_comm=false` is not read, so 32 stays rather than 1."""
    recipe = RecipeLaunch({MAX_CONNECTIONS: "32"}, "hybridep", True)
    env, _ = launch_environment(cfg(tp=2, overlap=False), "h100", recipe=recipe, reconnect=True, overlap_set=False)
    assert env[MAX_CONNECTIONS] == "32"
    env, _ = launch_environment(cfg(tp=2, overlap=False), "h100", recipe=recipe, reconnect=True, overlap_set=True)
    assert env[MAX_CONNECTIONS] == "1"


def test_qwen_h100_recipe_value_and_the_flags_that_recompute_it():
    """Megatron-Bridge's 16-GPU H100 Qwen3-30B-A3B recipe exports 32; -tp 2 recomputes (recipe overlap on: 32),
    -tp 2 with --moe_a2a_overlap false gives 1, and -cp 2 is a connection flag too."""
    def connections(*argv: str) -> str:
        (case,), _ = _cases_of("qwen3_30b_a3b", "16", *argv)
        return case.launch_env[MAX_CONNECTIONS]

    assert connections() == "32"
    assert connections("-tp", "2") == "32"
    assert connections("-tp", "2", "--moe_a2a_overlap", "false") == "1"
    assert connections("-cp", "2", "--moe_a2a_overlap", "false") == "1"
    assert connections("-tp", "2", "comm_overlap.overlap_moe_expert_parallel_comm=false") == "32"


def _cases_of(recipe: str, num_gpus: str, *argv: str):
    from mbridge_epoverlap.harness.cases import build_cases, case_specs
    from mbridge_epoverlap.harness.flags import build_parser
    from mbridge_epoverlap.harness.resolve import resolve

    args = build_parser().parse_intermixed_args(["-mr", recipe, "-g", "h100", "-ng", num_gpus, "--te_version",
                                                 "2.12", *argv])
    r = resolve(args)
    return build_cases(r, case_specs(args.ab, r.cfg, r.explicit))
