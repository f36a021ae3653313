"""The pieces every architecture's attention side is built from, chosen by the `ModelSpec`'s fields.

- `Attention`: q, k and v projections (with biases where the checkpoint has them), RMSNorm on queries and
  keys per head (Qwen3-MoE) or over the whole projection (OLMoE), and the output projection. Decode
  attention itself is the KV cache's (`serving.model.kv_cache`); this module only projects in and out.
- `SwiGLU`: a dense SwiGLU MLP, the MLP of a dense layer or a shared expert.
- `SharedExpert`: the always-on expert of a MoE layer, plain or scaled by sigmoid(a [1, hidden] gate)
  (Qwen2-MoE).
- `RMSNorm`, `make_norm`: the checkpoints' RMSNorm (or LayerNorm, as the spec says).

Routing is `moe.router.TopKRouter.softmax_topk` (softmax over all experts, top-k, renormalised or not) and the
routed experts are `serving.model.parts.ExpertPart`'s. With `separate` (the reference model) every projection
that `transformers` runs as its own GEMM runs as its own GEMM here too (views of the stacked weights, no copy),
so the products have `transformers`' shapes on every CPU (`docs/numerics.md`); without it (the engine's
workers) q, k, v and gate, up run as one GEMM each, the same sums rounded differently in the last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.norm import LayerNorm
from mbridge_epoverlap.moe.wgrad import Linear
from mbridge_epoverlap.serving.model.spec import ModelSpec


class RMSNorm(torch.nn.Module):
    """y = weight * (x / rms(x)), the normalised x computed in fp32 and rounded to x's dtype before the weight
    multiplies it in that dtype, as every architecture here does it in `transformers`. (`moe.norm.RMSNorm`
    multiplies by the weight in fp32 before rounding: the same in fp32, another bf16 result unless the weight
    is all ones.)"""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(spec: ModelSpec, size: int, dtype: torch.dtype) -> torch.nn.Module:
    """The spec's normalisation over `size` features."""
    if spec.normalization == "LayerNorm":
        return LayerNorm(size, eps=spec.norm_eps, dtype=dtype)
    return RMSNorm(size, eps=spec.norm_eps, dtype=dtype)


class Attention(torch.nn.Module):
    """The projections of grouped-query self-attention; parameters uninitialised.

    Parameters: `qkv.weight` [(heads + 2 * groups) * head_dim, hidden] (q rows, then k, then v), `qkv_bias`
    (same rows, `spec.qkv_bias`), `q_norm.weight` / `k_norm.weight` (`spec.qk_norm`: [head_dim] each per head,
    or [heads * head_dim] / [groups * head_dim] over the projection), `proj.weight` [hidden, heads * head_dim].
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.heads, self.groups, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.widths = [self.heads * d, self.groups * d, self.groups * d]
        self.qkv = Linear(h, sum(self.widths), dtype=dtype)
        self.qkv_bias = torch.nn.Parameter(torch.empty(sum(self.widths), dtype=dtype)) if spec.qkv_bias else None
        self.proj = Linear(self.heads * d, h, dtype=dtype)
        if spec.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"qk_norm_scope {spec.qk_norm_scope!r} must be 'head' or 'projection'")
        self.norm_per_head = spec.qk_norm_scope == "head"
        q_size, k_size = (d, d) if self.norm_per_head else (self.widths[0], self.widths[1])
        self.q_norm = RMSNorm(q_size, eps=spec.norm_eps, dtype=dtype) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_size, eps=spec.norm_eps, dtype=dtype) if spec.qk_norm else None

    def project_qkv(self, x: torch.Tensor, *, separate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads, head_dim], k and v [T, groups, head_dim] (q and k normalised, not rotated).

        `separate`: three GEMMs over the stacked weight's row blocks, as checkpoints define the projections.
        """
        biases = self.qkv_bias.split(self.widths) if self.qkv_bias is not None else (None, None, None)
        if separate:
            q, k, v = (F.linear(x, w, b) for w, b in zip(self.qkv.weight.split(self.widths), biases, strict=True))
        else:
            q, k, v = F.linear(x, self.qkv.weight, self.qkv_bias).split(self.widths, dim=-1)
        norms = self.q_norm is not None and self.k_norm is not None
        if norms and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(x.shape[0], self.heads, self.head_dim)
        k = k.reshape(x.shape[0], self.groups, self.head_dim)
        v = v.reshape(x.shape[0], self.groups, self.head_dim)
        if norms and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project_out(self, heads_out: torch.Tensor) -> torch.Tensor:
        """[T, heads * head_dim] attention output -> [T, hidden]."""
        return self.proj(heads_out)


class SwiGLU(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); `fc1.weight` [2 * ffn, hidden] (gate rows, then up), `fc2.weight` [hidden, ffn]."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, 2 * ffn, dtype=dtype)
        self.fc2 = Linear(ffn, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, *, separate: bool = True) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `separate`: the gate and up projections as two GEMMs."""
        if separate:
            gate, up = (F.linear(x, w) for w in self.fc1.weight.chunk(2))
        else:
            gate, up = F.linear(x, self.fc1.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2.weight)


class SharedExpert(torch.nn.Module):
    """A MoE layer's always-on expert, its output scaled by sigmoid(gate(x)) when `gated` (`gate.weight`
    [1, hidden])."""

    def __init__(self, hidden: int, ffn: int, *, gated: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.mlp = SwiGLU(hidden, ffn, dtype)
        self.gate = Linear(hidden, 1, dtype=dtype) if gated else None

    def forward(self, x: torch.Tensor, *, separate: bool = True) -> torch.Tensor:
        out = self.mlp(x, separate=separate)
        if self.gate is None:
            return out
        return torch.sigmoid(F.linear(x, self.gate.weight)) * out
