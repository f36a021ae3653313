"""Mock token data: the same micro-batches for every case of a comparison, from the seed alone.

Labels follow a fixed token-to-token rule (a permutation of the vocabulary), so the loss falls as the
model learns it and a diverging schedule shows up in the loss curve.
"""

from __future__ import annotations

import zlib

import torch

_MULTIPLIER, _INCREMENT = 31, 7


def mock_micro_batches(*, seed: int, iteration: int, dp_rank: int, num_micro_batches: int, micro_batch_size: int,
                       seq_length: int, vocab_size: int, device: torch.device | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) pairs, each [micro_batch_size, seq_length] int64, for one data-parallel rank."""
    out = []
    for mb in range(num_micro_batches):
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{iteration}/{dp_rank}/{mb}".encode()))
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length), generator=generator)
        labels = (tokens * _MULTIPLIER + _INCREMENT) % vocab_size
        out.append((tokens.to(device), labels.to(device)))
    return out
