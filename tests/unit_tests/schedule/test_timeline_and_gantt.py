"""Interval arithmetic of timelines and the Gantt picture."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.costs import serving_costs, training_costs
from mbridge_epoverlap.schedule.gantt import save_gantt
from mbridge_epoverlap.schedule.presets import simulate_schedule
from mbridge_epoverlap.schedule.resources import DISAGGREGATED_RESOURCES
from mbridge_epoverlap.schedule.serving_orders import ping_pong
from mbridge_epoverlap.schedule.simulator import simulate
from mbridge_epoverlap.schedule.timeline import Event, Timeline, intersect, union
from mbridge_epoverlap.schedule.training_orders import one_f_one_b


def test_union_merges_overlaps_and_drops_empty_intervals():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]


def test_intersect_of_sorted_interval_lists():
    assert intersect([(0, 2), (3, 6)], [(1, 4), (5, 7)]) == [(1, 2), (3, 4), (5, 6)]


def test_busy_time_is_a_union_not_a_sum():
    events = (
        Event("gpu", 0, 0, "attn", 0.0, 2.0, "compute"),
        Event("gpu", 1, 0, "attn", 1.0, 3.0, "compute"),
        Event("net", 0, 0, "dispatch", 2.0, 5.0, "comm"),
    )
    timeline = Timeline(events, ("gpu", "net"), frozenset({"net"}))
    assert timeline.busy() == {"gpu": 3.0, "net": 3.0}
    assert timeline.overlap(["gpu"], ["net"]) == 1.0
    assert timeline.exposed_comm() == 2.0
    assert timeline.idle() == {"gpu": 2.0, "net": 2.0}


def test_to_dict_has_the_cli_keys():
    out = simulate(ping_pong(2, 2), serving_costs(1, 1, 0.2), DISAGGREGATED_RESOURCES).to_dict()
    assert {"makespan", "utilization", "idle", "busy", "exposed_comm", "resources"} <= set(out)
    assert set(out["utilization"]) == {"attention", "expert", "link_a2e", "link_e2a"}


@pytest.mark.parametrize("schedule", ["pingpong", "1f1b", "two-batch"])
def test_gantt_png_is_written(tmp_path, schedule):
    timeline = simulate_schedule(schedule, layers=2, t_comm=0.8)
    path = save_gantt(timeline, tmp_path / "sub" / f"{schedule}.png", unit="ms")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_gantt_to_an_unwritable_place_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    timeline = simulate(one_f_one_b(2, 1, overlap=True), training_costs(1, 1, 1))
    with pytest.raises(UsageError, match="--png"):
        save_gantt(timeline, blocker / "gantt.png")


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        ({"micro_batches": 0}, "--micro-batches"),
        ({"layers": 0}, "--layers"),
        ({"t_attn": -1.0}, "--t-attn"),
        ({"t_comm": float("nan")}, "--t-comm"),
    ],
)
def test_simulate_schedule_rejects_nonsense(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        simulate_schedule("pingpong", **kwargs)


def test_unknown_schedule_lists_the_known_ones():
    with pytest.raises(UsageError, match="pingpong, 1f1b, two-batch"):
        simulate_schedule("zigzag")
