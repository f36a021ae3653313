"""Log-probabilities from a step's fp32 logits: of the token chosen at each row and of the most likely tokens.

They are the model's own (the log-softmax of the raw logits, before temperature, penalties or a grammar change
them), as vLLM reports by default and as `transformers`' `log_softmax` of the same logits gives. A row's record is
`[chosen token's log-probability, [[token, log-probability], ...] the k most likely, most likely first]`: JSON as
it is, sent with the token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Record = list  # [float, [[int, float], ...]]


def records(logits: torch.Tensor, chosen: Sequence[int], top: Sequence[int]) -> list[Record]:
    """One record per row of `logits` ([n, vocab], any float dtype, computed in fp32): the log-probability of
    `chosen[i]` and of the `top[i]` most likely tokens (ties in the order `torch.topk` gives)."""
    if not len(chosen):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(list(chosen), dtype=torch.int64).unsqueeze(1)).squeeze(1).tolist()
    k_max = max(top)
    if k_max > 0:
        values, ids = torch.topk(logprobs, min(k_max, logprobs.shape[1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
    out = []
    for row, k in enumerate(top):
        best = [[ids[row][j], values[row][j]] for j in range(min(k, logprobs.shape[1]))] if k > 0 else []
        out.append([picked[row], best])
    return out


def prompt_records(logits: torch.Tensor, next_tokens: Sequence[int], k: int) -> list[Record]:
    """The records of a prompt's positions: row i of `logits` (the position before `next_tokens[i]`) scored at
    `next_tokens[i]`, with the k most likely."""
    return records(logits[:len(next_tokens)], next_tokens, [k] * len(next_tokens))
