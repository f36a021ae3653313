"""A tiny model and its micro-batches for single-process executor tests."""

from __future__ import annotations

import torch

from mbridge_epoverlap.moe.model import MoEGPT
from mbridge_epoverlap.runtime.optim import attach_main_grads


def tiny_model(cfg, dtype=torch.float32) -> MoEGPT:
    """The config's model, initialized from its seed, with main-gradient buffers attached."""
    model = MoEGPT(cfg.model, dtype=dtype)
    model.init_parameters(cfg.train.seed)
    attach_main_grads(model)
    return model


def micro_batches(cfg, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` (tokens, labels) pairs of random ids, the same for every call."""
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length)
    return [(torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
             torch.randint(0, cfg.model.vocab_size, shape, generator=gen)) for _ in range(n)]
