"""Turn a schedule (a list of `Step`s) plus stage costs into a timeline.

Semantics, the same the reference runtime has:

- each stream executes its own steps in list order, one at a time;
- a RUN step starts when its stream is free and the stages it depends on (`program.predecessors`)
  have finished, and occupies the stream for its cost;
- an ISSUE step costs its stream nothing; the collective starts on its channel as soon as the stream
  reached the ISSUE, its input is ready and the channel is free (one collective at a time, FIFO in
  list order);
- a WAIT step blocks its stream until that collective ended.

Because every step comes after the steps it depends on in a valid schedule, one pass over the list
in order times everything exactly; no event queue is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.costs import StageCosts, cost_function
from mbridge_epoverlap.schedule.program import Kind, Phase, Step, check_schedule, predecessors
from mbridge_epoverlap.schedule.resources import TRAINING, Resources
from mbridge_epoverlap.schedule.timeline import Event, Timeline


def simulate(
    steps: Sequence[Step],
    costs: StageCosts,
    resources: Resources = TRAINING,
    *,
    validate: bool = True,
) -> Timeline:
    """Time `steps` with `costs` on `resources`.

    Args:
        steps: the schedule, e.g. `one_f_one_b(...)`, `ping_pong(...)` or `two_batch_overlap(...)`.
        costs: `stage name -> duration` or `Step -> duration`, all in one time unit.
        resources: which stream runs each step and which channel carries each collective
            (`TRAINING`/`COLOCATED` for one GPU, `DISAGGREGATED` for attention and expert workers).
        validate: check the schedule with `check_schedule` first (a schedule that fails it has no
            meaningful timing).

    Returns:
        The timeline: one event per RUN (on its stream) and per collective (on its channel).

    Raises:
        UsageError: the schedule is invalid, or a cost is missing, negative or not a number.
    """
    if validate:
        try:
            check_schedule(list(steps))
        except ValueError as exc:
            raise UsageError(f"invalid schedule: {exc}") from None
    cost_of = cost_function(costs)
    num_layers: dict[int, int] = {}
    for step in steps:
        num_layers[step.micro_batch] = max(num_layers.get(step.micro_batch, 0), step.layer + 1)

    stream_free: dict[str, float] = {}
    channel_free: dict[str, float] = {}
    finished: dict[tuple[int, int, str], float] = {}  # stage -> time its result is available
    collective_end: dict[tuple[int, int, str], float] = {}
    events: list[Event] = []
    stream_order: dict[str, None] = {}
    channel_order: dict[str, None] = {}

    for step in steps:
        key = (step.micro_batch, step.layer, step.stage)
        stream = resources.stream(step)
        stream_order.setdefault(stream, None)
        now = stream_free.get(stream, 0.0)
        if step.phase is Phase.WAIT:
            end = collective_end[key]
            stream_free[stream] = max(now, end)
            finished[key] = end
            continue
        ready = max((finished[need] for need in predecessors(step, num_layers[step.micro_batch])), default=0.0)
        if step.phase is Phase.ISSUE:
            channel = resources.channel(step.stage)
            channel_order.setdefault(channel, None)
            start = max(now, ready, channel_free.get(channel, 0.0))
            end = start + cost_of(step)
            channel_free[channel] = end
            collective_end[key] = end
            events.append(Event(channel, step.micro_batch, step.layer, step.stage, start, end, Kind.COMM.value))
            continue
        start = max(now, ready)
        end = start + cost_of(step)
        stream_free[stream] = end
        finished[key] = end
        events.append(Event(stream, step.micro_batch, step.layer, step.stage, start, end, Kind.COMPUTE.value))

    channels = frozenset(channel_order)
    return Timeline(tuple(events), tuple(stream_order) + tuple(channel_order), channels)
