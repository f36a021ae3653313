"""DeepSeek-V4's rotary embedding: interleaved pairs on the trailing `rope_dim` dimensions of each head."""

from __future__ import annotations

import torch

from mbridge_epoverlap.moe.rotary import yarn_inv_freq
from mbridge_epoverlap.serving.model.layers import RMSNorm
from mbridge_epoverlap.serving.model.spec import RopeScaling


def inv_freq(theta: float, rope_dim: int, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """([rope_dim / 2] fp32 inverse frequencies, the factor cos and sin are scaled by) of the rope with base `theta`:
    the default one, or YaRN's where `scaling` says."""
    if scaling is None:
        return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)), 1.0
    return yarn_inv_freq(rope_dim, theta, factor=scaling.factor, beta_fast=scaling.beta_fast,
                         beta_slow=scaling.beta_slow,
                         original_max_position_embeddings=scaling.original_max_position_embeddings,
                         truncate=scaling.truncate), scaling.attention_factor


def angles(positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., rope_dim / 2] of `positions`, computed in fp32, times `scale`, rounded to `dtype` (as the
    model's activations are)."""
    turns = positions[..., None].float() * freqs
    return (turns.cos() * scale).to(dtype), (turns.sin() * scale).to(dtype)


def _pair_swap(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_axis: int = 1) -> torch.Tensor:
    """x with its trailing 2 * cos.shape[-1] dimensions turned in pairs, in fp32 and rounded back to x's dtype; cos
    and sin broadcast over x's `head_axis` (inserted there)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(head_axis)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(head_axis)
    width = cos.shape[-1]
    plain, turned = x[..., :-width], x[..., -width:]
    turned = ((turned.float() * cos) + (_pair_swap(turned).float() * sin)).to(x.dtype)
    return torch.cat([plain, turned], dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension without a weight: the scale in fp32, rounded to x's dtype, then the
    product in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def fp32_norm(size: int, eps: float) -> RMSNorm:
    """V4's RMSNorm: an fp32 weight times the fp32 normalised input, rounded once to the input's dtype
    (`layers.RMSNorm` with `round_after_weight`)."""
    return RMSNorm(size, eps=eps, dtype=torch.float32, round_after_weight=True)
