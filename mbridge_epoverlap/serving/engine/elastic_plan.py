"""An engine plan in elastic mode: redundant expert slots, fault injection, rebalancing and rejoining.

The layout maths (slot tables, the alive set, re-placement) is `serving.elastic.layout`; this module only
checks an engine plan against it and fills in the plan's elastic fields.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mbridge_epoverlap.comm.m2n import BACKENDS, communicator_class
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.elastic.layout import ElasticLayout, check_elastic
from mbridge_epoverlap.serving.engine.plan import COLOCATED, EnginePlan


def make_elastic(plan: EnginePlan, *, redundant: int, kill: int = 0, kill_step: int = 4, restore: bool = True,
                 rebalance_every: int = 0, rejoin_after_steps: int = 0, kill_every: int = 0,
                 rebalance_threshold: float | None = None, rejoin_hold: bool = False) -> EnginePlan:
    """`plan` (disaggregated, from `run.make_plan`) in elastic mode with `redundant` extra expert slots.

    Args:
        plan: the engine plan.
        redundant: redundant expert slots over all expert workers.
        kill: fault injection: this many expert workers (the first ones) SIGKILL themselves mid-decode.
        kill_step: the decode step they die in (the first of them, with `kill_every`).
        restore: whether experts whose every replica died may be restored from the checkpoint.
        rebalance_every: re-solve the placement for the measured expert load every this many decode steps,
            moving the weights that change owner between expert workers (0: never).
        rejoin_after_steps: start a replacement for each lost expert worker and admit it at the first step
            boundary this many or more decode steps after the loss where it is ready (0: never).
        rejoin_hold: hold decoding at that boundary until the replacement is ready (up to half the timeout),
            which fixes the step it joins at the cost of a pause.
        kill_every: one victim every this many decode steps, one after another (0: all at `kill_step`).
        rebalance_threshold: skip a periodic rebalance while max/mean load is at most this (>= 1; None: 1.1,
            or above what random routing of the window's pairs would give, `elastic.workers.routing_noise`).

    Raises:
        UsageError: a colocated plan, a backend whose class lacks what elastic serving needs (`resumable_wait`;
            `connects_late` for replacements), a layout `check_elastic` rejects, or a negative period.
    """
    from mbridge_epoverlap.serving.model.expert_store import weight_slot_bytes

    if plan.mode == COLOCATED:
        raise UsageError("--elastic applies to disaggregated serving (attention and expert workers); drop --colocated")
    if not communicator_class(plan.backend).resumable_wait:  # the expert worker's sliced waits need it
        resumable = [name for name in sorted(BACKENDS) if communicator_class(name).resumable_wait]
        raise UsageError(f"--backend {plan.backend} cannot serve --elastic: an expert worker waits in short slices "
                         "(to serve resends in between) and this backend aborts a wait that times out; use "
                         f"--backend {' or '.join(resumable)}")
    if kill_step < 1:
        raise UsageError(f"kill step {kill_step} must be >= 1 (mid-decode, after the prefill step)")
    if kill_every < 0:
        raise UsageError(f"--kill-every {kill_every} must be >= 1 (decode steps between kills), or 0 to kill at once")
    if rebalance_every < 0:
        raise UsageError(f"--rebalance-every {rebalance_every} must be >= 1 (decode steps between rebalances), "
                         "or 0 to keep the start placement")
    if rebalance_threshold is not None and not rebalance_threshold >= 1.0:  # also NaN
        raise UsageError(f"--rebalance-threshold {rebalance_threshold} must be >= 1 (max/mean expert load at or "
                         "below which a rebalance is skipped; 1 rebalances whenever that helps)")
    if rejoin_after_steps < 0:
        raise UsageError(f"--rejoin-after-steps {rejoin_after_steps} must be >= 1 (decode steps between a loss and "
                         "the replacement's admission), or 0 to go on without replacements")
    if rejoin_after_steps and not communicator_class(plan.backend).connects_late:
        joinable = [name for name in sorted(BACKENDS) if communicator_class(name).connects_late]
        raise UsageError(f"--backend {plan.backend} cannot serve --rejoin-after-steps: a replacement worker joins "
                         f"after set-up and this backend opens no channel then; use --backend {' or '.join(joinable)}")
    spec = plan.load_spec()
    check_elastic(spec.num_experts, plan.expert_workers, redundant, kill)
    layout = ElasticLayout.initial(spec.num_experts, plan.expert_workers, redundant, routing_groups(spec))
    victims = kill_schedule(kill, kill_step, kill_every)
    moving = rebalance_every or rejoin_after_steps
    return replace(plan, elastic=True, slots=layout.slots, expert_restore=restore, kill=victims,
                   rebalance_every=rebalance_every, rejoin_after_steps=rejoin_after_steps,
                   rebalance_threshold=rebalance_threshold or 0.0,
                   rejoin_hold=bool(rejoin_hold and rejoin_after_steps),
                   weight_slot_bytes=weight_slot_bytes(spec, layout.slots_per_worker) if moving else 0)


def routing_groups(spec: Any) -> int:
    """The expert groups the placement keeps together (`ElasticLayout.initial`): the model's routing groups for
    a group-limited router (DeepSeek-V3, GLM-4.5), else 1. The expert workers share one host in this engine
    (`engine.hosts` puts them all on the expert host), so the nodes are sets of workers."""
    return spec.grouped_routing.n_group if spec.grouped_routing is not None else 1


def kill_schedule(kill: int, kill_step: int, kill_every: int = 0) -> tuple[tuple[int, int], ...]:
    """Fault injection's `(expert worker, decode step)` pairs: the first `kill` workers, all at `kill_step`, or
    one every `kill_every` steps from it."""
    return tuple((worker, kill_step + worker * kill_every) for worker in range(kill))


def check_kills(num_experts: int, expert_workers: int, redundant: int, victims: tuple[tuple[int, int], ...], *,
                restore: bool, steps: int, groups: int = 1) -> None:
    """Raise UsageError (before start) for kills that cannot happen or cannot be survived.

    Each kill must fall inside decoding (before the last of `steps` tokens); without `restore` no kill may take
    every replica of an expert, followed through the re-placements the workers make (one loss after another,
    or those of one step at once); `groups`: the model's routing groups (`routing_groups`), which the
    placements keep together.
    """
    last = max((step for _, step in victims), default=0)
    if last >= steps - 1:
        raise UsageError(f"a kill at decode step {last} falls after decoding ends (--steps {steps} tokens: decode "
                         f"steps 1..{steps - 2} are mid-decode); lower --kill-step or --kill-every, or raise --steps")
    if restore:
        return
    layout = ElasticLayout.initial(num_experts, expert_workers, redundant, groups)  # as `make_elastic` places
    for step in sorted({step for _, step in victims}):
        dead = {worker for worker, at in victims if at == step}
        layout, orphans = layout.without(dead)
        if orphans:
            raise UsageError(f"--no-expert-restore: the kill of expert workers {sorted(dead)} at decode step {step} "
                             f"takes every replica of experts {orphans}, and no copy may restore them; raise "
                             "--redundant-experts, kill fewer (--kill) or drop --no-expert-restore")
