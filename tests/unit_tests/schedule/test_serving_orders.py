"""Serving schedules: ping-pong closed forms, two-batch overlap, validity."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.costs import serving_costs
from mbridge_epoverlap.schedule.presets import min_micro_batches, ping_pong_makespan
from mbridge_epoverlap.schedule.program import check_schedule
from mbridge_epoverlap.schedule.resources import COLOCATED_RESOURCES, DISAGGREGATED_RESOURCES
from mbridge_epoverlap.schedule.serving_orders import ping_pong, sequential, two_batch_overlap
from mbridge_epoverlap.schedule.simulator import simulate

times = st.floats(min_value=0.01, max_value=10.0, allow_nan=False)
micro_batches = st.integers(min_value=1, max_value=6)
layers = st.integers(min_value=1, max_value=5)


def _pingpong(t_a: float, t_e: float, t_c: float, m: int, num_layers: int) -> float:
    return simulate(ping_pong(m, num_layers), serving_costs(t_a, t_e, t_c), DISAGGREGATED_RESOURCES).makespan


@settings(max_examples=60, deadline=None, database=None)
@given(t_a=times, t_e=times, t_c=times, m=micro_batches, num_layers=layers)
def test_full_pipeline_matches_megascale_closed_form(t_a, t_e, t_c, m, num_layers):
    t_f = max(t_a, t_e)
    # The paper's constraints: (2) T_c < T_f and (3) m*T_f >= 2*(T_f + T_c).
    assume(t_c <= t_f and m * t_f >= 2 * (t_f + t_c))
    expected = (t_a + t_e + 2 * t_c) + t_f * (m * num_layers - 1)
    assert _pingpong(t_a, t_e, t_c, m, num_layers) == pytest.approx(expected, rel=1e-9)


@settings(max_examples=40, deadline=None, database=None)
@given(t_a=times, t_e=times, t_c=times, num_layers=layers)
def test_one_micro_batch_is_fully_serial(t_a, t_e, t_c, num_layers):
    expected = num_layers * (t_a + t_e + 2 * t_c)
    assert _pingpong(t_a, t_e, t_c, 1, num_layers) == pytest.approx(expected, rel=1e-9)


@settings(max_examples=80, deadline=None, database=None)
@given(t_a=times, t_e=times, t_c=times, m=micro_batches, num_layers=layers)
def test_general_closed_form_matches_the_simulator_everywhere(t_a, t_e, t_c, m, num_layers):
    # The planner uses this form; it must agree with the simulator in every regime, including
    # bubbles (m*T_f < round trip) and a link slower than both workers.
    simulated = _pingpong(t_a, t_e, t_c, m, num_layers)
    assert ping_pong_makespan(t_a, t_e, t_c, m, num_layers) == pytest.approx(simulated, rel=1e-9)


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.5, 0.6, 0.75, 1.0])
def test_minimum_micro_batches_follows_the_constraint(ratio):
    """Balanced stages: the smallest bubble-free m is ceil(2*(1 + T_c/T_f)): 3 on fast links, 4 on slow."""
    t_f, t_c, num_layers = 1.0, ratio, 4

    def bubble_free(m: int) -> bool:
        full = (2 * t_f + 2 * t_c) + t_f * (m * num_layers - 1)
        return math.isclose(_pingpong(t_f, t_f, t_c, m, num_layers), full, rel_tol=1e-9)

    smallest = next(m for m in range(1, 10) if bubble_free(m))
    assert smallest == math.ceil(2 * (1 + ratio))
    assert min_micro_batches(t_f, t_f, t_c) == smallest
    # Once the pipeline is full, more micro-batches keep it full.
    assert all(bubble_free(m) for m in range(smallest, smallest + 3))


def test_fast_links_need_three_micro_batches_slow_links_four():
    assert min_micro_batches(1.0, 1.0, 0.3) == 3
    assert min_micro_batches(1.0, 1.0, 0.8) == 4


def test_ping_pong_keeps_both_workers_busy_once_full():
    timeline = simulate(ping_pong(3, 8), serving_costs(1.0, 1.0, 0.2), DISAGGREGATED_RESOURCES)
    utilization = timeline.utilization()
    assert utilization["attention"] > 0.9 and utilization["expert"] > 0.9
    single = simulate(ping_pong(1, 8), serving_costs(1.0, 1.0, 0.2), DISAGGREGATED_RESOURCES)
    assert single.utilization()["attention"] < 0.5


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("num_layers", [1, 3])
def test_serving_orders_pass_check_schedule(m, num_layers):
    for steps in (ping_pong(m, num_layers), two_batch_overlap(m, num_layers), sequential(m, num_layers)):
        check_schedule(steps)
        assert len(steps) == m * num_layers * 7  # per layer: 3 runs, 2 issues, 2 waits


def test_ping_pong_orders_each_worker_by_micro_batch_within_a_layer():
    steps = ping_pong(3, 2)
    attention = [(s.layer, s.micro_batch) for s in steps if s.stage == "attn"]
    assert attention == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_two_batch_overlap_hides_communication_on_one_gpu():
    costs = serving_costs(1.0, 1.0, 0.5)
    overlapped = simulate(two_batch_overlap(2, 4), costs, COLOCATED_RESOURCES)
    serial = simulate(sequential(2, 4), costs, COLOCATED_RESOURCES)
    compute = sum(e.duration for e in serial.events if e.resource == "compute")
    assert serial.makespan == pytest.approx(compute + 2 * 4 * 2 * 0.5)
    assert compute <= overlapped.makespan < serial.makespan
    assert overlapped.exposed_comm() < serial.exposed_comm()


@settings(max_examples=40, deadline=None, database=None)
@given(t_a=times, t_e=times, t_c=times, num_layers=layers)
def test_two_batch_overlap_never_slower_than_serial(t_a, t_e, t_c, num_layers):
    costs = serving_costs(t_a, t_e, t_c)
    overlapped = simulate(two_batch_overlap(2, num_layers), costs, COLOCATED_RESOURCES).makespan
    serial = simulate(sequential(2, num_layers), costs, COLOCATED_RESOURCES).makespan
    assert overlapped <= serial * (1 + 1e-12)
    assert overlapped >= 2 * num_layers * (t_a + t_e) * (1 - 1e-12)


def test_two_batch_overlap_with_free_communication_is_pure_compute():
    timeline = simulate(two_batch_overlap(2, 3), serving_costs(1.0, 2.0, 0.0), COLOCATED_RESOURCES)
    assert timeline.makespan == pytest.approx(2 * 3 * 3.0)


@pytest.mark.parametrize("build", [lambda: ping_pong(0, 2), lambda: ping_pong(2, 0), lambda: two_batch_overlap(2, 0)])
def test_nonsense_sizes_are_usage_errors(build):
    with pytest.raises(UsageError, match=">= 1"):
        build()
