"""Expert placement: a plain table, expert id -> expert worker, that the engine routes by.

Kept a table (not arithmetic on ids) so that a load balancer can re-solve it, replicate experts or move
them off a failed worker without touching the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mbridge_epoverlap.errors import UsageError


@dataclass(frozen=True)
class Placement:
    """`owner[e]` is the index of the expert worker that holds expert `e` (global expert ids)."""

    owner: tuple[int, ...]
    workers: int

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UsageError(f"expert workers must be >= 1, got {self.workers}")
        bad = [e for e, w in enumerate(self.owner) if not 0 <= w < self.workers]
        if bad:
            raise UsageError(f"placement puts experts {bad[:8]} on workers outside 0..{self.workers - 1}")
        empty = sorted(set(range(self.workers)) - set(self.owner))
        if empty:
            raise UsageError(f"placement leaves expert workers {empty} without an expert; use at most "
                             f"{len(self.owner)} expert workers")

    @classmethod
    def balanced(cls, num_experts: int, workers: int) -> Placement:
        """Contiguous, equal shares (the first `num_experts % workers` workers hold one more)."""
        if workers > num_experts:
            raise UsageError(f"--expert-workers {workers} is more than the model's {num_experts} experts; "
                             f"use at most {num_experts}")
        base, extra = divmod(num_experts, workers)
        owner: list[int] = []
        for w in range(workers):
            owner += [w] * (base + (1 if w < extra else 0))
        return cls(tuple(owner), workers)

    def experts_of(self, worker: int) -> list[int]:
        """The global expert ids held by `worker`, ascending."""
        return [e for e, w in enumerate(self.owner) if w == worker]

    def to_list(self) -> list[int]:
        return list(self.owner)

    @classmethod
    def from_list(cls, owner: Sequence[int], workers: int) -> Placement:
        return cls(tuple(int(w) for w in owner), workers)
