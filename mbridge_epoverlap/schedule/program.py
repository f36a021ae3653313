"""The stage program of a MoE layer and the step vocabulary that schedules are written in.

A MoE layer is a short program of stages, each either COMPUTE or COMM. A schedule is an ordered
list of `Step`s over several micro-batches; the reference runtime executes a schedule for real and
the simulator turns the same list plus stage costs into a timeline. Neither executor reorders
steps, so a schedule is defined once and means the same thing to both.

A COMM stage is split in two steps: ISSUE starts the collective asynchronously, WAIT blocks until
it finished. Whatever runs between the two is overlapped with that communication.

This module is the vocabulary: the stage table, `Step` and its phases, the worker roles, the forward
pieces every order is built from, and `check_schedule`. The orders live beside it: training 1F1B in
`training_orders`, decode in `serving_orders`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    COMPUTE = "compute"
    COMM = "comm"


class Phase(str, Enum):
    RUN = "run"  # a compute stage, start to end
    ISSUE = "issue"  # start an asynchronous collective
    WAIT = "wait"  # block until the issued collective finished


class Direction(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"


class Where(str, Enum):
    """Which layer a dependency of a stage lives in, relative to the stage's own layer."""

    SAME = "same"  # the same layer
    PREVIOUS = "previous"  # the layer before in the stage's direction (below forward, above backward), if any
    TURN = "turn"  # the same layer, only where the direction starts (backward at the top layer)


class Role(str, Enum):
    """Which kind of worker computes a stage when attention and experts are disaggregated."""

    ATTENTION = "attention"
    EXPERT = "expert"


@dataclass(frozen=True)
class Need:
    """One dependency of a stage: `stage` of the layer `where` says must have finished."""

    stage: str
    where: Where = Where.SAME


@dataclass(frozen=True)
class Stage:
    """One stage of a layer program: its kind, direction, dependencies and, for serving, its role.

    Attributes:
        needs: the stages whose results this stage consumes; the one definition of the dependency rules
            (`check_schedule`, the simulator and every executor derive theirs from it).
        role: the worker kind that computes it (COMPUTE), or that issues it (COMM) when disaggregated.
        to_role: for a COMM stage, the worker kind that receives (and so waits for) it.
    """

    name: str
    kind: Kind
    direction: Direction
    needs: tuple[Need, ...] = ()
    role: Role = Role.ATTENTION
    to_role: Role | None = None

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The steps a schedule splits this stage into: RUN, or ISSUE then WAIT."""
        return (Phase.ISSUE, Phase.WAIT) if self.kind is Kind.COMM else (Phase.RUN,)


F, B = Direction.FORWARD, Direction.BACKWARD
SAME, PREVIOUS, TURN = Where.SAME, Where.PREVIOUS, Where.TURN
ATTENTION, EXPERT = Role.ATTENTION, Role.EXPERT

# Forward: attention + router + permute | dispatch A2A | grouped experts | combine A2A | unpermute + residual.
ATTN = Stage("attn", Kind.COMPUTE, F, (Need("post", PREVIOUS),))
DISPATCH = Stage("dispatch", Kind.COMM, F, (Need("attn"),), role=ATTENTION, to_role=EXPERT)
EXPERTS = Stage("experts", Kind.COMPUTE, F, (Need("dispatch"),), role=EXPERT)
COMBINE = Stage("combine", Kind.COMM, F, (Need("experts"),), role=EXPERT, to_role=ATTENTION)
POST = Stage("post", Kind.COMPUTE, F, (Need("combine"),))
FORWARD_STAGES: tuple[Stage, ...] = (ATTN, DISPATCH, EXPERTS, COMBINE, POST)

# Backward runs the program in reverse. The backward of combine is a dispatch-shaped A2A and the
# backward of dispatch a combine-shaped one. Weight gradients are separate stages so they can be
# delayed into a communication window; dispatch_bwd needs only the data gradient, not the weight one.
POST_BWD = Stage("post_bwd", Kind.COMPUTE, B, (Need("attn_dgrad", PREVIOUS), Need("post", TURN)))
COMBINE_BWD = Stage("combine_bwd", Kind.COMM, B, (Need("post_bwd"),))
EXPERTS_DGRAD = Stage("experts_dgrad", Kind.COMPUTE, B, (Need("combine_bwd"),))
EXPERTS_WGRAD = Stage("experts_wgrad", Kind.COMPUTE, B, (Need("experts_dgrad"),))
# The experts' down-projection weight gradient (a third of their weight-gradient GEMMs) is a stage of its own, so
# that delayed wgrad can put it in another communication window than the gate/up part.
EXPERTS_WGRAD_DOWN = Stage("experts_wgrad_down", Kind.COMPUTE, B, (Need("experts_dgrad"),))
DISPATCH_BWD = Stage("dispatch_bwd", Kind.COMM, B, (Need("experts_dgrad"),))
ATTN_DGRAD = Stage("attn_dgrad", Kind.COMPUTE, B, (Need("dispatch_bwd"),))
ATTN_WGRAD = Stage("attn_wgrad", Kind.COMPUTE, B, (Need("attn_dgrad"),))
BACKWARD_STAGES: tuple[Stage, ...] = (POST_BWD, COMBINE_BWD, EXPERTS_DGRAD, EXPERTS_WGRAD, EXPERTS_WGRAD_DOWN,
                                      DISPATCH_BWD, ATTN_DGRAD, ATTN_WGRAD)

STAGES: dict[str, Stage] = {stage.name: stage for stage in FORWARD_STAGES + BACKWARD_STAGES}
# The weight-gradient stages: needed by nothing after them, so they can fill any later window.
WEIGHT_GRADIENT_STAGES: frozenset[str] = frozenset({EXPERTS_WGRAD.name, EXPERTS_WGRAD_DOWN.name, ATTN_WGRAD.name})

@dataclass(frozen=True)
class Step:
    """One instruction of a schedule: do `phase` of `stage` of `layer` for `micro_batch`."""

    micro_batch: int
    layer: int
    stage: str
    phase: Phase

    @property
    def kind(self) -> Kind:
        return STAGES[self.stage].kind

    @property
    def direction(self) -> Direction:
        return STAGES[self.stage].direction

    @property
    def role(self) -> Role:
        """The worker kind that executes this step when disaggregated: a WAIT runs on the receiving side."""
        stage = STAGES[self.stage]
        if self.phase is Phase.WAIT and stage.to_role is not None:
            return stage.to_role
        return stage.role

    def __str__(self) -> str:
        return f"mb{self.micro_batch}.L{self.layer}.{self.stage}.{self.phase.value}"


def handler_name(stage: Stage, phase: Phase) -> str:
    """The method an executor runs for one step of `stage`: `_<stage>` for a RUN, `_<stage>_<phase>` for a COMM
    step (the training executor, the serving workers and their transports all name their handlers so)."""
    return f"_{stage.name}" if phase is Phase.RUN else f"_{stage.name}_{phase.value}"


def role_phases(role: Role) -> list[tuple[Stage, Phase]]:
    """The forward (stage, phase) pairs the stage table gives a worker of `role` when disaggregated."""
    return [(stage, phase) for stage in FORWARD_STAGES for phase in stage.phases
            if Step(0, 0, stage.name, phase).role is role]


def bind_handlers(owner: object, pairs: Iterable[tuple[Stage, Phase]]) -> dict[tuple[str, Phase], Callable[..., None]]:
    """`(stage name, phase) -> owner's handler` for each pair; an owner missing one fails here, at start-up."""
    return {(stage.name, phase): getattr(owner, handler_name(stage, phase)) for stage, phase in pairs}


def is_communicating(step: Step) -> bool:
    """Whether a rank executing `step` is communicating (an issue or a wait) rather than computing: the state its
    heartbeat shows while it runs the step."""
    return step.phase is not Phase.RUN


def run(mb: int, layer: int, stage: str) -> Step:
    return Step(mb, layer, stage, Phase.RUN)


def issue(mb: int, layer: int, stage: str) -> Step:
    return Step(mb, layer, stage, Phase.ISSUE)


def wait(mb: int, layer: int, stage: str) -> Step:
    return Step(mb, layer, stage, Phase.WAIT)


def stage_steps(mb: int, layer: int, stage: Stage) -> list[Step]:
    """A stage run on its own: compute runs, communication is issued and waited back to back."""
    if stage.kind is Kind.COMM:
        return [issue(mb, layer, stage.name), wait(mb, layer, stage.name)]
    return [run(mb, layer, stage.name)]


def forward_steps(mb: int, num_layers: int) -> list[Step]:
    """Forward of one micro-batch through every layer with no overlap."""
    return [step for layer in range(num_layers) for stage in FORWARD_STAGES for step in stage_steps(mb, layer, stage)]


def attention_segment(mb: int, layer: int) -> list[Step]:
    """One micro-batch entering `layer` on the attention side: finish the layer below (wait for its combine,
    residual), run attention, hand the tokens to the experts."""
    steps: list[Step] = []
    if layer > 0:
        steps += [wait(mb, layer - 1, COMBINE.name), run(mb, layer - 1, POST.name)]
    return steps + [run(mb, layer, ATTN.name), issue(mb, layer, DISPATCH.name)]


def expert_segment(mb: int, layer: int) -> list[Step]:
    """One micro-batch through `layer`'s experts: receive, compute, send back."""
    return [wait(mb, layer, DISPATCH.name), run(mb, layer, EXPERTS.name), issue(mb, layer, COMBINE.name)]


def forward_tail(mb: int, num_layers: int) -> list[Step]:
    """What is left of a forward after the last layer's combine was issued: wait for it, residual (and loss)."""
    return [wait(mb, num_layers - 1, COMBINE.name), run(mb, num_layers - 1, POST.name)]


def forward_segments(mb: int, num_layers: int) -> list[list[Step]]:
    """One micro-batch's forward split at its communication: each segment waits for the collective the one
    before issued, computes, and issues the next, so another micro-batch's segment fits between two of them.
    The last segment is `forward_tail`."""
    segments: list[list[Step]] = []
    for layer in range(num_layers):
        segments += [attention_segment(mb, layer), expert_segment(mb, layer)]
    return segments + [forward_tail(mb, num_layers)]


def is_forward_only(steps: list[Step]) -> bool:
    """True for a decode (inference) schedule: no backward step at all."""
    return all(step.direction is Direction.FORWARD for step in steps)


def check_schedule(steps: list[Step]) -> None:
    """Raise ValueError unless every stage of every (micro-batch, layer) appears in a valid order.

    Checks: each COMM is issued once before its single wait; every stage's dependencies on the stage
    table (`Stage.needs`) finished (ran, or were waited) before it starts. A forward-only (decode)
    schedule is as valid as a training one.
    """
    done: set[tuple[int, int, str]] = set()
    issued: set[tuple[int, int, str]] = set()
    layers_of: dict[int, set[int]] = {}
    for step in steps:
        layers_of.setdefault(step.micro_batch, set()).add(step.layer)
    for step in steps:
        key = (step.micro_batch, step.layer, step.stage)
        if step.phase is Phase.WAIT:
            if key not in issued or key in done:
                raise ValueError(f"{step}: wait without a pending issue")
            done.add(key)
            continue
        for need in _predecessors(step, max(layers_of[step.micro_batch]) + 1):
            if need not in done:
                raise ValueError(f"{step}: runs before {need} finished")
        if step.phase is Phase.ISSUE:
            if key in issued:
                raise ValueError(f"{step}: issued twice")
            issued.add(key)
        else:
            if key in done:
                raise ValueError(f"{step}: ran twice")
            done.add(key)
    missing = issued - done
    if missing:
        raise ValueError(f"issued but never waited: {sorted(missing)}")


def predecessors(step: Step, num_layers: int) -> list[tuple[int, int, str]]:
    """The (micro_batch, layer, stage) keys that must have finished before `step` may start.

    Derived from the stage table (`Stage.needs`): the dependency relation `check_schedule` enforces,
    the simulator times with, and the executors consume.
    """
    return _predecessors(step, num_layers)


def _predecessors(step: Step, num_layers: int) -> list[tuple[int, int, str]]:
    mb, layer = step.micro_batch, step.layer
    forward = step.direction is Direction.FORWARD
    previous_layer = layer - 1 if forward else layer + 1
    first_layer = 0 if forward else num_layers - 1
    keys: list[tuple[int, int, str]] = []
    for need in STAGES[step.stage].needs:
        if need.where is Where.SAME:
            keys.append((mb, layer, need.stage))
        elif need.where is Where.PREVIOUS and layer != first_layer:
            keys.append((mb, previous_layer, need.stage))
        elif need.where is Where.TURN and layer == first_layer:
            keys.append((mb, layer, need.stage))
    return keys


def _check_table() -> None:
    """Every dependency names a stage of the table (a typo would silently drop a rule)."""
    for stage in STAGES.values():
        for need in stage.needs:
            if need.stage not in STAGES:
                raise AssertionError(f"stage {stage.name!r} needs unknown stage {need.stage!r}")
        if (stage.kind is Kind.COMM) != (stage.to_role is not None) and stage.direction is Direction.FORWARD:
            raise AssertionError(f"stage {stage.name!r}: a forward COMM stage needs to_role, a COMPUTE one none")


_check_table()
