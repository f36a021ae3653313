"""SwiGLU feed-forward blocks: grouped experts (one GEMM pair per local expert) and a plain MLP.

Both split their backward into dgrad and wgrad through `moe.wgrad`: the grouped experts with a hand-written
backward (the dgrad pass keeps what wgrad needs: inputs, output gradients, activations and the gradient of
the first projection), the MLP through deferrable linears.

When every local expert received the same number of rows (balanced routing) the experts run as batched
GEMMs over a [experts, rows, hidden] view; otherwise one GEMM pair per expert. The choice depends only on
the counts, so every schedule makes the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.wgrad import DOWN_PROJECTION, Linear, WeightGradStore, accumulate_weight_grad, default_store


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def clamped_swiglu(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's activation of [gate | up] halves: the gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in the operations and order of `transformers`' GptOssExperts."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _swiglu_backward(pre: torch.Tensor, grad_act: torch.Tensor, act: torch.Tensor, grad_pre: torch.Tensor) -> None:
    """Fill `act` = swiglu(pre) and `grad_pre` = d swiglu / d pre applied to `grad_act`."""
    gate, up = pre.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    torch.mul(silu, up, out=act)
    grad_gate, grad_up = grad_pre.chunk(2, dim=-1)
    torch.mul(grad_act * up, sig * (1 + gate * (1 - sig)), out=grad_gate)
    torch.mul(grad_act, silu, out=grad_up)


class _GroupedSwiGLU(torch.autograd.Function):
    """out[rows of e] = swiglu(x_e W1_e^T) W2_e^T for each local expert e."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int],
                store: WeightGradStore) -> torch.Tensor:
        experts = w1.shape[0]
        uniform = len(set(counts)) == 1
        if uniform:
            rows = counts[0]
            pre = torch.bmm(x.view(experts, rows, x.shape[1]), w1.transpose(1, 2))
            out = torch.bmm(_swiglu(pre), w2.transpose(1, 2)).view(x.shape[0], w2.shape[1])
            pre = pre.view(x.shape[0], w1.shape[1])
        else:
            out = x.new_empty(x.shape[0], w2.shape[1])
            pre = x.new_empty(x.shape[0], w1.shape[1])
            for e, sl in enumerate(_slices(counts)):
                torch.matmul(x[sl], w1[e].t(), out=pre[sl])
                torch.matmul(_swiglu(pre[sl]), w2[e].t(), out=out[sl])
        ctx.save_for_backward(x, w1, w2, pre)
        ctx.counts, ctx.store, ctx.uniform = counts, store, uniform
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, w1, w2, pre = ctx.saved_tensors
        counts, uniform, experts = ctx.counts, ctx.uniform, w1.shape[0]
        grad_out = grad_out.contiguous()
        grad_pre = torch.empty_like(pre)
        act = x.new_empty(x.shape[0], w2.shape[2])
        if uniform:
            def view(t: torch.Tensor) -> torch.Tensor:
                return t.view(experts, counts[0], t.shape[-1])

            grad_act = torch.bmm(view(grad_out), w2)
            _swiglu_backward(view(pre), grad_act, view(act), view(grad_pre))
            grad_x = torch.bmm(view(grad_pre), w1).view_as(x)
        else:
            grad_x = torch.empty_like(x)
            for e, sl in enumerate(_slices(counts)):
                _swiglu_backward(pre[sl], grad_out[sl].matmul(w2[e]), act[sl], grad_pre[sl])
                torch.matmul(grad_pre[sl], w1[e], out=grad_x[sl])

        def weight_grad(weight: torch.Tensor, grad: torch.Tensor, inputs: torch.Tensor) -> None:
            """weight[e] += grad[rows of e]^T inputs[rows of e] for every local expert e."""
            if uniform:
                g = torch.bmm(view(grad).transpose(1, 2), view(inputs))
            else:
                g = torch.zeros_like(weight)
                for e, sl in enumerate(_slices(counts)):
                    torch.matmul(grad[sl].t(), inputs[sl], out=g[e])
            accumulate_weight_grad(weight, g)

        # Two closures: the gate/up projection's and the down projection's weight gradients, which a schedule
        # may run in different communication windows (`experts_wgrad`, `experts_wgrad_down`).
        if ctx.needs_input_grad[1]:
            ctx.store.put(lambda: weight_grad(w1, grad_pre, x))
        if ctx.needs_input_grad[2]:
            ctx.store.put(lambda: weight_grad(w2, grad_out, act), part=DOWN_PROJECTION)
        return grad_x, None, None, None, None


def _slices(counts: list[int]) -> list[slice]:
    out, start = [], 0
    for n in counts:
        out.append(slice(start, start + n))
        start += n
    return out


class GroupedExperts(torch.nn.Module):
    """The local experts of one MoE layer, SwiGLU, weights stacked per expert.

    Attributes:
        w1: [local_experts, 2*ffn, hidden] gate and up projections.
        w2: [local_experts, hidden, ffn] down projection.
    """

    def __init__(self, local_experts: int, hidden: int, ffn: int, *, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.empty(local_experts, 2 * ffn, hidden, dtype=dtype, device=device))
        self.w2 = torch.nn.Parameter(torch.empty(local_experts, hidden, ffn, dtype=dtype, device=device))
        self.wgrad_store: WeightGradStore | None = None  # see `moe.wgrad.use_weight_grad_store`

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int], store: WeightGradStore | None = None
                ) -> torch.Tensor:
        """x: [rows, hidden] grouped by local expert (`tokens_per_expert` rows each) -> [rows, hidden].

        The weight gradient goes to `store`, else to `wgrad_store`, else to the default store.
        """
        if sum(tokens_per_expert) != x.shape[0] or len(tokens_per_expert) != self.w1.shape[0]:
            raise ValueError(f"tokens_per_expert {tokens_per_expert} does not match {x.shape[0]} rows and "
                             f"{self.w1.shape[0]} local experts")
        return _GroupedSwiGLU.apply(x.contiguous(), self.w1, self.w2, list(tokens_per_expert),
                                    store or self.wgrad_store or default_store())


class SwiGLUMLP(torch.nn.Module):
    """A dense SwiGLU MLP (shared expert, or the MLP of a dense layer)."""

    def __init__(self, hidden: int, ffn: int, *, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, 2 * ffn, dtype=dtype, device=device)
        self.fc2 = Linear(ffn, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_swiglu(self.fc1(x)))


def expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert for inference (no weight-gradient split): x [n, hidden], w1 [2*ffn, hidden] (gate rows, then
    up), w2 [hidden, ffn] -> [n, hidden]."""
    return F.linear(_swiglu(F.linear(x, w1)), w2)


def grouped_expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int], *,
                          b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                          activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Every expert for inference in one pass: x [rows, hidden] grouped by expert (`counts[e]` rows for expert
    e, in order), w1 [experts, 2*ffn, hidden], w2 [experts, hidden, ffn] -> [rows, hidden].

    Checkpoint experts with biases (GPT-OSS) pass b1 [experts, 2*ffn] and b2 [experts, hidden], each added to
    its GEMM's output (after it, not inside it, as `transformers` adds them), and their `activation` of the
    [gate | up] product (default: silu(gate) * up).

    With many small experts (128 experts, a few rows each in decode) a per-expert loop spends its time
    launching three small GEMMs and two elementwise ops per expert; `torch._grouped_mm` takes every group in
    one call and the activation runs once over all rows. Each group is still the GEMM `expert_swiglu` gives
    that expert (the tests check the results are bitwise equal); without `_grouped_mm` the loop runs.
    """
    if b1 is not None or b2 is not None or activation is not None:
        return _biased_experts(x, w1, w2, counts, b1, b2, activation or _swiglu)
    if _GROUPED_MM is not None and x.dtype in (torch.float32, torch.bfloat16) and x.shape[0]:
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        hidden = _GROUPED_MM(x, w1.transpose(1, 2), offs=offsets)
        return _GROUPED_MM(_swiglu(hidden), w2.transpose(1, 2), offs=offsets)
    out = torch.empty_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = expert_swiglu(x[start:start + n], w1[e], w2[e])
        start += n
    return out


def _biased_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int], b1: torch.Tensor | None,
                    b2: torch.Tensor | None, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`grouped_expert_swiglu` with biases and another activation, one expert at a time as `transformers` runs
    them: an elementwise op's last few elements take ATen's scalar path instead of its vector one, and
    sigmoid's two paths round differently, so the activation over all rows at once is not each expert's."""
    out = x.new_empty(x.shape[0], w2.shape[1])
    for e, (start, n) in enumerate(zip(_offsets(counts), counts, strict=True)):
        if not n:
            continue
        hidden = F.linear(x[start:start + n], w1[e])
        if b1 is not None:
            hidden = hidden + b1[e]
        done = F.linear(activation(hidden), w2[e])
        out[start:start + n] = done if b2 is None else done + b2[e]
    return out


def _offsets(counts: list[int]) -> list[int]:
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


_GROUPED_MM = getattr(torch, "_grouped_mm", None)
