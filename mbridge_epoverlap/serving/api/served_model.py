"""`ModelInfo`: what the request checks need of the served model."""

from __future__ import annotations

from dataclasses import dataclass

from mbridge_epoverlap.serving.frontend.text import TextCodec

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default


@dataclass(frozen=True)
class ModelInfo:
    """What the checks need of the served model."""

    name: str
    vocab_size: int
    max_model_len: int
    codec: TextCodec
    eos_ids: tuple[int, ...] = ()
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # `logprobs` / `top_logprobs` at most (`--max-logprobs`)
    max_sequences: int = 0  # sequences the server decodes at once: `best_of` (or `n`) times the prompts (0: any)
