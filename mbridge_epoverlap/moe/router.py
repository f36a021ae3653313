"""Top-k softmax router, with an option that forces perfectly balanced routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """Where each token goes.

    Attributes:
        experts: [tokens, k] global expert ids (int64), distinct per token.
        weights: [tokens, k] combine weights (fp32, differentiable with respect to the router).
    """

    experts: torch.Tensor
    weights: torch.Tensor


class TopKRouter(torch.nn.Module):
    """Logits `x W^T` (fp32), top-k experts per token, softmax over the chosen k logits.

    With `force_balance` (Megatron's `moe_router_force_load_balancing`, a benchmarking aid) token t goes
    to experts `(t*k + j + offset) mod E`: every expert gets the same number of tokens, whatever the
    weights; the combine weights still come from the router's logits, so the router keeps learning.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, *, force_balance: bool = False, offset: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk={topk} must be between 1 and num_moe_experts={num_experts}")
        self.num_experts, self.topk = num_experts, topk
        self.force_balance, self.offset = force_balance, offset
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> Routing:
        """x: [tokens, hidden] -> Routing."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        if self.force_balance:
            t = torch.arange(x.shape[0], device=x.device).unsqueeze(1) * self.topk
            experts = (t + torch.arange(self.topk, device=x.device) + self.offset) % self.num_experts
            chosen = logits.gather(1, experts)
        else:
            chosen, experts = torch.topk(logits, self.topk, dim=-1)
        return Routing(experts=experts, weights=torch.softmax(chosen, dim=-1))

    def softmax_topk(self, x: torch.Tensor, *, normalize: bool) -> Routing:
        """Routing as Hugging Face Mixtral and Qwen3-MoE compute it (inference; no forced balance).

        Softmax (fp32) over all experts' logits, the k largest probabilities, renormalised to sum to one
        when `normalize` (Mixtral always; Qwen3 with `norm_topk_prob`). With `normalize` the weights equal
        `forward`'s softmax over the chosen logits up to rounding; this order reproduces the reference.
        """
        logits = torch.nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        top, experts = torch.topk(probs, self.topk, dim=-1)
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(experts=experts, weights=top)
