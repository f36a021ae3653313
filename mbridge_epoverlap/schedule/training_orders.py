"""Training orders: the backward building blocks and the 1F1B orders, in the step vocabulary of `program`.

`one_f_one_b` is the order of one pipeline stage (PP=1), plain or combined (a forward layer interleaved
with a backward layer, `combined_layer_pair`); the pieces it is made of (`backward_segments`,
`interleave_segments`, `deferred_weight_gradients`) are here beside it. The stage table and the forward
pieces that serving orders share stay in `program`.
"""

from __future__ import annotations

from mbridge_epoverlap.schedule.program import (
    ATTN_DGRAD,
    ATTN_WGRAD,
    COMBINE_BWD,
    DISPATCH_BWD,
    EXPERTS_DGRAD,
    EXPERTS_WGRAD,
    EXPERTS_WGRAD_DOWN,
    POST_BWD,
    Step,
    forward_segments,
    forward_steps,
    issue,
    run,
    wait,
)


def backward_steps(mb: int, num_layers: int, *, delay_wgrad: bool = False) -> list[Step]:
    """Backward of one micro-batch through every layer (last layer first) with no overlap: its
    `backward_segments` one after the other.

    With `delay_wgrad`, each layer's expert weight gradient runs after its dispatch backward has been
    issued, and each layer's attention weight gradient after the combine backward of the layer below
    has been issued (the last layer's at the end): with no other micro-batch to overlap, weight
    gradients are what can fill those windows. This only moves work, it never changes a value.
    """
    return [step for segment in backward_segments(mb, num_layers, delay_wgrad=delay_wgrad) for step in segment]


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
