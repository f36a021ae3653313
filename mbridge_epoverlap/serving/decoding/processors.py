"""The logits a sequence's `DecodeOptions` change before its token is chosen, in vLLM's order: the end-of-sequence
and stop tokens masked while fewer than `min_tokens` were generated, the logit bias added, then the repetition,
frequency and presence penalties (vLLM's `apply_penalties`: repetition over the prompt's and the generated
tokens, frequency and presence over the generated ones). Temperature, top-k, top-p and the grammar's mask come
after (`sampling.sample`, `decoding.grammar`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mbridge_epoverlap.serving.decoding.options import DecodeOptions


def adjust(row: torch.Tensor, options: DecodeOptions, prompt_ids: Sequence[int], output_ids: Sequence[int],
           stop_ids: Sequence[int]) -> torch.Tensor:
    """A new fp32 row of logits ([vocab]) for a sequence with `options`.

    Args:
        row: the model's logits of the sequence's next token.
        prompt_ids, output_ids: its prompt (with any earlier output at its end, `options.earlier_outputs`) and
            the tokens it generated here.
        stop_ids: its end-of-sequence tokens (masked with its stop tokens under `min_tokens`; none when the
            request ignores the end of sequence).
    """
    logits = row.float().clone()
    vocab = logits.numel()
    earlier = options.earlier_outputs
    generated = [*prompt_ids[len(prompt_ids) - earlier:], *output_ids] if earlier else list(output_ids)
    if len(generated) < options.min_tokens:
        masked = [t for t in (*stop_ids, *options.stop_token_ids) if 0 <= t < vocab]
        if masked:
            logits[torch.tensor(masked, dtype=torch.int64)] = float("-inf")
    if options.logit_bias:
        ids = torch.tensor([t for t, _ in options.logit_bias], dtype=torch.int64)
        logits.index_add_(0, ids, torch.tensor([b for _, b in options.logit_bias], dtype=torch.float32))
    if options.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt_ids, *output_ids], dtype=torch.int64)] = True
        penalty = options.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if (options.frequency_penalty or options.presence_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=vocab).float()
        logits -= options.frequency_penalty * counts + options.presence_penalty * (counts > 0).float()
    return logits
