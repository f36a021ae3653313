"""Serving (decode) schedules written in the same step vocabulary as training.

Decode runs only the forward program of each layer: attn | dispatch | experts | combine | post.
Every ordering here is a plain list of `Step`s, valid under `check_schedule`, that the runtime can
execute and the simulator can time; which worker runs a step is a separate `Resources` mapping
(`COLOCATED_RESOURCES` or `DISAGGREGATED_RESOURCES`).
"""

from __future__ import annotations

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.program import (
    Step,
    attention_segment,
    expert_segment,
    forward_segments,
    forward_steps,
    forward_tail,
)


def _check_sizes(num_micro_batches: int, num_layers: int) -> None:
    if num_micro_batches < 1:
        raise UsageError(f"micro-batches must be >= 1, got {num_micro_batches}; use at least 1")
    if num_layers < 1:
        raise UsageError(f"layers must be >= 1, got {num_layers}; use at least 1")


def ping_pong(num_micro_batches: int, num_layers: int) -> list[Step]:
    """MegaScale-Infer's ping-pong pipeline of `m` micro-batches between attention and expert workers.

    Per layer the attention worker handles micro-batches 0..m-1 in turn, each sent to the experts as
    soon as its attention finished; the expert worker handles them in the same order and sends each
    back. While micro-batch i is on the expert side (or in flight), the attention worker computes
    the others, which is what hides the M2N transfers. Run it with `DISAGGREGATED_RESOURCES` resources.

    Args:
        num_micro_batches: micro-batches in flight (m >= 1); m = 1 is the no-overlap baseline.
        num_layers: MoE layers (L >= 1).

    Returns:
        The step list. Each worker's own steps appear in the order it executes them, and every step
        comes after the steps it depends on, so the list is a valid global order too.
    """
    _check_sizes(num_micro_batches, num_layers)
    steps: list[Step] = []
    for layer in range(num_layers):
        steps += ping_pong_round(num_micro_batches, layer)
    return steps + ping_pong_tail(num_micro_batches, num_layers)


def ping_pong_round(num_micro_batches: int, layer: int) -> list[Step]:
    """The steps of `ping_pong` that bring every micro-batch through `layer`'s attention and experts.

    `ping_pong(m, L)` is rounds 0..L-1 then `ping_pong_tail(m, L)`. Decode steps chain the same way: the
    next token's first layer follows the last layer as any layer follows the one before, so a worker
    that numbers layers across decode steps (round `s * L + l` is layer `l` of step `s`) runs the
    ping-pong of every step back to back, without draining the pipeline between steps; this is
    `ping_pong(m, S * L)` for S steps, which the simulator can time as it is.
    """
    mbs = range(num_micro_batches)
    steps: list[Step] = []
    for mb in mbs:
        steps += attention_segment(mb, layer)
    for mb in mbs:
        steps += expert_segment(mb, layer)
    return steps


def ping_pong_tail(num_micro_batches: int, num_layers: int) -> list[Step]:
    """What follows the last round of a `ping_pong` over `num_layers` layers: the last combines and posts."""
    return [step for mb in range(num_micro_batches) for step in forward_tail(mb, num_layers)]


def two_batch_overlap(num_micro_batches: int, num_layers: int) -> list[Step]:
    """SGLang-style two-batch overlap on one worker, communication on a side channel.

    Micro-batches advance segment by segment in turn, micro-batch i+1 one segment behind micro-batch
    i: while one waits for its dispatch or combine, the other computes. With more than two
    micro-batches the same round-robin applies. Run it with `COLOCATED_RESOURCES` resources.

    Args:
        num_micro_batches: micro-batches interleaved (m >= 1; 2 is the usual choice).
        num_layers: MoE layers (L >= 1).
    """
    _check_sizes(num_micro_batches, num_layers)
    per_mb = [forward_segments(mb, num_layers) for mb in range(num_micro_batches)]
    steps: list[Step] = []
    for index in range(len(per_mb[0])):
        for segments in per_mb:
            steps += segments[index]
    return steps


def sequential(num_micro_batches: int, num_layers: int) -> list[Step]:
    """Colocated serving with no overlap: each micro-batch's forward runs whole, one after the other."""
    _check_sizes(num_micro_batches, num_layers)
    return [step for mb in range(num_micro_batches) for step in forward_steps(mb, num_layers)]


# The colocated orders by the name `--order` takes, each called as (m, L).
COLOCATED_ORDERS = {"two_batch_overlap": two_batch_overlap, "sequential": sequential}
