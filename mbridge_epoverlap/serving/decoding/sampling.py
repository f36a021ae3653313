"""Greedy and random (temperature, top-p, top-k, seeded) sampling, and the stop rules of generation."""

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


@dataclass(frozen=True)
class SamplingParams:
    """Random sampling of one request (temperature > 0; temperature 0 is greedy and never reaches here).

    Attributes:
        temperature: the logits are divided by it.
        top_p: keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
        top_k: keep the `top_k` most likely tokens (0: all).
        seed: seeds the request's own generator; the same request and seed give the same tokens on every
            layout (the logits are bitwise the same). None: a fresh seed.
    """

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def generator(self) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from a row of logits ([vocab]) by `params`, drawn with `generator`."""
    scaled = logits.float() / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        threshold = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        ordered, index = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p (the most likely token always stays).
        drop = (torch.cumsum(ordered, dim=-1) - ordered) >= params.top_p
        ordered = ordered.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, index, ordered)
    return draw(probs, generator)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probabilities `probs` ([vocab], not necessarily summing to 1) by the inverse of their CDF:
    one uniform number per draw. `torch.multinomial` draws an exponential number per vocabulary entry for a
    single token (88 against 11 us over 4,096 entries, one thread, AMD EPYC), which a server pays for every
    sampled sequence at every step. The first token whose cumulative probability exceeds the uniform point is
    drawn, so a token of probability 0 never is.

    Raises:
        ValueError: the probabilities have no mass (all 0, or a NaN or an infinity among them), as
            `torch.multinomial` refuses them (the probabilities come from a softmax: none is negative).
    """
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):  # a NaN anywhere makes the total NaN
        raise ValueError(f"no token to draw: the probabilities sum to {total} (after temperature, top-k and top-p)")
    point = torch.rand(1, generator=generator, dtype=torch.float64) * total
    return min(int(torch.searchsorted(cdf, point, right=True)), probs.numel() - 1)
