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
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, bias: bool = False) -> None:
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"moe_router_topk={topk} must be between 1 and num_moe_experts={num_experts}")
        self.num_experts, self.topk = num_experts, topk
        self.force_balance, self.offset = force_balance, offset
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        # A checkpoint's router bias (GPT-OSS); the inference routings below add it, training has none.
        self.bias = torch.nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device)) if bias else None

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
        logits = torch.nn.functional.linear(x, self.weight, self.bias)
        probs = torch.softmax(logits.float(), dim=-1)
        top, experts = torch.topk(probs, self.topk, dim=-1)
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(experts=experts, weights=top)

    def topk_softmax(self, x: torch.Tensor) -> Routing:
        """Routing as Hugging Face GPT-OSS computes it (inference): the k largest logits (bias included), then a
        softmax over those k in the logits' dtype, so in bf16 the weights are bf16, rounded where it rounds them."""
        logits = torch.nn.functional.linear(x, self.weight, self.bias)
        top, experts = torch.topk(logits, self.topk, dim=-1)
        return Routing(experts=experts, weights=torch.softmax(top, dim=-1, dtype=top.dtype))

    def topk_sigmoid(self, x: torch.Tensor) -> Routing:
        """Routing as Hugging Face Llama 4 computes it (inference): the k largest logits (in the logits' dtype),
        each chosen expert's score the sigmoid of its logit, taken in fp32 and rounded to the logits' dtype. The
        scores are not renormalised (Llama 4 multiplies each expert's input by its score).

        The sigmoid runs over every expert's entry, the others -inf, as there: ATen takes an array's last few
        elements on a scalar path that rounds otherwise than its vector one, so an entry's bits depend on where
        it sits in the array."""
        logits = torch.nn.functional.linear(x, self.weight, self.bias)
        top, experts = torch.topk(logits, self.topk, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, experts, top)
        weights = torch.sigmoid(scores.float()).to(logits.dtype).gather(1, experts)
        return Routing(experts=experts, weights=weights)


class GroupedSigmoidRouter(torch.nn.Module):
    """DeepSeek-V3 / GLM-4.5 routing (inference); parameters uninitialised (`weight` [experts, hidden] and
    `e_score_correction_bias` [experts], both fp32 whatever the model dtype, as `transformers` keeps them).

    Each expert's score is the sigmoid of its logit. The correction bias (DeepSeek's auxiliary-loss-free balancing,
    `topk_method` "noaux_tc") is added for the choice only: the experts form `n_group` equal groups, a group ranks
    by the sum of its two best biased scores, the `topk_group` best groups stay eligible, and the k best biased
    scores among them pick the experts. The weights are the chosen experts' unbiased scores, renormalised to sum
    to one when `normalize` (`norm_topk_prob`), times `scaling` (`routed_scaling_factor`). The operations and their
    order are `transformers`' (`topk(sorted=False)` included, so the k weights sum in the same order): the same
    expert ids and fp32 weights bit for bit. `logits_dtype`: the logits are computed in that dtype (MiniMax-M2's
    router multiplies in the model dtype, then takes the sigmoid in fp32); None: in fp32 (DeepSeek-V3, GLM-4.5).
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, *, n_group: int, topk_group: int, scaling: float,
                 normalize: bool, logits_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if n_group < 1 or num_experts % n_group or num_experts // n_group < 2 or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts in {n_group} groups, {topk_group} eligible: groups must be "
                             "equal, of at least 2 experts, and 1 <= topk_group <= n_group")
        self.num_experts, self.topk, self.normalize = num_experts, topk, normalize
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, scaling
        self.logits_dtype = logits_dtype
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        # a buffer in transformers; a parameter here so that loading fills it as it fills every other tensor
        self.e_score_correction_bias = torch.nn.Parameter(torch.empty(num_experts, dtype=torch.float32))

    def route(self, x: torch.Tensor) -> Routing:
        """x [T, hidden] (any float dtype) -> Routing (ids [T, k] int64, fp32 weights [T, k])."""
        if self.logits_dtype is None:
            scores = torch.nn.functional.linear(x.float(), self.weight).sigmoid()
        else:
            dtype = self.logits_dtype
            scores = torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype)).float().sigmoid()
        biased = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = biased.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        eligible = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~eligible.bool(), float("-inf"))
        experts = torch.topk(biased, k=self.topk, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(experts=experts, weights=weights * self.scaling)
