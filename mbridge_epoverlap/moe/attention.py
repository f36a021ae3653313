"""Causal self-attention with grouped query heads and optional q/k RMSNorm (Qwen3 style).

Training runs `SelfAttention.forward` (fused scaled-dot-product attention over whole sequences). Decoding
uses the same projections through `project_qkv` / `project_out` and `cached_attention`, which attends the
new queries of one sequence to its cached keys and values with explicit (eager) arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.norm import RMSNorm
from mbridge_epoverlap.moe.wgrad import Linear


class SelfAttention(torch.nn.Module):
    """`scaled_dot_product_attention(causal)` between a fused QKV projection and an output projection.

    Both projections defer their weight gradients (see `moe.wgrad`), so attention backward splits into
    dgrad and wgrad like the experts.
    """

    def __init__(self, hidden: int, heads: int, groups: int, head_dim: int, *, qk_norm: bool,
                 dtype: torch.dtype, device: torch.device | None = None, norm_eps: float = 1e-6) -> None:
        super().__init__()
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_query_groups={groups}")
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        self.qkv = Linear(hidden, (heads + 2 * groups) * head_dim, dtype=dtype, device=device)
        self.proj = Linear(heads * head_dim, hidden, dtype=dtype, device=device)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, device=device) if qk_norm else None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [..., hidden] -> q [..., heads, head_dim], k and v [..., groups, head_dim] (q/k normalised)."""
        d, lead = self.head_dim, x.shape[:-1]
        q, k, v = self.qkv(x).split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q = q.view(*lead, self.heads, d)
        k = k.view(*lead, self.groups, d)
        v = v.view(*lead, self.groups, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project_out(self, heads_out: torch.Tensor) -> torch.Tensor:
        """[..., heads * head_dim] attention output -> [..., hidden]."""
        return self.proj(heads_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]."""
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project_qkv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.groups != self.heads)
        return self.project_out(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, *,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new queries to all its keys so far.

    Eager arithmetic in the order Hugging Face's eager attention uses (scores = q k^T * scale, masked
    entries excluded, fp32 softmax, weights @ v), so a decode step reproduces its logits.

    Args:
        q: [n, heads, head_dim] queries (rotated) of the tokens at `q_positions`.
        k, v: [m, groups, head_dim] keys (rotated) and values at positions 0..m-1 (the cache, new tokens
            included).
        q_positions: [n] int64 positions of the queries (each < m).
        sliding_window: a key is visible when q_pos - k_pos < sliding_window (None: all earlier keys).

    Returns:
        [n, heads * head_dim].
    """
    n, heads, d = q.shape
    groups = k.shape[1]
    rep = heads // groups
    keys, values = _repeat_groups(k, rep), _repeat_groups(v, rep)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * (d ** -0.5)
    k_positions = torch.arange(k.shape[0], device=q.device)
    hidden = k_positions[None, :] > q_positions[:, None]
    if sliding_window is not None:
        hidden |= q_positions[:, None] - k_positions[None, :] >= sliding_window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, values)  # [heads, n, d]
    return out.transpose(0, 1).reshape(n, heads * d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one new query per sequence to its cached keys, for a batch of sequences at once.

    The same arithmetic as `cached_attention` per sequence (scores = q k^T * scale, masked keys excluded,
    fp32 softmax, weights @ v), on histories padded to the longest: a padded key gets weight exactly 0.

    Args:
        q: [B, heads, head_dim] the queries (rotated), sequence b's at position `lengths[b] - 1`.
        k, v: [B, groups, longest, head_dim] keys (rotated) and values, sequence b's in its first
            `lengths[b]` positions.
        lengths: [B] int64 keys per sequence, the new token's included.
        sliding_window: a key is visible when q_pos - k_pos < sliding_window (None: all earlier keys).

    Returns:
        [B, heads * head_dim].
    """
    b, heads, d = q.shape
    groups, longest = k.shape[1], k.shape[2]
    rep = heads // groups
    if rep > 1:
        k = k[:, :, None].expand(b, groups, rep, longest, d).reshape(b, heads, longest, d)
        v = v[:, :, None].expand(b, groups, rep, longest, d).reshape(b, heads, longest, d)
    scores = torch.matmul(q[:, :, None, :], k.transpose(2, 3)) * (d ** -0.5)  # [B, heads, 1, longest]
    k_positions = torch.arange(longest, device=q.device)
    hidden = k_positions[None, :] >= lengths[:, None]
    if sliding_window is not None:
        hidden |= (lengths[:, None] - 1) - k_positions[None, :] >= sliding_window
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v).reshape(b, heads * d)


def _repeat_groups(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[m, groups, d] -> contiguous [groups * rep, m, d]: query head h reads group h // rep (as repeat_kv)."""
    groups, m, d = t.shape[1], t.shape[0], t.shape[2]
    t = t.transpose(0, 1)
    if rep == 1:
        return t.contiguous()
    return t[:, None].expand(groups, rep, m, d).reshape(groups * rep, m, d)
