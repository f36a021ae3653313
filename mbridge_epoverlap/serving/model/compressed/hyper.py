"""DeepSeek-V4's residual streams and MoE pieces on the attention side.

- `HyperConnection`: from the `hc_mult` streams of a token, the weights that collapse them into one block input
  (pre), spread the block output back (post) and mix the streams (comb, made doubly stochastic by Sinkhorn
  iterations); `mix` applies post and comb.
- `HyperHead`: the last collapse of the streams, before the final norm.
- `ScoreRouter`: scores = sqrtsoftplus (or sigmoid) of the router logits; the experts by top-k of scores plus a
  correction bias, or (hash layers) from a token-id table; weights = the chosen scores renormalised, scaled.
- `LimitedSwiGLU`: the shared expert, its gate clamped above and its up projection to +-limit.

All in `transformers`' operations and order (the streams' weights in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mbridge_epoverlap.serving.model.compressed.rope import unit_rms


class HyperConnection(torch.nn.Module):
    """The stream weights of one block (attention or MLP) of one layer; `fn`, `base`, `scale` fp32."""

    def __init__(self, streams: int, hidden: int, *, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.streams, self.iters, self.eps, self.norm_eps = streams, iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = torch.nn.Parameter(torch.empty(width, streams * hidden, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, streams, hidden] -> (post [T, streams], comb [T, streams, streams], the block input [T, hidden])."""
        n = self.streams
        mixes = F.linear(unit_rms(x.reshape(x.shape[0], -1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], n, n)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def mix(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: post spreads its output out [T, hidden], comb mixes the streams [T, n, hidden]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(torch.nn.Module):
    """The final collapse of the streams (`fn`, `base`, `scale` fp32)."""

    def __init__(self, streams: int, hidden: int, *, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = torch.nn.Parameter(torch.empty(streams, streams * hidden, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.empty(streams, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, streams, hidden] -> [T, hidden]."""
        mixes = F.linear(unit_rms(x.flatten(1).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


SCORES = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid}


class ScoreRouter(torch.nn.Module):
    """One MoE layer's router: `weight` [experts, hidden]; `bias` [experts] fp32 (the correction added for the choice
    only), or, on a hash layer, `tid2eid` [vocab, top_k] the experts of each token id."""

    def __init__(self, hidden: int, experts: int, top_k: int, *, scoring: str, scaling: float, vocab: int | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.score, self.scaling = top_k, SCORES[scoring], scaling
        self.weight = torch.nn.Parameter(torch.empty(experts, hidden, dtype=dtype))
        self.bias = None if vocab is not None else torch.nn.Parameter(torch.zeros(experts, dtype=torch.float32))
        self.tid2eid = None if vocab is None else torch.nn.Parameter(
            torch.zeros(vocab, top_k, dtype=torch.int64), requires_grad=False)

    def route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], token_ids [T] -> (expert ids [T, k] int64, weights [T, k])."""
        scores = self.score(F.linear(x, self.weight))
        if self.tid2eid is not None:
            ids = self.tid2eid[token_ids.reshape(-1)].long()
        else:
            assert self.bias is not None
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class LimitedSwiGLU(torch.nn.Module):
    """down(silu(min(gate x, limit)) * clamp(up x, -limit, limit)): DeepSeek-V4's shared expert."""

    def __init__(self, hidden: int, ffn: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


def limited_swiglu(h: torch.Tensor, limit: float) -> torch.Tensor:
    """The routed experts' activation of [gate | up] rows, as `LimitedSwiGLU`'s."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
