"""Greedy sampling and the stop rules of generation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def greedy(logits: torch.Tensor) -> list[int]:
    """The most likely token of each row ([n, vocab] -> n ids); the lowest id wins a tie, as `argmax` does."""
    return torch.argmax(logits, dim=-1).tolist()


@dataclass(frozen=True)
class StopRule:
    """A sequence stops after an end-of-sequence token (kept in the output) or `max_new_tokens` tokens."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()

    def done(self, generated: Sequence[int]) -> bool:
        """Whether a sequence that has produced `generated` (new tokens only) is finished."""
        if len(generated) >= self.max_new_tokens:
            return True
        return bool(generated) and generated[-1] in self.eos_token_ids
