"""Shared builders for the validator tests: a config that passes every rule, and environments."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.config import CommOverlapConfig, Environment, MoEModelConfig
from mbridge_epoverlap.config.container import DDPConfig


def good_model(**changes) -> MoEModelConfig:
    """A MoE model on which EP overlap and delayed wgrad pass every rule."""
    base = dict(num_layers=8, num_moe_experts=16, moe_router_topk=2, expert_model_parallel_size=8, bf16=True,
                moe_token_dispatcher_type="alltoall", add_bias_linear=False, use_te_rng_tracker=True)
    base.update(changes)
    return MoEModelConfig(**base)


def h100(te: str | None = "2.12.0", torch_version: str = "2.8.0", mcore: str | None = "0.16.1") -> Environment:
    return Environment.for_gpu("h100", te_version=te, torch_version=torch_version, mcore_version=mcore)


def rules_of(violations, severity: str | None = None) -> set[str]:
    return {v.rule for v in violations if severity is None or v.severity == severity}


@pytest.fixture
def overlap_on() -> CommOverlapConfig:
    return CommOverlapConfig(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)


@pytest.fixture
def ddp() -> DDPConfig:
    return DDPConfig(overlap_grad_reduce=True)
