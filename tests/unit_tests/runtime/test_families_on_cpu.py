"""The CPU A/B of each new family's MoE shape: every Megatron-Bridge workload family, shrunk as qwen3_30b_a3b is
(expert count to top-k ratio, shared experts, dense-then-MoE pattern), trains on two gloo ranks with the plain,
overlapped (combined 1F1B) and delayed-wgrad schedules, and every schedule gives bitwise the plain one's losses,
gradients and parameters. Layer kinds the runtime has no block for stand in as the run's notes say
(test_bridge_workloads checks those notes)."""

from __future__ import annotations

import math

import pytest

from mbridge_epoverlap.runtime.launch import launch_ranks

pytestmark = pytest.mark.timeout(240)

# One workload of each family the harness took from Megatron-Bridge's recipes.
FAMILY_WORKLOADS = ("gpt_oss_20b", "kimi_k2", "deepseek_v4_flash", "qwen3_next_80b_a3b", "nemotron_3_nano",
                    "qwen3_vl_30b_a3b", "glm51")


@pytest.mark.parametrize("workload", FAMILY_WORKLOADS)
def test_every_schedule_is_bitwise_the_plain_run(make_tiny, workload):
    cfg = make_tiny(2, recipe=workload)
    assert cfg.model.num_moe_experts % 2 == 0 and cfg.model.moe_router_topk == 2
    report = launch_ranks(cfg, mode="check", timeout_s=200)
    assert len(report["ranks"]) == 2
    for rank in report["ranks"]:
        for dtype, variants in rank["schedules"].items():
            plain = variants["plain"]
            assert {"combined", "combined_delay_wgrad"} <= set(variants), variants.keys()
            assert all(math.isfinite(float.fromhex(x)) for it in plain["losses"] for x in it), (workload, dtype)
            for name, variant in variants.items():
                for part in ("losses", "local_grads", "grads", "params"):
                    assert variant[part] == plain[part], (workload, dtype, name, part)
