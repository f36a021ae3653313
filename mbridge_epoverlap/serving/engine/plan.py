"""What every serving worker process is told: the model, the layout, its requests (a JSON file).

Ranks 0..A-1 are attention workers and A..A+E-1 expert workers (disaggregated), or ranks 0..N-1 are
colocated workers; `role_of` is the one place that says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.program import Role

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
COLOCATED_ORDERS = ("two_batch_overlap", "sequential")


@dataclass(frozen=True)
class EnginePlan:
    """The engine's layout and workload.

    Attributes:
        source: checkpoint directory or recipe name (`serving.checkpoint.load_spec`).
        mode: "disaggregated" (attention and expert workers) or "colocated".
        attn_workers, expert_workers: disaggregated worker counts (A, E).
        processes: colocated process count (N).
        micro_batches: m, micro-batches in flight per attention worker.
        order: colocated order, "two_batch_overlap" or "sequential" (disaggregated always ping-pong).
        placement: expert id -> expert worker (or colocated rank).
        max_new_tokens: generation limit per request.
        max_batch: sequences decoding at once per attention worker (continuous batching).
        requests: per attention worker, its requests as {"id", "prompt_ids"}.
        backend: M2N backend name (`comm.m2n.make_communicator`).
        slot_bytes: M2N buffer size, enough for the largest message.
        timeout_s: limit of every wait between workers.
        num_layers, seed, dtype: recipe-model settings passed to `load_spec`.
        elastic: keep decoding through the loss of expert workers (`serving.elastic`).
        slots: elastic mode's physical slots, the expert in each (`eplb` phy2log, worker by worker).
        expert_restore: elastic mode may restore experts whose every replica died from the checkpoint.
        kill: fault injection, `(expert worker index, decode step)` pairs: that worker SIGKILLs itself then.
        rebalance_every: elastic mode re-solves the placement for the measured load every this many decode
            steps, moving weights between expert workers (0: never).
        rejoin_after_steps: elastic mode starts a replacement for a lost expert worker and admits it this many
            decode steps after the loss (0: never).
        weight_slot_bytes: M2N slot size of the channels between expert workers that carry moved weights.
    """

    source: str
    mode: str = DISAGGREGATED
    attn_workers: int = 1
    expert_workers: int = 1
    processes: int = 0
    micro_batches: int = 2
    order: str = "ping_pong"
    placement: tuple[int, ...] = ()
    max_new_tokens: int = 16
    max_batch: int = 64
    requests: tuple[tuple[dict[str, Any], ...], ...] = field(default=())
    backend: str = "m2n"
    slot_bytes: int = 1 << 20
    timeout_s: float = 30.0
    num_layers: int | None = None
    seed: int = 0
    dtype: str = "float32"
    elastic: bool = False
    slots: tuple[int, ...] = ()
    expert_restore: bool = True
    kill: tuple[tuple[int, int], ...] = ()
    rebalance_every: int = 0
    rejoin_after_steps: int = 0
    weight_slot_bytes: int = 0

    @property
    def layout_epochs(self) -> bool:
        """Whether the elastic layout can change at step boundaries (rebalancing or rejoining)."""
        return self.elastic and bool(self.rebalance_every or self.rejoin_after_steps)

    @property
    def world(self) -> int:
        return self.processes if self.mode == COLOCATED else self.attn_workers + self.expert_workers

    @property
    def attention_ranks(self) -> list[int]:
        return list(range(self.processes if self.mode == COLOCATED else self.attn_workers))

    @property
    def expert_ranks(self) -> list[int]:
        if self.mode == COLOCATED:
            return list(range(self.processes))
        return list(range(self.attn_workers, self.attn_workers + self.expert_workers))

    def role_of(self, rank: int) -> tuple[Role | None, int]:
        """(role, index within the role) of `rank`; role None means colocated (both roles)."""
        if self.mode == COLOCATED:
            return None, rank
        if rank < self.attn_workers:
            return Role.ATTENTION, rank
        return Role.EXPERT, rank - self.attn_workers

    def role_name(self, rank: int) -> str:
        """"attention worker 0", "expert worker 1", "colocated worker 2"."""
        role, index = self.role_of(rank)
        kind = "colocated worker" if role is None else f"{role.value} worker"
        return f"{kind} {index}"

    def rank_names(self) -> dict[int, str]:
        """How failure messages name each rank: role, index and rank."""
        return {rank: f"{self.role_name(rank)} (rank {rank})" for rank in range(self.world)}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EnginePlan:
        raw = json.loads(text)
        raw["placement"] = tuple(raw["placement"])
        raw["requests"] = tuple(tuple(r) for r in raw["requests"])
        raw["slots"] = tuple(raw.get("slots", ()))
        raw["kill"] = tuple(tuple(k) for k in raw.get("kill", ()))
        return cls(**raw)


def check_layout(*, attn_workers: int, expert_workers: int, micro_batches: int, processes: int, colocated: bool,
                 num_experts: int) -> None:
    """Raise UsageError for a layout no worker could run (before any starts)."""
    if colocated:
        if processes < 1:
            raise UsageError(f"--colocated {processes}: need at least one process")
        if processes > num_experts:
            raise UsageError(f"--colocated {processes} is more processes than the model's {num_experts} experts; "
                             f"use at most {num_experts}")
    else:
        if attn_workers < 1:
            raise UsageError(f"--attn-workers {attn_workers}: need at least one attention worker")
        if expert_workers < 1:
            raise UsageError(f"--expert-workers {expert_workers}: need at least one expert worker")
        if expert_workers > num_experts:
            raise UsageError(f"--expert-workers {expert_workers} is more than the model's {num_experts} experts; "
                             f"use at most {num_experts}")
    if micro_batches < 1:
        raise UsageError(f"--micro-batches {micro_batches}: need at least 1")
