"""Simulator semantics on small hand-checked schedules."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.costs import serving_costs, training_costs
from mbridge_epoverlap.schedule.program import forward_steps, issue, run, wait
from mbridge_epoverlap.schedule.resources import DISAGGREGATED_RESOURCES, TRAINING, Resources
from mbridge_epoverlap.schedule.serving_orders import ping_pong
from mbridge_epoverlap.schedule.simulator import simulate
from mbridge_epoverlap.schedule.training_orders import one_f_one_b

COSTS = serving_costs(t_attn=2.0, t_expert=3.0, t_comm=1.0, t_post=0.5)


def test_single_forward_is_the_sum_of_its_stages():
    timeline = simulate(forward_steps(0, 1), COSTS)
    assert timeline.makespan == pytest.approx(2 + 1 + 3 + 1 + 0.5)
    assert [(e.resource, e.stage, e.start, e.end) for e in timeline.events] == [
        ("compute", "attn", 0.0, 2.0),
        ("comm", "dispatch", 2.0, 3.0),
        ("compute", "experts", 3.0, 6.0),
        ("comm", "combine", 6.0, 7.0),
        ("compute", "post", 7.0, 7.5),
    ]
    assert timeline.exposed_comm() == pytest.approx(2.0)


def test_compute_between_issue_and_wait_hides_the_collective():
    # mb1's attention runs while mb0's dispatch is in flight.
    steps = [
        run(0, 0, "attn"),
        issue(0, 0, "dispatch"),
        run(1, 0, "attn"),
        wait(0, 0, "dispatch"),
        run(0, 0, "experts"),
    ]
    timeline = simulate(steps, COSTS, validate=False)
    by_key = {(e.micro_batch, e.stage): e for e in timeline.events}
    assert by_key[(0, "dispatch")].start == 2.0
    assert by_key[(1, "attn")].start == 2.0
    assert by_key[(0, "experts")].start == 4.0  # after mb1's attention, the dispatch ended at 3
    assert timeline.exposed_comm() == 0.0


def test_wait_blocks_the_stream_until_the_collective_ends():
    steps = [run(0, 0, "attn"), issue(0, 0, "dispatch"), wait(0, 0, "dispatch"), run(0, 0, "experts")]
    costs = dict(COSTS, dispatch=10.0)
    timeline = simulate(steps, costs, validate=False)
    assert timeline.events[-1].start == 12.0
    assert timeline.idle()["compute"] == pytest.approx(10.0)


def test_channel_runs_one_collective_at_a_time_in_issue_order():
    steps = [
        run(0, 0, "attn"),
        issue(0, 0, "dispatch"),
        run(1, 0, "attn"),
        issue(1, 0, "dispatch"),
        wait(0, 0, "dispatch"),
        wait(1, 0, "dispatch"),
    ]
    costs = dict(COSTS, attn=1.0, dispatch=5.0)
    comm = [e for e in simulate(steps, costs, validate=False).events if e.resource == "comm"]
    assert [(e.micro_batch, e.start, e.end) for e in comm] == [(0, 1.0, 6.0), (1, 6.0, 11.0)]


def test_collective_starts_only_once_its_input_is_ready():
    # On another stream than its producer, an issue still waits for the data it sends.
    resources = Resources(streams={("dispatch", issue(0, 0, "dispatch").phase): "sender"})
    steps = [run(0, 0, "attn"), issue(0, 0, "dispatch"), wait(0, 0, "dispatch")]
    timeline = simulate(steps, COSTS, resources, validate=False)
    dispatch = next(e for e in timeline.events if e.stage == "dispatch")
    assert dispatch.start == 2.0


def test_disaggregated_mapping_puts_stages_on_workers_and_links():
    timeline = simulate(ping_pong(2, 1), COSTS, DISAGGREGATED_RESOURCES)
    where = {(e.stage, e.resource) for e in timeline.events}
    assert where == {
        ("attn", "attention"),
        ("dispatch", "link_a2e"),
        ("experts", "expert"),
        ("combine", "link_e2a"),
        ("post", "attention"),
    }
    assert timeline.resources == ("attention", "expert", "link_a2e", "link_e2a")
    assert timeline.channels == {"link_a2e", "link_e2a"}


def test_callable_costs_can_vary_by_layer():
    steps = forward_steps(0, 2)
    timeline = simulate(steps, lambda step: 1.0 + step.layer)
    assert timeline.makespan == pytest.approx(5 * 1.0 + 5 * 2.0)


def test_utilization_and_idle_add_up():
    timeline = simulate(one_f_one_b(3, 2, overlap=True), training_costs(1.0, 2.0, 0.7))
    for resource in timeline.resources:
        busy = timeline.busy()[resource]
        assert busy + timeline.idle()[resource] == pytest.approx(timeline.makespan)
        assert timeline.utilization()[resource] == pytest.approx(busy / timeline.makespan)


def test_summary_is_one_line_naming_every_resource():
    timeline = simulate(ping_pong(3, 2), COSTS, DISAGGREGATED_RESOURCES)
    line = timeline.summary()
    assert "\n" not in line
    for name in ("makespan", "attention", "expert", "link_a2e", "link_e2a"):
        assert name in line


def test_events_are_reported_with_all_fields():
    event = simulate(forward_steps(0, 1), COSTS).to_dict(events=True)["events"][0]
    assert set(event) == {"resource", "micro_batch", "layer", "stage", "start", "end", "kind"}


def test_invalid_schedule_is_a_usage_error():
    with pytest.raises(UsageError, match="invalid schedule"):
        simulate([wait(0, 0, "dispatch")], COSTS)


def test_missing_cost_names_the_stage():
    with pytest.raises(UsageError, match="'experts'"):
        simulate(forward_steps(0, 1), {"attn": 1.0, "dispatch": 1.0})


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "fast"])
def test_nonsense_costs_are_usage_errors(bad):
    with pytest.raises(UsageError, match="attn"):
        simulate(forward_steps(0, 1), dict(COSTS, attn=bad))


def test_empty_schedule_has_zero_makespan():
    timeline = simulate([], COSTS, TRAINING)
    assert timeline.makespan == 0.0
    assert timeline.utilization() == {}
