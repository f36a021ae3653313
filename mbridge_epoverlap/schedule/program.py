"""The stage program of a MoE layer and the step vocabulary that schedules are written in.

A MoE layer is a short program of stages, each either COMPUTE or COMM. A schedule is an ordered
list of `Step`s over several micro-batches; the reference runtime executes a schedule for real and
the simulator turns the same list plus stage costs into a timeline. Neither executor reorders
steps, so a schedule is defined once and means the same thing to both.

A COMM stage is split in two steps: ISSUE starts the collective asynchronously, WAIT blocks until
it finished. Whatever runs between the two is overlapped with that communication.
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


def backward_steps(mb: int, num_layers: int, *, delay_wgrad: bool = False) -> list[Step]:
    """Backward of one micro-batch through every layer (last layer first) with no overlap: its
    `backward_segments` one after the other.

    With `delay_wgrad`, each layer's expert weight gradient runs after its dispatch backward has been
    issued, and each layer's attention weight gradient after the combine backward of the layer below
    has been issued (the last layer's at the end): with no other micro-batch to overlap, weight
    gradients are what can fill those windows. This only moves work, it never changes a value.
    """
    return [step for segment in backward_segments(mb, num_layers, delay_wgrad=delay_wgrad) for step in segment]


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


def expert_weight_gradients(mb: int, layer: int) -> list[Step]:
    """The experts' weight-gradient steps of (mb, layer): gate/up projection, then down projection."""
    return [run(mb, layer, EXPERTS_WGRAD.name), run(mb, layer, EXPERTS_WGRAD_DOWN.name)]


def backward_segments(mb: int, num_layers: int, *, delay_wgrad: bool) -> list[list[Step]]:
    """One micro-batch's backward split at its communication, like `forward_segments`.

    Per layer (top first): [finish the layer above (wait for its dispatch backward, attention dgrad and, unless
    delayed, wgrad), post backward, issue combine backward (then the delayed attention wgrad of the layer
    above)], [wait for the combine backward, expert dgrad, issue dispatch backward, with the expert wgrad before
    the issue or, delayed, after it]; then [wait for layer 0's dispatch backward, its attention dgrad and wgrad].
    """
    top = num_layers - 1
    segments: list[list[Step]] = []
    for layer in reversed(range(num_layers)):
        head: list[Step] = []
        if layer < top:
            head += [wait(mb, layer + 1, DISPATCH_BWD.name), run(mb, layer + 1, ATTN_DGRAD.name)]
            if not delay_wgrad:
                head.append(run(mb, layer + 1, ATTN_WGRAD.name))
        head += [run(mb, layer, POST_BWD.name), issue(mb, layer, COMBINE_BWD.name)]
        if delay_wgrad and layer < top:
            head.append(run(mb, layer + 1, ATTN_WGRAD.name))
        experts = [wait(mb, layer, COMBINE_BWD.name), run(mb, layer, EXPERTS_DGRAD.name)]
        if delay_wgrad:
            experts += [issue(mb, layer, DISPATCH_BWD.name), *expert_weight_gradients(mb, layer)]
        else:
            experts += [*expert_weight_gradients(mb, layer), issue(mb, layer, DISPATCH_BWD.name)]
        segments += [head, experts]
    return segments + [[wait(mb, 0, DISPATCH_BWD.name), run(mb, 0, ATTN_DGRAD.name), run(mb, 0, ATTN_WGRAD.name)]]


def interleave_segments(first: list[list[Step]], second: list[list[Step]]) -> list[Step]:
    """Two micro-batches' segments in turn, `second` one segment behind `first`: while one waits for a
    collective, the other computes (two-batch overlap)."""
    if len(first) != len(second):
        raise ValueError(f"segment lists differ in length: {len(first)} and {len(second)}")
    return [step for pair in zip(first, second, strict=True) for segment in pair for step in segment]


def deferred_weight_gradients(layer: tuple[int, int], *, split_expert_wgrad: bool) -> list[Step]:
    """What a pair leaves of its backward layer (micro-batch, layer) to the next combine-backward window: the
    attention weight gradient, and with `split_expert_wgrad` the experts' down-projection weight gradient."""
    steps = [run(*layer, ATTN_WGRAD.name)]
    if split_expert_wgrad:
        steps.append(run(*layer, EXPERTS_WGRAD_DOWN.name))
    return steps


def combined_layer_pair(forward: tuple[int, int] | None, backward: tuple[int, int] | None, *, delay_wgrad: bool,
                        backward_started: bool = False, next_backward: tuple[int, int] | None = None,
                        wgrad_before: tuple[int, int] | None = None, split_expert_wgrad: bool = False
                        ) -> list[Step]:
    """Forward of one layer interleaved with backward of another, either of them possibly absent.

    Megatron-Core's order of the pair (`TransformerLayerSchedulePlan.run`): B's combine backward, F's attention,
    B's expert dgrad, F's dispatch, (B's expert wgrad,) B's dispatch backward, F's experts, F's combine, B's
    attention dgrad and wgrad, F's post; on the communication channel, combine_bwd, dispatch, dispatch_bwd,
    combine. Each collective is issued as soon as its input exists (F's dispatch right after F's attention, F's
    combine right after F's experts, queued behind the other micro-batch's collective on the channel) and waited
    for only where the next stage needs it, so a collective's window is everything the other micro-batch
    computes in between. With only a forward (the first micro-batch) or only a backward (the last one) the
    same order runs with the other half left out, as Megatron-Core's does.

    Where the project differs, and why (all measured with the simulator on the stage costs of the CPU runtime
    behind a 1 Gbit/s link, see docs/training/communication-overlap.md):

    - Delayed expert wgrad runs after B's dispatch backward was issued, in its window; Megatron-Core runs it
      before the issue, where it only fills the forward dispatch's window.
    - `next_backward`: right after B's attention dgrad, the post backward of the next backward layer runs and
      its combine backward is issued, so that collective already flies during F's post and the next pair's F
      attention. Megatron-Core gets the same from its streams (the comm stream starts the next combine backward
      as soon as its input exists); with explicit issue steps it has to be written here. With paired edges
      (`one_f_one_b`) the next backward micro-batch's forward finished a round earlier, so after B's layer 0
      the next micro-batch's top layer starts the same way.
    - B's attention wgrad does not run at the end of its own pair but in the next one
      (`wgrad_before`), after that pair's F attention and dispatch issue and before its combine-backward
      wait. It still fills the same combine-backward window, but the next forward dispatch is issued one
      attention wgrad earlier, so it starts on the channel as soon as the combine backward ends instead of
      after a gap; after the last pair it fills the first window of the lone last backward, which otherwise has
      nothing to hide behind. Megatron-Core runs it at the end of the pair (except for the first layer of a
      backward, which it delays to after the pipeline send). Without delayed wgrad it sits in the same place
      (the dispatch-backward window would hide a little more there): the delayed order stays the plain one
      with only the expert wgrad moved past an issue.
    - `split_expert_wgrad` (with delayed wgrad, off by default): the experts' down-projection weight gradient
      (`experts_wgrad_down`, a third of their weight-gradient work) goes with B's attention wgrad into the next
      pair's combine-backward window, the gate/up part stays in the dispatch-backward window. On the CPU
      runtime's stage costs behind a 1 Gbit/s link the whole expert wgrad there leaves the combine-backward
      window short and the dispatch-backward one with room to spare; on other costs moving work past waits can
      cost time, so the delayed order without it is the default (it is never slower than no delay).

    Args:
        forward: (micro-batch, layer) of the forward half, or None.
        backward: (micro-batch, layer) of the backward half, or None.
        delay_wgrad: run the expert weight gradient after the dispatch backward was issued (in its window),
            not right after the expert dgrad.
        backward_started: B's post backward ran and its combine backward was issued already (by the previous
            pair, see `next_backward`).
        next_backward: (micro-batch, layer) whose post backward runs and whose combine backward is issued right
            after B's attention dgrad (B's next layer, or the next micro-batch's top layer), or None.
        wgrad_before: (micro-batch, layer) of the backward layer whose `deferred_weight_gradients` run in
            this pair's combine-backward window (the previous pair's backward layer), or None.
        split_expert_wgrad: with `delay_wgrad`, leave B's down-projection expert wgrad to the next pair.

    Returns:
        The pair's steps, without B's `deferred_weight_gradients`: the caller passes `backward` as
        `wgrad_before` of the next pair (or runs them at the end).
    """
    steps: list[Step] = []
    if backward is not None and not backward_started:
        steps += [run(*backward, "post_bwd"), issue(*backward, "combine_bwd")]
    if forward is not None:
        steps += [run(*forward, "attn"), issue(*forward, "dispatch")]
    if wgrad_before is not None:
        steps += deferred_weight_gradients(wgrad_before, split_expert_wgrad=split_expert_wgrad)
    if backward is not None:
        steps += [wait(*backward, "combine_bwd"), run(*backward, "experts_dgrad")]
        wgrads = expert_weight_gradients(*backward)
        if not delay_wgrad:
            steps += wgrads
        steps.append(issue(*backward, "dispatch_bwd"))
        if delay_wgrad:
            # With the split, the down projection's part is left to the next pair (`deferred_weight_gradients`).
            steps += wgrads[:1] if split_expert_wgrad else wgrads
    if forward is not None:
        steps += [wait(*forward, "dispatch"), run(*forward, "experts"), issue(*forward, "combine")]
    if backward is not None:
        steps += [wait(*backward, "dispatch_bwd"), run(*backward, "attn_dgrad")]
        if next_backward is not None:
            steps += [run(*next_backward, "post_bwd"), issue(*next_backward, "combine_bwd")]
    if forward is not None:
        steps += [wait(*forward, "combine"), run(*forward, "post")]
    return steps


def one_f_one_b(num_micro_batches: int, num_layers: int, *, overlap: bool, delay_wgrad: bool = False,
                paired_edges: bool = True, split_expert_wgrad: bool = False) -> list[Step]:
    """The 1F1B order for one pipeline stage (PP=1).

    Plain (no overlap): F0, then F_i and B_i-1 one after the other, then the last B. Combined 1F1B (overlap):
    F0 and F1 interleaved, (F_i, B_i-2) pairs, B_M-2 and B_M-1 interleaved; with `paired_edges=False`
    Megatron-Core's F0 alone, (F_i, B_i-1) pairs, the last B alone.

    Args:
        num_micro_batches: micro-batches per iteration (>= 1).
        num_layers: MoE layers in the model (>= 1).
        overlap: False runs each F and B whole, one after the other (the baseline); True interleaves
            a forward with a backward layer pair by layer pair (combined 1F1B), F going up while B comes
            down, each pair starting the next B layer's combine backward before it ends and leaving its
            attention weight gradient to the next pair's combine-backward window (`combined_layer_pair`).
        delay_wgrad: delay expert weight gradients into the dispatch-backward window (needs overlap
            to hide anything; allowed without it for testing).
        paired_edges: with overlap and at least two micro-batches, the first two forwards run interleaved
            (two-batch overlap) instead of micro-batch 0's forward alone, and likewise the last two backwards,
            so the collectives of the iteration's first forward and last backward have the other micro-batch's
            compute beside them; the pairs in between are (F_i+2, B_i), and a backward's layer 0 starts the
            next micro-batch's top layer, whose forward already finished. Megatron-Core runs the first forward
            and the last backward alone (False here): pairing keeps one more micro-batch's activations alive.
            Ignored without overlap.
        split_expert_wgrad: with overlap and delayed wgrad, run each layer's down-projection expert weight
            gradient in the next pair's combine-backward window (`combined_layer_pair`); ignored otherwise.

    Every order runs each backward stage of a layer for the micro-batches in increasing order, so gradients
    accumulate in the same order and the losses and gradients are bitwise identical.
    """
    if num_micro_batches < 1 or num_layers < 1:
        raise ValueError(f"need num_micro_batches >= 1 and num_layers >= 1, got {num_micro_batches}, {num_layers}")
    if not overlap:
        steps = forward_steps(0, num_layers)
        for mb in range(1, num_micro_batches):
            steps += forward_steps(mb, num_layers)
            steps += backward_steps(mb - 1, num_layers, delay_wgrad=delay_wgrad)
        return steps + backward_steps(num_micro_batches - 1, num_layers, delay_wgrad=delay_wgrad)
    top = num_layers - 1
    units: list[tuple[tuple[int, int] | None, tuple[int, int] | None]] = []
    steps: list[Step] = []
    paired = paired_edges and num_micro_batches >= 2
    if paired:
        # F0 and F1 interleaved; F1's last combine is waited for only once B0 has started its first collective.
        first, second = forward_segments(0, num_layers), forward_segments(1, num_layers)
        steps += interleave_segments(first[:-1], second[:-1]) + first[-1]
        steps += [run(0, top, POST_BWD.name), issue(0, top, COMBINE_BWD.name)] + second[-1]
        for mb in range(2, num_micro_batches):
            units += [((mb, i), (mb - 2, top - i)) for i in range(num_layers)]
    else:
        # Megatron-Core's phases: F0 alone, (F_i, B_{i-1}) pairs, the last B alone; within a phase F walks the
        # layers upwards while B walks them downwards, so F layer i pairs with B layer L-1-i.
        units += [((0, i), None) for i in range(num_layers)]
        for mb in range(1, num_micro_batches):
            units += [((mb, i), (mb - 1, top - i)) for i in range(num_layers)]
        units += [(None, (num_micro_batches - 1, top - i)) for i in range(num_layers)]
    pending_wgrad: tuple[int, int] | None = None
    split = split_expert_wgrad and delay_wgrad
    for forward, backward in units:
        # The previous unit started B's layer (ran its post backward, issued its combine backward), except for a
        # new micro-batch's top layer in Megatron-Core's order, whose forward ends only in the previous unit.
        started = backward is not None and (backward[1] != top or paired)
        next_backward = None
        if backward is not None and backward[1] > 0:
            next_backward = (backward[0], backward[1] - 1)
        elif backward is not None and paired:
            next_backward = (backward[0] + 1, top)
        steps += combined_layer_pair(forward, backward, delay_wgrad=delay_wgrad, backward_started=started,
                                     next_backward=next_backward, wgrad_before=pending_wgrad,
                                     split_expert_wgrad=split)
        if backward is not None:
            pending_wgrad = backward
    if not paired:
        if pending_wgrad is not None:
            steps += deferred_weight_gradients(pending_wgrad, split_expert_wgrad=split)
        return steps
    # The last two backwards interleaved; the last pair's attention wgrad fills the first combine-backward window.
    last_but_one = backward_segments(num_micro_batches - 2, num_layers, delay_wgrad=delay_wgrad)
    last = backward_segments(num_micro_batches - 1, num_layers, delay_wgrad=delay_wgrad)
    # Its top layer was started after the first two forwards (two micro-batches) or by the last pair.
    last_but_one[0] = []
    if pending_wgrad is not None:
        last_but_one[0] += deferred_weight_gradients(pending_wgrad, split_expert_wgrad=split)
    return steps + interleave_segments(last_but_one, last)


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
