"""The simulator fed a run's own stage costs: issue costs, stalls, the prediction and its diagnosis."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.schedule.costs import training_costs
from mbridge_epoverlap.schedule.predict import hidden_upper_bound, predict, schedule_steps, simulator_costs
from mbridge_epoverlap.schedule.program import Phase, forward_steps
from mbridge_epoverlap.schedule.simulator import simulate

SCHEDULE = {"micro_batches": 4, "layers": 2, "overlap": True, "delay_wgrad": False}
COSTS = training_costs(t_attn=2.0, t_expert=3.0, t_comm=1.5, t_post=0.5)


def measured_from(schedule, costs, issue=0.0, extra_wait=None):
    """What the runtime would record if the simulator's model were exact (per-occurrence means)."""
    steps = schedule_steps(schedule)
    stage_s = dict(costs)
    for name in ("dispatch", "combine", "combine_bwd", "dispatch_bwd"):
        stage_s[f"{name}.issue"] = issue
    timeline = simulate(steps, {**costs, **{f"{k}.issue": issue for k in ("dispatch", "combine", "combine_bwd",
                                                                          "dispatch_bwd")}})
    counts = {}
    for step in steps:
        if step.phase is Phase.WAIT:
            counts[step.stage] = counts.get(step.stage, 0) + 1
    for name, count in counts.items():
        blocked = timeline.stalled().get(f"{name}.wait", 0.0)
        stage_s[f"{name}.wait"] = blocked / count + (extra_wait or {}).get(name, 0.0)
    return stage_s, timeline


def test_issue_and_resume_costs_hold_the_stream_and_show_as_stalls():
    steps = forward_steps(0, 1)
    free = simulate(steps, COSTS)
    assert free.stalled() == {"dispatch.wait": pytest.approx(1.5), "combine.wait": pytest.approx(1.5)}
    # The collective runs while it is being handed over: a short issue only moves stall time around ...
    costly = simulate(steps, {**COSTS, "dispatch.issue": 0.25})
    assert costly.makespan == pytest.approx(free.makespan)
    assert costly.stalled() == {"dispatch.issue": pytest.approx(0.25), "dispatch.wait": pytest.approx(1.25),
                                "combine.wait": pytest.approx(1.5)}
    # ... a long one holds the stream past the collective's end.
    assert simulate(steps, {**COSTS, "dispatch.issue": 2.0}).makespan == pytest.approx(free.makespan + 0.5)
    resumed = simulate(steps, {**COSTS, "combine.resume": 0.1})
    assert resumed.makespan == pytest.approx(free.makespan + 0.1)
    assert resumed.stalled()["combine.wait"] == pytest.approx(1.6)
    assert free.busy()["compute"] == costly.busy()["compute"]  # stalls are not compute


def test_prediction_reproduces_a_run_that_follows_the_model():
    stage_s, timeline = measured_from(SCHEDULE, COSTS, issue=0.1)
    p = predict(SCHEDULE, stage_s)
    assert p.schedule_s == pytest.approx(timeline.makespan)
    assert p.exposed_comm_s == pytest.approx(sum(p.measured_stalls_s.values()))
    assert p.stalls_s == pytest.approx(p.measured_stalls_s)
    assert 0.0 < p.hidden_fraction <= p.hidden_upper_bound <= 1.0
    assert p.measured_hidden_fraction == pytest.approx(p.hidden_fraction, abs=1e-9)


def test_largest_gap_names_the_stage_the_model_gets_wrong():
    stage_s, _ = measured_from(SCHEDULE, COSTS, extra_wait={"dispatch_bwd": 0.7})
    stall, measured, predicted = predict(SCHEDULE, stage_s).largest_gap()
    assert stall == "dispatch_bwd.wait" and measured > predicted


def test_without_collective_times_issue_and_wait_are_the_collective():
    costs = simulator_costs({"attn": 1.0, "dispatch.issue": 0.2, "dispatch.wait": 0.8})
    assert costs["dispatch"] == pytest.approx(1.0) and "dispatch.issue" not in costs
    assert costs["experts"] == 0.0


def test_upper_bound_leaves_the_lone_forward_and_backward_exposed():
    steps = schedule_steps({**SCHEDULE, "micro_batches": 1, "overlap": False})
    # One micro-batch: its forward collectives (2 layers x 2 x 1.5) cannot hide at all, its backward ones
    # (as many) only behind its own weight gradients (2 layers x (attention 2.0 + experts 3.0), enough).
    assert hidden_upper_bound(steps, COSTS) == pytest.approx(0.5)
    only_experts = {**COSTS, "attn_wgrad": 0.0, "experts_wgrad": 0.5, "experts_wgrad_down": 0.0}
    assert hidden_upper_bound(steps, only_experts) == pytest.approx(1.0 / 12.0)
    # The down projection's part is as much a weight gradient as the gate/up part.
    split = {**only_experts, "experts_wgrad": 0.25, "experts_wgrad_down": 0.25}
    assert hidden_upper_bound(steps, split) == pytest.approx(1.0 / 12.0)
    many = hidden_upper_bound(schedule_steps({**SCHEDULE, "micro_batches": 16}), COSTS)
    few = hidden_upper_bound(schedule_steps(SCHEDULE), COSTS)
    assert 0.0 < few < many < 1.0


def test_upper_bound_follows_the_edges_the_schedule_has():
    # Paired edges: the first two forwards share a phase (comm-bound, so only part of it can hide) and the last
    # two backwards another; Megatron-Core's lone first forward hides nothing. A record without the key ran
    # Megatron-Core's order (results written before paired edges existed).
    assert schedule_steps(SCHEDULE) == schedule_steps({**SCHEDULE, "paired_edges": False})
    paired = schedule_steps({**SCHEDULE, "paired_edges": True})
    assert paired != schedule_steps(SCHEDULE)
    # Forward compute (attention 2 + experts 3 + post 0.5 per layer) exceeds its two collectives (2 x 1.5): paired,
    # every phase could hide all of its communication.
    assert hidden_upper_bound(schedule_steps(SCHEDULE), COSTS) < hidden_upper_bound(paired, COSTS) == 1.0
    # With collectives slower than the forward compute, the paired first forwards are communication-bound.
    slow = {**COSTS, "dispatch": 5.5, "combine": 5.5, "combine_bwd": 5.5, "dispatch_bwd": 5.5}
    alone, both = hidden_upper_bound(schedule_steps(SCHEDULE), slow), hidden_upper_bound(paired, slow)
    assert alone < both < 1.0


def test_measured_hidden_share_from_the_ranks_replaces_the_stage_cost_estimate():
    stage_s, _ = measured_from(SCHEDULE, COSTS, issue=0.1)
    estimate = predict(SCHEDULE, stage_s).measured_hidden_fraction
    given = predict(SCHEDULE, stage_s, measured_hidden=0.25)
    assert given.measured_hidden_fraction == 0.25 != estimate
    assert given.hidden_fraction == predict(SCHEDULE, stage_s).hidden_fraction


def test_two_channels_let_forward_and_backward_collectives_fly_at_once():
    from mbridge_epoverlap.schedule.resources import TRAINING, TRAINING_TWO_CHANNELS, training_resources

    assert training_resources(1) is TRAINING and training_resources(2) is TRAINING_TWO_CHANNELS
    with pytest.raises(ValueError, match="comm_channels"):
        training_resources(3)
    assert TRAINING_TWO_CHANNELS.channel("combine_bwd") == TRAINING_TWO_CHANNELS.channel("dispatch_bwd") == "comm_bwd"
    assert TRAINING_TWO_CHANNELS.channel("dispatch") == TRAINING_TWO_CHANNELS.channel("combine") == "comm"
    # Slow collectives: on one channel the forward ones queue behind the backward ones and the other way round.
    record = {**SCHEDULE, "micro_batches": 6, "paired_edges": True}
    slow = {**COSTS, "dispatch": 4.0, "combine": 4.0, "combine_bwd": 4.0, "dispatch_bwd": 4.0}
    one, two = predict(record, slow), predict({**record, "comm_channels": 2}, slow)
    assert two.schedule_s < one.schedule_s
    assert two.comm_s == pytest.approx(one.comm_s)  # the same collectives, summed over the channels
    assert one.hidden_fraction < two.hidden_fraction <= two.hidden_upper_bound <= 1.0
