"""Predict a run of the reference runtime from its own measured stage costs, and say where the model is wrong.

The runtime times every step of its schedule (`runtime.executor.ScheduleExecutor.step_s`): each compute
stage, each issue and wait of a collective, and each collective's own time on the communication thread.
Fed the mean of each into the simulator with the same step list, the simulator's makespan should match the
measured schedule time, and its stalls (issue costs and blocked waits) the measured time in communication
steps. Where they do not, the stall with the largest gap names the stage the model gets wrong. This is what
lets the simulator's answer for other stage costs (a GPU cluster) be trusted.

Stage costs are keyed by range name, as the runtime records them: `attn`, `experts_wgrad`, ... for compute;
`dispatch`, `combine_bwd`, ... for a collective's own time; `dispatch.issue`, `dispatch.wait`, ... for the
training thread's time in those steps; `dispatch.blocked` (share of waits that blocked) and
`dispatch.resume`, ... (per wait, how long it took to return after its collective ended when it blocked, else
0). Torch-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mbridge_epoverlap.schedule.program import STAGES, WEIGHT_GRADIENT_STAGES, Kind, Phase, Step
from mbridge_epoverlap.schedule.resources import TRAINING, Resources, training_resources
from mbridge_epoverlap.schedule.simulator import simulate
from mbridge_epoverlap.schedule.timeline import Timeline
from mbridge_epoverlap.schedule.training_orders import one_f_one_b

TOLERANCE = 0.15  # a prediction within 15 % of the measurement is a match


@dataclass(frozen=True)
class Prediction:
    """The simulator's account of one iteration's schedule, next to the measured one (seconds).

    Attributes:
        schedule_s: simulated makespan of the schedule (forward and backward of every micro-batch).
        exposed_comm_s: simulated time the compute stream spent issuing and waiting for collectives.
        comm_s: total time of the collectives (on their channel).
        hidden_fraction: share of the collectives' time hidden in the simulation: 1 - (simulated issue costs and
            blocked waits, less the resume latency) / (collective time, summed over the channels), the
            counterpart of `measured_hidden_fraction`.
        hidden_upper_bound: the most any order of the same steps could hide with these costs: every
            collective of the interleaved part hidden, as far as that part's compute lasts; a first forward
            that runs alone (Megatron-Core's edges) has nothing to hide behind, a last backward alone only its
            own weight gradients.
        stalls_s: simulated stall time per `<stage>.issue` / `<stage>.wait` (0 for a wait that never blocked).
        measured_stalls_s: measured time per `<stage>.issue` / `<stage>.wait`.
        measured_hidden_fraction: 1 - (measured issue and wait time, less the resume latency) / (measured
            collective time), summed over the ranks when the caller passes each rank's own account
            (`measured_hidden`), else from the stage costs; None without collective times (no communication
            thread).
    """

    schedule_s: float
    exposed_comm_s: float
    comm_s: float
    hidden_fraction: float
    hidden_upper_bound: float
    stalls_s: dict[str, float]
    measured_stalls_s: dict[str, float]
    measured_hidden_fraction: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def largest_gap(self) -> tuple[str, float, float] | None:
        """(`<stage>.<issue|wait>`, measured, predicted) of the stall the model gets most wrong."""
        keys = set(self.stalls_s) | set(self.measured_stalls_s)
        if not keys:
            return None
        key = max(sorted(keys), key=lambda k: abs(self.measured_stalls_s.get(k, 0.0) - self.stalls_s.get(k, 0.0)))
        return key, self.measured_stalls_s.get(key, 0.0), self.stalls_s.get(key, 0.0)


def schedule_steps(schedule: Mapping[str, Any]) -> list[Step]:
    """The step list a runtime schedule record (`micro_batches`, `layers`, `overlap`, `delay_wgrad`,
    `paired_edges`; a record without the last ran Megatron-Core's edges) ran. Its `comm_channels` (1 where
    absent) says which `Resources` it ran on (`resources.training_resources`)."""
    return one_f_one_b(int(schedule["micro_batches"]), int(schedule["layers"]), overlap=bool(schedule["overlap"]),
                       delay_wgrad=bool(schedule.get("delay_wgrad", False)),
                       paired_edges=bool(schedule.get("paired_edges", False)),
                       split_expert_wgrad=bool(schedule.get("split_expert_wgrad", False)))


def simulator_costs(stage_s: Mapping[str, float]) -> dict[str, float]:
    """Measured per-step means -> the simulator's costs.

    A collective costs its time on the communication thread, its issue costs the stream what issuing
    took, and a wait that blocks costs what resuming took after the collective ended. Without a
    communication thread (no collective times), the issue and wait steps are the collective, run back to
    back, and issuing is free.
    """
    costs: dict[str, float] = {}
    for name, stage in STAGES.items():
        if stage.kind is Kind.COMPUTE:
            costs[name] = float(stage_s.get(name, 0.0))
        elif name in stage_s:
            costs[name] = float(stage_s[name])
            costs[f"{name}.issue"] = float(stage_s.get(f"{name}.issue", 0.0))
            blocked = float(stage_s.get(f"{name}.blocked", 0.0))
            # Recorded per wait (0 where it did not block); the simulator wants it per blocked wait.
            costs[f"{name}.resume"] = float(stage_s.get(f"{name}.resume", 0.0)) / blocked if blocked > 0 else 0.0
        else:
            costs[name] = float(stage_s.get(f"{name}.issue", 0.0)) + float(stage_s.get(f"{name}.wait", 0.0))
    return costs


def hidden_upper_bound(steps: Sequence[Step], costs: Mapping[str, float], resources: Resources = TRAINING) -> float:
    """See `Prediction.hidden_upper_bound`.

    The schedule falls into three phases: before the first backward step, up to the last forward step, and
    after it. Within a phase any order hides at most as much of each channel's communication as that phase
    computes; a phase of one micro-batch alone hides nothing in a forward, and in a backward only behind its
    weight gradients (needed by nothing after them).
    """
    first_backward = next((i for i, step in enumerate(steps) if step.direction.value == "B"), len(steps))
    last_forward = max((i for i, step in enumerate(steps) if step.direction.value == "F"), default=-1)
    middle_end = max(first_backward, last_forward + 1)
    comm = hideable = 0.0
    for phase in (steps[:first_backward], steps[first_backward:middle_end], steps[middle_end:]):
        alone = len({step.micro_batch for step in phase if step.stage not in WEIGHT_GRADIENT_STAGES}) == 1
        compute = sum(costs[step.stage] for step in phase if step.kind is Kind.COMPUTE
                      and (not alone or step.stage in WEIGHT_GRADIENT_STAGES))
        per_channel: dict[str, float] = {}
        for step in phase:
            if step.kind is Kind.COMM and step.phase is Phase.ISSUE:
                channel = resources.channel(step.stage)
                per_channel[channel] = per_channel.get(channel, 0.0) + costs[step.stage]
        comm += sum(per_channel.values())
        hideable += sum(min(channel_comm, compute) for channel_comm in per_channel.values())
    return hideable / comm if comm > 0 else 1.0


def predict(schedule: Mapping[str, Any], stage_s: Mapping[str, float], *,
            measured_hidden: float | None = None) -> Prediction:
    """Simulate the schedule a run executed with the stage costs it measured.

    Args:
        schedule: the run's schedule record (see `schedule_steps`).
        stage_s: mean duration of one occurrence per range name (see the module docstring).
        measured_hidden: the share of communication the run hid, from each rank's own account
            (`RunMetrics.hidden_share`); None estimates it from `stage_s`, which, where those are the slowest
            rank's per stage, mixes ranks that stall in different places and comes out low.
    """
    steps = schedule_steps(schedule)
    costs = simulator_costs(stage_s)
    resources = training_resources(int(schedule.get("comm_channels", 1)))
    timeline: Timeline = simulate(steps, costs, resources, validate=False)
    busy = timeline.busy()
    comm = sum(busy.get(channel, 0.0) for channel in timeline.channels)
    counts = Counter((step.stage, step.phase) for step in steps)
    measured: dict[str, float] = {}
    resumed = 0.0
    for (stage, phase), count in counts.items():
        key = f"{stage}.{phase.value}"
        if phase is not Phase.RUN and key in stage_s:
            measured[key] = float(stage_s[key]) * count
        if phase is Phase.WAIT:
            resumed += float(stage_s.get(f"{stage}.resume", 0.0)) * count
    collectives = sum(float(stage_s[name]) * counts[(name, Phase.ISSUE)] for name, stage in STAGES.items()
                      if stage.kind is Kind.COMM and name in stage_s)
    exposed = sum(measured.values()) - resumed
    if measured_hidden is None and collectives > 0:
        measured_hidden = min(1.0, max(0.0, 1.0 - exposed / collectives))
    # Every wait of the schedule (and every issue with a cost) is named, 0 where the simulated stream never
    # stalled in it: a fully hidden collective shows as such, like in the measured record.
    stalls = {f"{stage}.{phase.value}": 0.0 for stage, phase in counts
              if phase is Phase.WAIT or (phase is Phase.ISSUE and f"{stage}.issue" in costs)}
    stalls.update(timeline.stalled())
    # The simulated counterpart of the measured share: the stream's time issuing and blocked in waits, less the
    # wake-up after a collective ended, against the collectives' time (with two channels, two collectives
    # that fly during one wait are two collectives' time, one stall).
    resumed_sim = sum(costs.get(f"{event.stage}.resume", 0.0) for event in timeline.stalls if event.kind == "wait")
    simulated_exposed = sum(stalls.values()) - resumed_sim
    return Prediction(
        schedule_s=timeline.makespan,
        exposed_comm_s=sum(stalls.values()),
        comm_s=comm,
        hidden_fraction=min(1.0, max(0.0, 1.0 - simulated_exposed / comm)) if comm > 0 else 1.0,
        hidden_upper_bound=hidden_upper_bound(steps, costs, resources),
        stalls_s=stalls,
        measured_stalls_s=measured,
        measured_hidden_fraction=measured_hidden,
    )
