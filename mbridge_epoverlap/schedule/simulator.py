"""Turn a schedule (a list of `Step`s) plus stage costs into a timeline.

Semantics, the same the reference runtime has:

- each stream executes its own steps in list order, one at a time;
- a RUN step starts when its stream is free and the stages it depends on (`program.predecessors`)
  have finished, and occupies the stream for its cost;
- an ISSUE step costs its stream nothing, unless the costs name `"<stage>.issue"` (handing a collective
  to a communication thread is not free on a CPU: the stream is held that long while the collective
  already runs); the collective starts on its channel as soon as the stream reached the ISSUE, its input
  is ready and the channel is free (one collective at a time, FIFO in list order);
- a WAIT step blocks its stream until that collective ended, plus `"<stage>.resume"` if the costs name it
  and the wait did block (a CPU thread woken by another one does not resume at once).

The timeline records those issue costs and wait blocks as `stalls`: the simulated counterpart of the time
the runtime's training thread spends in communication steps.

Because every step comes after the steps it depends on in a valid schedule, one pass over the list
in order times everything exactly; no event queue is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.costs import StageCosts, check_duration, cost_function
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
            (`TRAINING`/`COLOCATED_RESOURCES` for one GPU, `DISAGGREGATED_RESOURCES` for attention and expert workers).
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
    issue_cost = _extra_costs(costs, ".issue")
    resume_cost = _extra_costs(costs, ".resume")
    num_layers: dict[int, int] = {}
    for step in steps:
        num_layers[step.micro_batch] = max(num_layers.get(step.micro_batch, 0), step.layer + 1)

    stream_free: dict[str, float] = {}
    channel_free: dict[str, float] = {}
    finished: dict[tuple[int, int, str], float] = {}  # stage -> time its result is available
    collective_end: dict[tuple[int, int, str], float] = {}
    events: list[Event] = []
    stalls: list[Event] = []
    stream_order: dict[str, None] = {}
    channel_order: dict[str, None] = {}

    for step in steps:
        key = (step.micro_batch, step.layer, step.stage)
        stream = resources.stream(step)
        stream_order.setdefault(stream, None)
        now = stream_free.get(stream, 0.0)
        if step.phase is Phase.WAIT:
            end = collective_end[key]
            if end > now:
                end += resume_cost(step.stage)
                stalls.append(Event(stream, step.micro_batch, step.layer, step.stage, now, end, "wait"))
            stream_free[stream] = max(now, end)
            finished[key] = end
            continue
        ready = max((finished[need] for need in predecessors(step, num_layers[step.micro_batch])), default=0.0)
        if step.phase is Phase.ISSUE:
            channel = resources.channel(step.stage)
            channel_order.setdefault(channel, None)
            cost = issue_cost(step.stage)
            # The collective may start as soon as it is handed over; handing it over holds the stream.
            start = max(now, ready, channel_free.get(channel, 0.0))
            if cost > 0:
                issue_start = max(now, ready)
                stream_free[stream] = issue_start + cost
                stalls.append(Event(stream, step.micro_batch, step.layer, step.stage, issue_start, issue_start + cost,
                                    "issue"))
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
    return Timeline(tuple(events), tuple(stream_order) + tuple(channel_order), channels, tuple(stalls))


def _extra_costs(costs: StageCosts, suffix: str) -> Callable[[str], float]:
    """`stage -> cost` from the `"<stage><suffix>"` entries of a cost mapping (0 where none)."""
    if callable(costs):
        return lambda stage: 0.0
    checked = {name.removesuffix(suffix): check_duration(f"cost of {name!r}", value)
               for name, value in costs.items() if name.endswith(suffix)}
    return lambda stage: checked.get(stage, 0.0)
