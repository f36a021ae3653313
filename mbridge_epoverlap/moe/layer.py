"""A transformer layer written as the stages of the layer program (`schedule.program`).

    attn     (compute)  input norm, attention, residual, pre-MLP norm, router, permute
    dispatch (comm)     tokens to their experts' ranks
    experts  (compute)  sort by local expert, grouped SwiGLU, unsort; the shared expert
    combine  (comm)     expert outputs back to the tokens' ranks
    post     (compute)  unpermute with router weights, add shared expert and residual

Stage methods take and return plain tensors (named in dicts) plus the dispatch handle, so an executor
can run each stage as its own autograd island and put other work between them. `forward` chains the
same stages with synchronous, differentiable all-to-alls: the unscheduled reference.

A dense layer (a 0 in `moe_layer_freq`) has the same stages; its dispatch and combine move nothing
and its experts stage is the dense MLP.
"""

from __future__ import annotations

import torch

from mbridge_epoverlap.moe.attention import SelfAttention
from mbridge_epoverlap.moe.dispatcher import AllToAllDispatcher, DispatchHandle
from mbridge_epoverlap.moe.experts import GroupedExperts, SwiGLUMLP
from mbridge_epoverlap.moe.norm import make_norm
from mbridge_epoverlap.moe.router import TopKRouter

Tensors = dict[str, torch.Tensor]


class TransformerLayer(torch.nn.Module):
    """One layer; MoE when `dispatcher` is given, dense otherwise.

    Args:
        hidden, heads, groups, head_dim, qk_norm, normalization: attention and norm shapes.
        ffn: per-expert FFN width (MoE) or MLP width (dense).
        dispatcher: the EP dispatcher (None for a dense layer).
        topk: experts per token (MoE).
        shared_ffn: shared-expert width, or None.
        force_balance: force balanced routing (benchmarking).
        layer_number: 0-based; offsets balanced routing so layers do not all pick the same experts.
        dtype, device: parameter placement.
    """

    def __init__(self, *, hidden: int, heads: int, groups: int, head_dim: int, qk_norm: bool, normalization: str,
                 ffn: int, dispatcher: AllToAllDispatcher | None, topk: int = 1, shared_ffn: int | None = None,
                 force_balance: bool = False, layer_number: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.hidden = hidden
        self.input_norm = make_norm(normalization, hidden, dtype=dtype, device=device)
        self.attention = SelfAttention(hidden, heads, groups, head_dim, qk_norm=qk_norm, dtype=dtype, device=device)
        self.pre_mlp_norm = make_norm(normalization, hidden, dtype=dtype, device=device)
        self.dispatcher = dispatcher
        if dispatcher is None:
            self.mlp = SwiGLUMLP(hidden, ffn, dtype=dtype, device=device)
            return
        self.router = TopKRouter(hidden, dispatcher.num_experts, topk, force_balance=force_balance,
                                 offset=layer_number, dtype=dtype, device=device)
        self.experts = GroupedExperts(dispatcher.local_experts, hidden, ffn, dtype=dtype, device=device)
        self.shared_expert = SwiGLUMLP(hidden, shared_ffn, dtype=dtype, device=device) if shared_ffn else None

    @property
    def is_moe(self) -> bool:
        return self.dispatcher is not None

    def attn_stage(self, x: torch.Tensor) -> tuple[Tensors, DispatchHandle | None]:
        """x: [batch, seq, hidden] -> ({"resid", "tokens", ["probs"], ["y"]}, handle).

        "tokens" are the rows to dispatch ([T*k, hidden] for MoE, [T, hidden] for dense), "probs" the
        router weights, "y" the normalized input of the shared expert.
        """
        resid = x + self.attention(self.input_norm(x))
        y = self.pre_mlp_norm(resid).reshape(-1, self.hidden)
        if self.dispatcher is None:
            return {"resid": resid, "tokens": y}, None
        routing = self.router(y)
        permuted, handle = self.dispatcher.permute(y, routing)
        out = {"resid": resid, "tokens": permuted, "probs": routing.weights}
        if self.shared_expert is not None:
            out["y"] = y
        return out, handle

    def experts_stage(self, received: torch.Tensor, handle: DispatchHandle | None,
                      y: torch.Tensor | None = None) -> Tensors:
        """Rows received by dispatch (source-major) -> {"expert_out" (same order), ["shared_out"]}."""
        if self.dispatcher is None:
            return {"expert_out": self.mlp(received)}
        if handle is None or handle.tokens_per_expert is None:
            raise RuntimeError("the experts stage needs a handle whose counts were exchanged")
        grouped = self.dispatcher.sort_by_expert(handle, received)
        expert_out = self.experts(grouped, handle.tokens_per_expert)
        out = {"expert_out": self.dispatcher.unsort_from_expert(handle, expert_out)}
        if self.shared_expert is not None and y is not None:
            out["shared_out"] = self.shared_expert(y)
        return out

    def post_stage(self, combined: torch.Tensor, resid: torch.Tensor, handle: DispatchHandle | None,
                   probs: torch.Tensor | None = None, shared_out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows back from combine + residual (+ shared expert) -> the layer output [batch, seq, hidden]."""
        if self.dispatcher is None or handle is None:
            mlp = combined
        else:
            if probs is None:
                raise RuntimeError("a MoE post stage needs the router weights")
            mlp = self.dispatcher.unpermute(handle, combined, probs)
        if shared_out is not None:
            mlp = mlp + shared_out
        return resid + mlp.view_as(resid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stages in order with synchronous differentiable all-to-alls (no overlap)."""
        out, handle = self.attn_stage(x)
        if self.dispatcher is None or handle is None:
            mlp = self.experts_stage(out["tokens"], None)
            return self.post_stage(mlp["expert_out"], out["resid"], None)
        received = self.dispatcher.dispatch_sync(handle, out["tokens"])
        mlp = self.experts_stage(received, handle, out.get("y"))
        combined = self.dispatcher.combine_sync(handle, mlp["expert_out"])
        return self.post_stage(combined, out["resid"], handle, out["probs"], mlp.get("shared_out"))
