"""Causal self-attention with grouped query heads and optional q/k RMSNorm (Qwen3 style).

Training runs `SelfAttention.forward` (fused scaled-dot-product attention over whole sequences). Serving
uses the same projections through `project_qkv` / `project_out`; the attention of new tokens to cached
keys and values between them is the KV cache's (`serving.model.kv_cache`).
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

    def project_qkv(self, x: torch.Tensor, *, separate: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [..., hidden] -> q [..., heads, head_dim], k and v [..., groups, head_dim] (q/k normalised).

        `separate` (inference only): three GEMMs over the fused weight's row blocks (views, no copy), the
        products of separate q, k and v projections as checkpoints define them. One fused GEMM of the summed
        width computes the same sums, but a GEMM of another width may take another kernel on some CPUs.
        """
        d, lead = self.head_dim, x.shape[:-1]
        widths = [self.heads * d, self.groups * d, self.groups * d]
        if separate:
            q, k, v = (F.linear(x, w) for w in self.qkv.weight.split(widths))
        else:
            q, k, v = self.qkv(x).split(widths, dim=-1)
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
