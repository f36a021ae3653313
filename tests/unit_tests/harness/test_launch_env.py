"""Launch environment: CUDA_DEVICE_MAX_CONNECTIONS and the HybridEP NVLink-domain size."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.config.recipes import load_recipe
from mbridge_epoverlap.harness.launch_env import (
    HYBRID_EP_RANKS,
    MAX_CONNECTIONS,
    cuda_device_max_connections,
    launch_environment,
)


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
    ({"dispatcher": "flex", "backend": "hybridep", "tp": 2}, "h100", 32),
    ({"tp": 2}, "b200", 32),
    ({}, "gb300", 32),
])
def test_cuda_device_max_connections(kwargs, gpu, expected):
    assert cuda_device_max_connections(cfg(**kwargs), gpu) == expected


@pytest.mark.parametrize(("gpu", "ep", "expected"), [("h100", 16, "8"), ("h100", 4, "4"), ("b200", 64, "8"),
                                                     ("b300", 8, "8"), ("gb200", 16, "16"), ("gb300", 128, "72")])
def test_hybrid_ep_ranks_per_nvlink_domain(gpu, ep, expected):
    env, _ = launch_environment(cfg(ep=ep), gpu)
    assert env[HYBRID_EP_RANKS] == expected


def test_cpu_has_no_nvlink_domain():
    env, _ = launch_environment(cfg(), "cpu")
    assert HYBRID_EP_RANKS not in env and env[MAX_CONNECTIONS] == "8"


def test_explicit_env_var_wins_with_a_warning_when_it_serializes_overlap():
    c = cfg(overlap=True)
    c.env_vars[MAX_CONNECTIONS] = "1"
    env, warnings = launch_environment(c, "h100")
    assert env[MAX_CONNECTIONS] == "1"
    assert warnings and "serializes" in warnings[0]
