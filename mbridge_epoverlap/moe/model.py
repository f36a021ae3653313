"""A GPT-style MoE model built from a `MoEModelConfig`: embedding, layers (stages), final norm, output head.

Parameters are initialized from the seed and their names alone, experts by their global expert id, so
the same config gives the same model whatever the EP size and whichever rank builds it.

Not modelled: biases (`add_bias_linear`), position embeddings, multi-latent attention, MTP, the router's
auxiliary loss; experts are SwiGLU (`gated_linear_unit`).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from mbridge_epoverlap.comm.alltoall import CommContext
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.moe.dispatcher import AllToAllDispatcher
from mbridge_epoverlap.moe.experts import GroupedExperts
from mbridge_epoverlap.moe.layer import TransformerLayer
from mbridge_epoverlap.moe.norm import make_norm
from mbridge_epoverlap.moe.wgrad import Linear

INIT_STD = 0.02


class MoEGPT(torch.nn.Module):
    """The model one rank holds: every dense parameter, and its EP share of each layer's experts.

    Args:
        cfg: the model config (read: widths, heads, groups, kv_channels, ffn sizes, experts, top-k, shared
            expert, moe_layer_freq, qk_layernorm, normalization, vocab, force balancing).
        ep_size: expert-parallel size; ep_rank: this rank's place in its EP group; ep_group: that group.
        comm: timeout and CUDA side stream for the all-to-alls.
        dtype: parameter and activation dtype (fp32 or bf16).
        device: where parameters live.
        backward_channel: (group, comm) for the backward all-to-alls (see `AllToAllDispatcher`), or None.
    """

    def __init__(self, cfg: MoEModelConfig, *, ep_size: int = 1, ep_rank: int = 0, ep_group: Any = None,
                 comm: CommContext | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, backward_channel: tuple[Any, CommContext] | None = None) -> None:
        super().__init__()
        if not cfg.gated_linear_unit:
            raise ValueError("the reference runtime implements SwiGLU MLPs only (gated_linear_unit=True)")
        comm = comm or CommContext()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        groups = cfg.num_query_groups or heads
        head_dim = cfg.kv_channels or hidden // heads
        self.cfg, self.ep_size, self.ep_rank, self.dtype = cfg, ep_size, ep_rank, dtype
        self.embedding = torch.nn.Parameter(torch.empty(cfg.vocab_size, hidden, dtype=dtype, device=device))
        layers = []
        for number in range(cfg.num_layers):
            common: dict[str, Any] = {
                "hidden": hidden, "heads": heads, "groups": groups, "head_dim": head_dim, "qk_norm": cfg.qk_layernorm,
                "normalization": cfg.normalization, "layer_number": number, "dtype": dtype, "device": device,
            }
            if cfg.is_moe_layer(number):
                dispatcher = AllToAllDispatcher(cfg.num_moe_experts or 1, cfg.moe_router_topk, ep_size, ep_group, comm,
                                                backward_channel=backward_channel)
                layers.append(TransformerLayer(
                    ffn=cfg.moe_ffn_size, dispatcher=dispatcher, topk=cfg.moe_router_topk,
                    shared_ffn=cfg.moe_shared_expert_intermediate_size,
                    force_balance=cfg.moe_router_force_load_balancing, **common,
                ))
            else:
                layers.append(TransformerLayer(ffn=cfg.ffn_hidden_size or 4 * hidden, dispatcher=None, **common))
        self.layers = torch.nn.ModuleList(layers)
        self.final_norm = make_norm(cfg.normalization, hidden, dtype=dtype, device=device)
        self.head = Linear(hidden, cfg.vocab_size, dtype=dtype, device=device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token ids -> [batch, seq, hidden]."""
        return F.embedding(tokens, self.embedding)

    def loss(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) of the head's logits for the last layer's output `z`."""
        logits = self.head(self.final_norm(z))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Unscheduled forward: every layer with synchronous all-to-alls; returns the loss."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.loss(x, labels)

    def is_expert_parameter(self, name: str) -> bool:
        """Whether `name` is an expert weight (sharded over EP, reduced over the expert-data-parallel group)."""
        module_name, _, _ = name.rpartition(".")
        return bool(module_name) and isinstance(self.get_submodule(module_name), GroupedExperts)

    def init_parameters(self, seed: int) -> None:
        """Deterministic initialization from `seed` and parameter names (norm weights 1, others N(0, 0.02),
        output projections scaled by 1/sqrt(2*num_layers) as in Megatron)."""
        out_std = INIT_STD / math.sqrt(2 * len(self.layers))
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                    continue
                std = out_std if name.endswith(("proj.weight", "fc2.weight", "experts.w2")) else INIT_STD
                if self.is_expert_parameter(name):
                    first = self.ep_rank * param.shape[0]
                    for e in range(param.shape[0]):
                        param[e].copy_(_normal(param.shape[1:], std, f"{seed}/{name}/expert{first + e}"))
                else:
                    param.copy_(_normal(param.shape, std, f"{seed}/{name}"))


def _normal(shape: Any, std: float, key: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=generator)


def seeded_normal(shape: Any, std: float, key: str) -> torch.Tensor:
    """N(0, std) fp32 values drawn from a generator seeded by `key` alone (the same tensor in every process)."""
    return _normal(shape, std, key)
