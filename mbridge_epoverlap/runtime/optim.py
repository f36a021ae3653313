"""Gradient buffers, gradient all-reduce and the optimizer step.

Every parameter accumulates its gradient in an fp32 `main_grad` (as Megatron does with
`grad_reduce_in_fp32`): deferred weight gradients add into it directly, autograd-computed ones through a
post-accumulate hook. After the last micro-batch, dense gradients are summed over all ranks and expert
gradients over the expert-data-parallel group, both divided by the world size (the loss is the mean over
all ranks). The optimizer (Adam or SGD, deterministic) updates fp32 master weights and copies them back
into bf16 parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from mbridge_epoverlap.comm.alltoall import CommContext, all_reduce
from mbridge_epoverlap.comm.groups import ParallelGroups
from mbridge_epoverlap.moe.model import MoEGPT


def attach_main_grads(model: MoEGPT) -> None:
    """Give every parameter an fp32 `main_grad` and route autograd's accumulation into it."""

    def move_to_main(param: torch.Tensor) -> None:
        if param.grad is None:  # deferred-wgrad weights reach their AccumulateGrad with no gradient
            return
        param.main_grad.add_(param.grad)
        param.grad = None

    for param in model.parameters():
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.register_post_accumulate_grad_hook(move_to_main)


def zero_main_grads(model: MoEGPT) -> None:
    torch._foreach_zero_([param.main_grad for param in model.parameters()])


def split_parameters(model: MoEGPT) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(dense, expert) named parameters."""
    dense, expert = [], []
    for name, param in model.named_parameters():
        (expert if model.is_expert_parameter(name) else dense).append((name, param))
    return dense, expert


def reduce_main_grads(model: MoEGPT, groups: ParallelGroups, comm: CommContext) -> None:
    """Average gradients over data-parallel replicas (one flat all-reduce per group of more than one rank)."""
    dense, expert = split_parameters(model)
    plan = ((dense, groups.world_group, groups.world), (expert, groups.edp_group, groups.edp_size))
    for params, group, size in plan:
        grads = [p.main_grad for _, p in params]
        if not grads:
            continue
        if size == 1:
            for g in grads:
                g.div_(groups.world)
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, group, comm, what="gradient all-reduce")
        flat.div_(groups.world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def grads_finite(model: MoEGPT) -> bool:
    """Whether every (local) gradient is finite (one reduction over all of them)."""
    norms = torch._foreach_norm([p.main_grad for p in model.parameters()], ord=float("inf"))
    return bool(torch.isfinite(torch.stack(norms)).all())


class Optimizer:
    """Adam (betas 0.9/0.95, eps 1e-8) or SGD on fp32 master weights.

    Args:
        model: the model; its `main_grad`s are the gradients.
        kind: "adam" or "sgd".
        lr: learning rate.
    """

    def __init__(self, model: MoEGPT, *, kind: str = "adam", lr: float = 1e-4) -> None:
        self.params = list(model.parameters())
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        if kind == "adam":
            self.inner: torch.optim.Optimizer = torch.optim.Adam(self.masters, lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                                                  foreach=True)
        elif kind == "sgd":
            self.inner = torch.optim.SGD(self.masters, lr=lr, foreach=True)
        else:
            raise ValueError(f"optimizer {kind!r}: use adam or sgd")

    @torch.no_grad()
    def step(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            master.grad = param.main_grad
        self.inner.step()
        copies = [(param, master) for param, master in zip(self.params, self.masters, strict=True)
                  if master is not param]
        if copies:
            torch._foreach_copy_([p for p, _ in copies], [m for _, m in copies])
        for master in self.masters:
            master.grad = None
