"""DeepSeek Sparse Attention's lightning indexer: which cached tokens each query attends to.

Per token the indexer makes `num_heads` small queries of `head_dim` from the query bottleneck (`wq_b` over
`q_a_layernorm(q_a_proj(x))`), one key of `head_dim` from the layer input (`wk`, then a LayerNorm with a bias) and a
weight per head (`weights_proj`, scaled by num_heads^-0.5); the first `qk_rope_head_dim` dimensions of queries and
keys turn with the token's rotary angles. A query scores each earlier token t as

    score(t) = sum_h w_h * relu(q_h . k_t / sqrt(head_dim))

and attends only to the `topk` best-scoring tokens (every earlier token while there are no more than `topk`).

`exact_selection` runs `transformers`' products on `transformers`' shapes for one sequence (fp32 scores, the
causal mask added before the top-k), so the reference model chooses what `transformers` chooses. `padded_selection`
scores a batch of decode tokens against their padded histories in one product in the model's dtype (DeepSeek's own
kernels score in FP8): the engine workers' decode, which then reads only the chosen latents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.rotary import apply_rotary
from mbridge_epoverlap.moe.wgrad import Linear
from mbridge_epoverlap.serving.model.spec import ModelSpec, SparseIndexer

# transformers builds the indexer's key LayerNorm with this epsilon, whatever the config's
KEY_NORM_EPS = 1e-6
# the per-head scores a prompt's choice holds at once (a 16K-token prompt's, all at once: 64 GB at 64 heads)
SCORE_BYTES = 64 << 20


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """Rotate x [T, heads, rope] by its tokens' angles (cos, sin [T, rope] fp32). With `interleave` the pairs are
    (x0, x1), (x2, x3), ... and the result holds the first of each pair, then the second (as `transformers`'
    `apply_rotary_pos_emb_interleave` lays it out); else the halves turn together (`apply_rotary_pos_emb`)."""
    if not interleave:
        return apply_rotary(x, cos, sin)
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class KeyNorm(torch.nn.Module):
    """The indexer keys' LayerNorm, with a weight and a bias, in the keys' dtype (as `torch.nn.LayerNorm`)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, KEY_NORM_EPS)


class LightningIndexer(torch.nn.Module):
    """One layer's indexer; parameters uninitialised. `wq_b.weight` [heads * head_dim, q_lora_rank], `wk.weight`
    [head_dim, hidden], `k_norm.weight` / `k_norm.bias` [head_dim], `weights_proj.weight` [heads, hidden]."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        if spec.mla is None or spec.mla.indexer is None or spec.mla.q_lora_rank is None:
            raise ValueError(f"{spec.source}: an indexer needs latent attention with a query bottleneck")
        self.config: SparseIndexer = spec.mla.indexer
        self.heads, self.dim = self.config.num_heads, self.config.head_dim
        self.rope = spec.mla.qk_rope_head_dim
        self.wq_b = Linear(spec.mla.q_lora_rank, self.heads * self.dim, dtype=dtype)
        self.wk = Linear(spec.hidden_size, self.dim, dtype=dtype)
        self.k_norm = KeyNorm(self.dim, dtype)
        self.weights_proj = Linear(spec.hidden_size, self.heads, dtype=dtype)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] (the attention's normalised input), q_resid [T, q_lora_rank] (the normalised query
        bottleneck), the tokens' angles -> queries [T, heads, head_dim], keys [T, head_dim] (both turned) and the
        head weights [T, heads] fp32 (times heads^-0.5)."""
        t = x.shape[0]
        q = F.linear(q_resid, self.wq_b.weight).view(t, self.heads, self.dim)
        k = self.k_norm(F.linear(x, self.wk.weight))
        q_rot, q_pass = q.split([self.rope, self.dim - self.rope], dim=-1)
        k_rot, k_pass = k.split([self.rope, self.dim - self.rope], dim=-1)
        interleave = self.config.rope_interleave
        q = torch.cat([rotate_pairs(q_rot, cos, sin, interleave=interleave), q_pass], dim=-1)
        k = torch.cat([rotate_pairs(k_rot[:, None], cos, sin, interleave=interleave)[:, 0], k_pass], dim=-1)
        weights = F.linear(x, self.weights_proj.weight).float() * (self.heads ** -0.5)
        return q, k, weights


@dataclass
class IndexQueries:
    """One layer's indexer projections for a batch (rows in batch order), handed to the cache's attention; all None
    on a layer that reuses the selection of the indexed layer before it (GLM-5's shared layers).

    Attributes:
        q [T, heads, head_dim], weights [T, heads], keys [T, head_dim]: `LightningIndexer.project`'s.
        topk: tokens a query attends to.
    """

    q: torch.Tensor | None
    weights: torch.Tensor | None
    keys: torch.Tensor | None
    topk: int

    @property
    def shared(self) -> bool:
        return self.q is None


def exact_selection(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor,
                    topk: int, mask_dtype: torch.dtype) -> torch.Tensor | None:
    """The tokens one sequence's queries attend to, chosen as `transformers` chooses them.

    Args:
        q [n, heads, head_dim], weights [n, heads]: `LightningIndexer.project`'s, of the queries at `q_positions`.
        keys [m, head_dim]: the sequence's indexer keys at positions 0..m-1 (the queries' own included).
        topk: tokens a query attends to. mask_dtype: the model's dtype (the causal mask's, whose minimum
            `transformers` adds to the scores of later tokens).

    Returns:
        [n, m] bool, True where a query attends (earlier tokens only); None when m <= topk (every earlier token).
    """
    m = keys.shape[0]
    if m <= topk:
        return None
    scale = q.shape[-1] ** -0.5
    k_t = keys.transpose(0, 1).float()[None, None]
    # Each query's [heads, head_dim] x [head_dim, m] product is a GEMM of its own in `transformers`' broadcast
    # matmul, so blocks of queries give the same bits as all at once, holding [block, heads, m] scores, not [n, ...]
    block = max(1, SCORE_BYTES // (4 * q.shape[1] * m))
    index = torch.cat([
        torch.matmul(w[None].unsqueeze(-2), F.relu(torch.matmul(part[None].float(), k_t) * scale)).squeeze(-2)[0]
        for part, w in zip(q.split(block), weights.split(block), strict=True)])  # [n, m]
    later = torch.arange(m)[None, :] > q_positions[:, None]
    index = index + torch.zeros(later.shape, dtype=mask_dtype).masked_fill_(later, torch.finfo(mask_dtype).min)
    chosen = index.topk(topk, dim=-1).indices
    return torch.zeros(index.shape, dtype=torch.bool).scatter_(-1, chosen, True) & ~later


def padded_selection(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor,
                     topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each decode query attends to, the batch padded to its longest history.

    Args:
        q [B, heads, head_dim], weights [B, heads]: sequence b's query at position lengths[b] - 1.
        keys [B, longest, head_dim]: sequence b's indexer keys in its first lengths[b] positions.
        lengths: [B] int64. topk: tokens a query attends to (< longest: the caller attends densely otherwise).

    Returns:
        (positions [B, topk] int64, usable [B, topk] bool): the chosen positions, and which of them are real tokens
        (a sequence shorter than `topk` gets all of its tokens and some padding).
    """
    per_head = torch.matmul(q, keys.transpose(1, 2))  # [B, heads, longest], the model's dtype
    per_head = F.relu(per_head.float().mul_(q.shape[-1] ** -0.5))
    index = torch.matmul(weights.unsqueeze(1), per_head).squeeze(1)  # [B, longest]
    padding = torch.arange(keys.shape[1])[None, :] >= lengths[:, None]
    positions = index.masked_fill_(padding, float("-inf")).topk(topk, dim=-1).indices
    return positions, positions < lengths[:, None]
