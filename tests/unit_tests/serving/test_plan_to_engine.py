"""`planning.to_engine`: a planned deployment as the engine's layout flags, shrunk to the machine in the plan's
proportions (`plan --engine-workers`). The run of a shrunk DeepSeek-V3 plan on the engine is
`test_deepseek_v3.py`'s."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.planning.search import best_colocated, best_disaggregated
from mbridge_epoverlap.serving.planning.to_engine import engine_layout
from tests.unit_tests.cli_runner import run_cli


@pytest.fixture(scope="module")
def deepseek_plan():
    return best_disaggregated("DeepSeek-V3", "H20", "L40S")


def test_a_plan_that_fits_is_run_as_planned(deepseek_plan):
    small = dataclasses.replace(deepseek_plan, n_a=1, n_e=2, m=3)
    layout = engine_layout(small, workers=4, num_experts=8)
    assert (layout.attn_workers, layout.expert_workers, layout.micro_batches, layout.shrunk) == (1, 2, 3, False)
    assert layout.flags() == ["--attn-workers", "1", "--expert-workers", "2", "--micro-batches", "3"]


@pytest.mark.parametrize(("n_a", "n_e", "workers", "experts", "expected"), [
    (80, 128, 4, 8, (2, 2)),    # attention's share 0.38 of 4 processes rounds to 2
    (80, 128, 8, 256, (3, 4)),  # 5 does not divide 256: the largest divisor not above 5 is 4
    (1, 40, 4, 8, (1, 2)),      # at least one attention worker; 3 does not divide 8
    (40, 1, 4, 8, (3, 1)),      # at least one expert worker
])
def test_a_larger_plan_is_shrunk_in_its_proportions(deepseek_plan, n_a, n_e, workers, experts, expected):
    layout = engine_layout(dataclasses.replace(deepseek_plan, n_a=n_a, n_e=n_e), workers=workers,
                           num_experts=experts)
    assert layout.shrunk and layout.micro_batches == deepseek_plan.m
    assert (layout.attn_workers, layout.expert_workers) == expected
    assert experts % layout.expert_workers == 0 and layout.attn_workers + layout.expert_workers <= workers
    assert f"{n_a} attention + {n_e} expert nodes" in layout.why


def test_a_colocated_plan_becomes_colocated_processes():
    layout = engine_layout(best_colocated("DeepSeek-V3", "H100"), workers=3, num_experts=8)
    assert layout.colocated == 2 and layout.flags() == ["--colocated", "2"]  # 3 does not divide 8
    assert layout.plan_kwargs() == {"colocated": 2, "micro_batches": 1}


def test_too_few_workers_for_a_disaggregated_plan_is_a_usage_error(deepseek_plan):
    with pytest.raises(UsageError, match="--engine-workers 1: a disaggregated plan needs at least 2"):
        engine_layout(deepseek_plan, workers=1, num_experts=8)


def test_plan_cli_prints_the_engine_flags():
    proc = run_cli("plan", "--model", "DeepSeek-V3", "--attn-gpu", "H20", "--expert-gpu", "L40S",
                   "--engine-workers", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    engine = json.loads(proc.stdout)["engine"]
    assert engine["flags"][:4] == ["--attn-workers", "2", "--expert-workers", "2"] and engine["shrunk"]
    refused = run_cli("plan", "--model", "DeepSeek-V3", "--compare", "--engine-workers", "4")
    assert refused.returncode == 2 and "--engine-workers" in refused.stderr and "Traceback" not in refused.stderr
