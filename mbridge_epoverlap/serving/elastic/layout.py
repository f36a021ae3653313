"""Elastic expert parallelism for the disaggregated engine: redundant expert slots, and re-placement after a loss.

The placement comes from `eplb`: `num_experts + redundant` physical slots laid out worker by worker
(`slots_per_worker` each), one table for every MoE layer (the workers hold the same experts in every layer).
A token's expert runs on replica `position % replica count` (`eplb.choose_replicas`), so every attention
worker routes the same token the same way without asking anybody.

When expert workers die, every survivor derives the same new table from the same inputs (the initial layout
and the alive set): `eplb.rebalance_over_survivors` with the dead workers' slots left empty. The alive set
travels as a bit mask in every dispatch's control tensor and is merged by AND (a worker once dead stays
dead), so expert workers learn of a loss from the first message that carries it, without a map exchange.
Experts whose every replica died (`eplb.orphaned_experts`) are restored by their new holders from the
checkpoint on disk (a recipe model redraws them from its seed): with `restore=False` there is no copy, and
the loss ends the run naming those experts.

A placement can also change while requests flow, at a step boundary, as a new layout *epoch*: periodic
rebalancing (`ElasticLayout.rebalanced`, the placement in force changed slot by slot for the load the attention
workers measured, or `ElasticLayout.resolved` from scratch when that balances clearly better) and a replacement
expert worker joining back (`sync` decides when; `moves` moves the weights). The
epoch's table travels in the control tensor beside the alive mask; within an epoch, losses still follow the
mask rule above.

An engine plan in elastic mode is built in the engine room (`serving.engine.elastic_plan.make_elastic`),
from `check_elastic` and `ElasticLayout.initial` here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.serving.elastic import eplb
from mbridge_epoverlap.serving.elastic.incremental import incremental_slots


class ExpertsLostError(RunFailedError):
    """Every replica of some experts died and there is no weight copy to restore them from."""

    def __init__(self, experts: Sequence[int], dead: Sequence[int]) -> None:
        self.experts = list(experts)
        super().__init__(f"experts {self.experts} lost every replica with expert workers {list(dead)} and there "
                         "is no weight copy to restore them from; run with expert restore enabled (drop "
                         "--no-expert-restore) or more redundant experts")


def check_elastic(num_experts: int, expert_workers: int, redundant: int, kill: int = 0) -> None:
    """Raise UsageError (before start) for an elastic layout that cannot run or cannot survive `kill` losses."""
    if redundant < 0:
        raise UsageError(f"--redundant-experts {redundant} must be >= 0")
    if kill >= expert_workers:
        raise UsageError(f"--kill {kill} of {expert_workers} expert workers leaves no expert worker; kill at most "
                         f"{expert_workers - 1} or add expert workers")
    total = num_experts + redundant
    if total % expert_workers:
        fit = -(-total // expert_workers) * expert_workers - num_experts
        raise UsageError(f"{num_experts} experts + --redundant-experts {redundant} = {total} slots do not divide over "
                         f"--expert-workers {expert_workers}; every worker holds the same number of slots: use "
                         f"--redundant-experts {fit}")
    per_worker = total // expert_workers
    if per_worker > num_experts:
        raise UsageError(f"--redundant-experts {redundant} gives each of the {expert_workers} expert workers "
                         f"{per_worker} slots, more than the model's {num_experts} experts; use at most "
                         f"{num_experts * expert_workers - num_experts} redundant experts")
    eplb.check_elastic_layout(num_experts, total, expert_workers, kill)


def expert_grouping(num_experts: int, workers: int, num_slots: int, groups: int = 1,
                    hosts: int = 1) -> tuple[int, int]:
    """`(groups, nodes)` of the placements for a model routed in `groups` expert groups on `workers` expert
    workers spanning `hosts` hosts with `num_slots` slots: `eplb.group_nodes`, and `(1, 1)` (the global policy)
    where no node split fits. Every process of a run calls it with the same arguments."""
    nodes = eplb.group_nodes(groups, workers, num_slots, num_experts, hosts)
    return (groups, nodes) if nodes > 1 else (1, 1)


@dataclass(frozen=True)
class ElasticLayout:
    """One placement of `num_experts` experts in `workers * slots_per_worker` slots, and who is alive.

    Attributes:
        num_experts: logical experts per MoE layer.
        workers: expert workers at start.
        slots: `phy2log` of the placement: the expert in each physical slot (`eplb.EMPTY_SLOT` on a dead worker).
        alive: indices of the live expert workers.
        groups: the model's expert routing groups the placement keeps together (1: none).
        nodes: sets of expert workers the groups are packed onto (`eplb.group_nodes`; 1: the global policy).
            Every process derives the same placements only if they all hold the same `groups` and `nodes`.
    """

    num_experts: int
    workers: int
    slots: tuple[int, ...]
    alive: frozenset[int]
    groups: int = 1
    nodes: int = 1

    @classmethod
    def from_slots(cls, num_experts: int, workers: int, slots: Sequence[int], groups: int = 1,
                   nodes: int = 1) -> ElasticLayout:
        """The layout a slot table describes; a worker is alive when its slots hold experts."""
        per = len(slots) // workers
        alive = frozenset(w for w in range(workers) if slots[w * per] != eplb.EMPTY_SLOT)
        return cls(num_experts, workers, tuple(int(e) for e in slots), alive, groups, nodes)

    @classmethod
    def initial(cls, num_experts: int, workers: int, redundant: int, groups: int = 1,
                hosts: int = 1) -> ElasticLayout:
        """The start placement: `eplb.rebalance_experts` on a uniform load (no load measured yet).

        `groups`: the model's routing groups (`GroupedRouting.n_group`; 1 without); `hosts`: hosts the expert
        workers span. With groups the hierarchical policy keeps each group's experts on one node
        (`eplb.group_nodes`), so a token's experts, drawn from a few groups, reach a few nodes."""
        check_elastic(num_experts, workers, redundant)
        groups, nodes = expert_grouping(num_experts, workers, num_experts + redundant, groups, hosts)
        solved = eplb.rebalance_experts(torch.ones(1, num_experts), num_experts + redundant, groups, nodes, workers)
        slots = spread_replicas(solved.phy2log[0].tolist(), workers, nodes)
        return cls(num_experts, workers, slots, frozenset(range(workers)), groups, nodes)

    @property
    def slots_per_worker(self) -> int:
        return len(self.slots) // self.workers

    @property
    def mask(self) -> int:
        """The alive set as bits (bit w: expert worker w is alive)."""
        return sum(1 << w for w in self.alive)

    def experts_of(self, worker: int) -> list[int]:
        """The distinct experts `worker` holds, ascending (empty for a dead worker)."""
        return sorted(set(eplb.experts_on_gpus(torch.tensor(self.slots), self.workers)[worker]))

    def replica_counts(self) -> list[int]:
        return [self.slots.count(e) for e in range(self.num_experts)]

    def without(self, dead: Iterable[int]) -> tuple[ElasticLayout, list[int]]:
        """The placement re-solved over the survivors, and the experts whose every replica died.

        Raises:
            UsageError: the survivors' slots cannot hold every expert (names the experts left out).
        """
        alive = self.alive - set(dead)
        if alive == self.alive:
            return self, []
        if not alive:
            raise UsageError(f"every expert worker is lost ({sorted(self.alive)}); an elastic run needs at least one")
        orphans = eplb.orphaned_experts(torch.tensor([self.slots]), self.workers, sorted(alive)).get(0, [])
        return self.resolved(alive), orphans

    def resolved(self, alive: Iterable[int], load: torch.Tensor | None = None) -> ElasticLayout:
        """The placement solved afresh over the workers `alive` for `load` (`[experts]` token counts; uniform
        when None): `eplb.rebalance_over_survivors`, then `spread_replicas`. A function of its inputs only, so
        every worker that calls it with the same alive set and load gets the same table."""
        alive = frozenset(alive)
        weight = torch.ones(1, self.num_experts) if load is None else load.reshape(1, -1).to(torch.float64)
        solved = eplb.rebalance_over_survivors(weight, len(self.slots), self.workers, sorted(alive),
                                               num_groups=self.groups, num_nodes=self.nodes)
        slots = spread_replicas(solved.phy2log[0].tolist(), self.workers, self.nodes)
        return replace(self, slots=slots, alive=alive)

    def rejoined(self, joined: Iterable[int], load: torch.Tensor | None = None) -> ElasticLayout:
        """This placement with the workers `joined` back: each empty slot of theirs, in slot order, takes the expert
        of most load per replica (`load`: `[experts]` token counts; uniform when None, so the fewest replicas;
        the lowest id on ties) that its worker does not hold yet, and every other slot stays.

        Only the newcomers receive weights. A solve from scratch (`resolved`) places every copy anew, and on 8
        workers moved all 16 copies at a rejoin, every survivor building and packing a new share and decoding
        slower for the steps after it. Deterministic, as `resolved`.
        """
        joined = sorted(set(joined) - self.alive)
        weight = [1.0] * self.num_experts if load is None else [float(x) for x in load.reshape(-1).tolist()]
        slots = list(self.slots)
        replicas = [0] * self.num_experts
        for expert in slots:
            if expert >= 0:
                replicas[expert] += 1
        per = self.slots_per_worker
        for worker in joined:
            held = {e for e in slots[worker * per:(worker + 1) * per] if e >= 0}
            for slot in range(worker * per, (worker + 1) * per):
                if slots[slot] >= 0:
                    continue
                free = [e for e in range(self.num_experts) if e not in held]
                expert = max(free, key=lambda e: (weight[e] / max(replicas[e], 1) if replicas[e] else float("inf"),
                                                  -e))
                slots[slot] = expert
                held.add(expert)
                replicas[expert] += 1
        return replace(self, slots=tuple(slots), alive=self.alive | set(joined))

    def rebalanced(self, load: torch.Tensor, goal: float) -> ElasticLayout:
        """This placement changed only where the balance needs it, for `load` (`[experts]` token counts), until
        max/mean load reaches `goal` (`incremental.incremental_slots`; same live workers). Deterministic, as
        `resolved`."""
        slots = incremental_slots(self.slots, self.workers, self.alive, load.reshape(-1).tolist(), goal)
        return replace(self, slots=slots)

    def imbalance(self, load: torch.Tensor) -> float:
        """max/mean load over the live workers for `load` (`[experts]` token counts), replicas sharing evenly."""
        value = eplb.imbalance(load.reshape(1, -1), torch.tensor([self.slots]), self.workers, sorted(self.alive))
        return float(value[0])

    def with_mask(self, mask: int) -> tuple[ElasticLayout, list[int]]:
        """`without` the workers whose bit is clear in `mask` (merge by AND: the dead stay dead)."""
        return self.without(w for w in self.alive if not mask >> w & 1)

    def router(self) -> Router:
        return Router(self)


def spread_replicas(slots: Sequence[int], workers: int, nodes: int = 1) -> tuple[int, ...]:
    """Move replicas of one expert that landed on one worker onto workers without it (deterministic swaps).

    The packing balances load only, so equal loads can put both replicas of an expert on one worker, where
    they protect nothing. Each such slot swaps with the first slot (in slot order) of another live worker
    whose expert the first worker lacks and which lacks the duplicated expert; workers of the same node
    (`nodes` equal sets of consecutive workers) come first, so the swap keeps the node's expert groups on it.
    """
    table = list(slots)
    per = len(table) // workers
    per_node = workers // nodes
    rows = [table[w * per:(w + 1) * per] for w in range(workers)]
    for w, row in enumerate(rows):
        for i, expert in enumerate(row):
            if expert == eplb.EMPTY_SLOT or row.index(expert) == i:
                continue
            for v in sorted(range(workers), key=lambda v: (v // per_node != w // per_node, v)):
                other = rows[v]
                if v == w or eplb.EMPTY_SLOT in other or expert in other:
                    continue
                j = next((j for j, y in enumerate(other) if y not in row), None)
                if j is not None:
                    row[i], other[j] = other[j], expert
                    break
    return tuple(e for row in rows for e in row)


class Router:
    """Per token and choice, the expert worker that runs it under one layout.

    The rule of `eplb.choose_replicas` (replica `position % replica count`, replicas in slot order), with
    the slot -> worker step folded into one table so a dispatch costs three indexing operations.
    """

    def __init__(self, layout: ElasticLayout) -> None:
        phy2log = torch.tensor([layout.slots])
        log2phy, logcnt = eplb.logical_maps(phy2log, layout.num_experts)
        self.log2phy, self.logcnt = log2phy[0], logcnt[0]
        self.per_worker = layout.slots_per_worker
        # Slot -> worker for every (expert, replica); padding (-1) stays -1 and is never indexed (count > 0).
        self.replica_worker = torch.where(self.log2phy >= 0, torch.div(self.log2phy, self.per_worker,
                                                                         rounding_mode="floor"), -1)
        self.counts = self.logcnt.clamp(min=1)  # every expert has a live replica once `without` succeeded

    def workers(self, expert_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`[tokens, k]` expert worker index of each (token, choice)."""
        replica = positions.view(-1, 1) % self.counts[expert_ids]
        return self.replica_worker[expert_ids, replica]
