"""Roofline performance model of disaggregated decoding."""

from __future__ import annotations

import numpy as np
import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.planning import perf_model as pm
from mbridge_epoverlap.serving.planning.catalog import GPUS, MODELS

P = pm.PerfParams()
MIXTRAL = MODELS["Mixtral-8x22B"]
H20, L40S = GPUS["H20"], GPUS["L40S"]


def test_roofline_takes_the_slower_of_compute_and_memory():
    gpu = GPUS["H100"]
    flops_bound = pm.roofline(1e15, 1.0, gpu, 1, P)
    assert flops_bound == pytest.approx(1e15 / (gpu.flops * P.compute_efficiency))
    memory_bound = pm.roofline(1.0, 1e12, gpu, 2, P)
    assert memory_bound == pytest.approx(1e12 / (2 * gpu.mem_bw * P.memory_efficiency))


def test_attention_time_is_linear_in_batch_and_grows_with_context():
    """T_a = k1*b + k2 while memory bound: KV reads per sequence plus one weight read."""
    t = [float(pm.attention_time(MIXTRAL, H20, 1, b, 730, P)) for b in (4, 8, 12)]
    assert t[1] - t[0] == pytest.approx(t[2] - t[1], rel=1e-6)
    assert t[0] > (MIXTRAL.attention_params * P.weight_bytes) / (H20.mem_bw * P.memory_efficiency)
    assert pm.attention_time(MIXTRAL, H20, 1, 32, 4000, P) > pm.attention_time(MIXTRAL, H20, 1, 32, 730, P)


def test_expert_time_is_weight_bound_for_few_tokens_and_compute_bound_for_many():
    weights = MIXTRAL.expert_params * P.weight_bytes
    few = float(pm.expert_time(MIXTRAL, L40S, 1, 64, 1, P))
    assert few == pytest.approx(weights / (L40S.mem_bw * P.memory_efficiency), rel=0.05)
    many = float(pm.expert_time(MIXTRAL, L40S, 1, 4096, 1, P))
    assert many == pytest.approx(2 * 4096 * MIXTRAL.expert_params / (L40S.flops * P.compute_efficiency), rel=0.05)


def test_idle_experts_cost_no_weight_reads():
    qwen = MODELS["Qwen3-30B-A3B"]
    assert pm.active_experts(qwen, 128, 0.01) < 2
    assert pm.active_experts(qwen, 128, 20) == pytest.approx(128, rel=1e-6)


def test_m2n_time_is_bytes_over_utilized_bandwidth():
    b_a, tokens_per_group = 100, 50
    t = float(pm.m2n_time(MIXTRAL, H20, L40S, 1, 1, b_a, tokens_per_group, P))
    send = b_a * MIXTRAL.hidden * MIXTRAL.top_k * 2 / (H20.nic_bw * P.link_utilization)
    receive = tokens_per_group * MIXTRAL.hidden * 2 / (L40S.nic_bw * P.link_utilization)
    assert t == pytest.approx(max(send, receive) + P.link_latency_s)


def test_kv_cache_memory_follows_the_paper_formula():
    """KV bytes ~ 4*m*b_a*s*h*L/g for bf16 and GQA group g."""
    s, m, b_a = 730, 3, 10
    group = MIXTRAL.heads // MIXTRAL.kv_heads
    paper = 4 * m * b_a * s * MIXTRAL.hidden * MIXTRAL.layers / group
    assert m * b_a * pm.kv_bytes_per_sequence(MIXTRAL, s, P) == pytest.approx(paper)


def test_memory_limits():
    # One Mixtral expert over all layers is ~34 GB: fits one L40S, two do not.
    assert pm.expert_weight_bytes(MIXTRAL, 1, P) < pm.usable_memory(L40S, 1, P)
    assert pm.expert_weight_bytes(MIXTRAL, 2, P) > pm.usable_memory(L40S, 1, P)
    assert pm.max_sequences(MIXTRAL, H20, 1, 730, P) > pm.max_sequences(MIXTRAL, L40S, 1, 730, P)


def test_decode_step_is_the_ping_pong_closed_form():
    t_a, t_e, t_c, m = 0.5e-3, 0.6e-3, 0.1e-3, 3
    expected = (t_a + t_e + 2 * t_c) + max(t_a, t_e) * (m * MIXTRAL.moe_layers - 1)
    assert pm.decode_step_time(MIXTRAL, t_a, t_e, t_c, m) == pytest.approx(expected)
    with_head = pm.decode_step_time(MIXTRAL, t_a, t_e, t_c, m, t_head=1e-3)
    assert with_head == pytest.approx(expected + m * 1e-3)


def test_functions_work_elementwise_on_arrays():
    batch = np.array([8.0, 64.0, 256.0])
    arr = pm.attention_time(MIXTRAL, H20, np.array([1, 2, 4]), batch, 730, P)
    one = [float(pm.attention_time(MIXTRAL, H20, tp, b, 730, P)) for tp, b in zip([1, 2, 4], batch, strict=True)]
    assert arr == pytest.approx(one)


def test_colocated_step_has_no_overlap():
    t_a, t_e, t_c, step = pm.colocated_step_time(MIXTRAL, H20, 1, 8, 64, 730, P)
    head = pm.head_time(MIXTRAL, H20, 1, 64, P)
    assert step == pytest.approx(MIXTRAL.moe_layers * (t_a + t_e + 2 * t_c) + head)


@pytest.mark.parametrize("field,value", [("compute_efficiency", 0.0), ("link_utilization", 1.5), ("kv_bytes", -2)])
def test_nonsense_parameters_are_usage_errors(field, value):
    with pytest.raises(UsageError, match=field):
        pm.PerfParams(**{field: value})
