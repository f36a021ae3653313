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
