"""One stage program, executed three ways: the runtime executor and the simulator see the same steps.

The runtime executor records every step it executed and which stage results it actually read; the
simulator times the same list. Both must agree with each other and with the stage table's
dependencies, for training and for every serving order.
"""

from __future__ import annotations

import random

import pytest
import torch

from mbridge_epoverlap.moe.wgrad import WeightGradStore
from mbridge_epoverlap.runtime.executor import ScheduleExecutor
from mbridge_epoverlap.schedule.program import STAGES, Direction, Phase, Step, predecessors
from mbridge_epoverlap.schedule.resources import COLOCATED_RESOURCES, DISAGGREGATED_RESOURCES, TRAINING
from mbridge_epoverlap.schedule.serving_orders import ping_pong, sequential, two_batch_overlap
from mbridge_epoverlap.schedule.simulator import simulate
from mbridge_epoverlap.schedule.training_orders import one_f_one_b
from tests.unit_tests.runtime.tiny_runs import micro_batches, tiny_model

LAYERS = 2

SCHEDULES = {
    "1f1b": (lambda: one_f_one_b(3, LAYERS, overlap=False), TRAINING),
    "combined_1f1b_delayed": (lambda: one_f_one_b(3, LAYERS, overlap=True, delay_wgrad=True), TRAINING),
    "ping_pong_m1": (lambda: ping_pong(1, LAYERS), DISAGGREGATED_RESOURCES),
    "ping_pong_m2": (lambda: ping_pong(2, LAYERS), DISAGGREGATED_RESOURCES),
    "ping_pong_m3": (lambda: ping_pong(3, LAYERS), DISAGGREGATED_RESOURCES),
    "two_batch_overlap": (lambda: two_batch_overlap(2, LAYERS), COLOCATED_RESOURCES),
    "sequential": (lambda: sequential(2, LAYERS), COLOCATED_RESOURCES),
}


def _closure(steps: list[Step]) -> dict[tuple[int, int, str], set[tuple[int, int, str]]]:
    """Every stage key -> all stage keys it depends on, directly or not, by the stage table."""
    layers = max(s.layer for s in steps) + 1
    direct: dict[tuple[int, int, str], list[tuple[int, int, str]]] = {}
    for step in steps:
        direct.setdefault((step.micro_batch, step.layer, step.stage), []).extend(predecessors(step, layers))
    closure: dict[tuple[int, int, str], set[tuple[int, int, str]]] = {}

    def visit(key):
        if key not in closure:
            closure[key] = set()
            for need in direct.get(key, ()):
                closure[key] |= {need} | visit(need)
        return closure[key]

    for key in direct:
        visit(key)
    return closure


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_executor_and_simulator_see_one_order_and_one_set_of_dependencies(make_tiny, name):
    make_steps, resources = SCHEDULES[name]
    steps = make_steps()
    cfg = make_tiny(1)
    count = max(s.micro_batch for s in steps) + 1
    executor = ScheduleExecutor(tiny_model(cfg), store=WeightGradStore(), trace=True)
    executor.run(steps, micro_batches(cfg, count))
    executed = [step for step, _ in executor.trace]
    assert executed == steps

    # Data flow: what a step read is implied by the table, and each forward stage reads its direct needs.
    closure = _closure(steps)
    layers = max(s.layer for s in steps) + 1
    for step, reads in executor.trace:
        key = (step.micro_batch, step.layer, step.stage)
        assert reads <= closure[key] | {key}, f"{step} read {sorted(reads - closure[key])} the table does not order"
        if step.direction is Direction.FORWARD and step.phase is not Phase.WAIT:
            assert set(predecessors(step, layers)) <= reads, f"{step} did not consume its table dependencies"

    # The simulator, with arbitrary costs, runs each stream's steps in the executor's order and starts
    # every stage after the table's dependencies finished.
    rng = random.Random(name)
    timeline = simulate(steps, {stage: rng.uniform(0.1, 2.0) for stage in STAGES}, resources)
    finished = {(e.micro_batch, e.layer, e.stage): e.end for e in timeline.events}
    for stream in {resources.stream(s) for s in steps}:
        simulated = [(e.micro_batch, e.layer, e.stage) for e in timeline.events if e.resource == stream]
        ran = [(s.micro_batch, s.layer, s.stage) for s in executed
               if s.phase is Phase.RUN and resources.stream(s) == stream]
        assert simulated == ran
    for event in timeline.events:
        step = Step(event.micro_batch, event.layer, event.stage,
                    Phase.RUN if event.kind == "compute" else Phase.ISSUE)
        for need in predecessors(step, layers):
            assert finished[need] <= event.start + 1e-12


@pytest.mark.numerics
def test_forward_only_schedules_give_the_training_forward_losses(make_tiny):
    cfg = make_tiny(1)
    batches = micro_batches(cfg, 2)
    trained = ScheduleExecutor(tiny_model(cfg), store=WeightGradStore()).run(one_f_one_b(2, LAYERS, overlap=False),
                                                                           batches)
    for steps in (ping_pong(2, LAYERS), two_batch_overlap(2, LAYERS), sequential(2, LAYERS)):
        executor = ScheduleExecutor(tiny_model(cfg), store=WeightGradStore())
        losses = executor.run(steps, batches)
        assert all(torch.equal(a, b) for a, b in zip(losses, trained, strict=True))
        assert not executor._states  # every layer's state was freed after its last use
