"""Rotary position embeddings (RoPE), the "rotate half" variant of Llama, Mixtral and Qwen3, YaRN's scaled
frequencies (GPT-OSS, DeepSeek-V3), Llama 3's scaled frequencies, a rotation of the first dimensions of each head
only (GLM-4.5) and Llama 4's rotation of adjacent pairs as complex numbers.

The angles are computed in fp32 from integer positions, one product per (position, frequency) pair, and
the rotation is `x * cos + rotate_half(x) * sin`, the same operations in the same order as Hugging Face
`transformers`, so a model decoded here gives its logits bit for bit where the rest of the model does.
"""

from __future__ import annotations

import math

import torch


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables of the default (unscaled) rope for `head_dim` and base `theta`, or of given frequencies.

    Args:
        head_dim: width of one attention head (even).
        theta: the rope base (`rope_theta`).
        inv_freq: [head_dim / 2] fp32 frequencies of a scaled rope (YaRN), instead of the default ones.
        attention_scaling: cos and sin are multiplied by it (in fp32, before any rounding), as a scaled rope's
            `attention_factor` asks; None: not multiplied.
        pairs: the tables are for `apply_pair_rotary` (Llama 4): [T, head_dim / 2], one angle per pair, cos and
            sin taken by `torch.polar` as `transformers` takes them there (its cos and sin are not always
            `torch.cos`'s and `torch.sin`'s bits).
    """

    def __init__(self, head_dim: int, theta: float, *, inv_freq: torch.Tensor | None = None,
                 attention_scaling: float | None = None, pairs: bool = False) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim, self.theta = head_dim, float(theta)
        self.attention_scaling, self.pairs = attention_scaling, pairs
        if inv_freq is None:
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
            inv_freq = 1.0 / (self.theta ** exponent)
        elif tuple(inv_freq.shape) != (head_dim // 2,):
            raise ValueError(f"inv_freq has shape {list(inv_freq.shape)}; expected [{head_dim // 2}]")
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, head_dim] fp32 ([T, head_dim / 2] with `pairs`)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        if self.pairs:
            turns = torch.polar(torch.ones_like(freqs), freqs)
            if self.attention_scaling is not None:
                turns = turns * self.attention_scaling
            return turns.real, turns.imag
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling is None:
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, head_dim] by the angles of its tokens (cos, sin: [T, head_dim])."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return (x * cos) + (rotate_half(x) * sin)


def apply_pair_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, head_dim] as Llama 4 does: each adjacent pair (x0, x1), (x2, x3), ... is a complex
    number multiplied by its angle's cos + i sin (`RotaryEmbedding(pairs=True)`'s tables, [T, head_dim / 2]), in
    fp32, and the result rounded to x's dtype. The product is torch's complex one, as in `transformers`, so its
    bits are that product's on every CPU."""
    turns = torch.complex(cos, sin)[:, None, :]
    pairs = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * turns).flatten(-2).to(x.dtype)


def llama3_inv_freq(head_dim: int, theta: float, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """[head_dim / 2] fp32 frequencies of Llama 3's rope scaling: those whose wavelength exceeds
    original / `low_freq_factor` divided by `factor`, those shorter than original / `high_freq_factor` kept, and
    those between blended linearly in original / wavelength. The operations of `transformers`'
    `_compute_llama3_parameters`, in its order and dtypes (equal factors make the blend's weights inf or nan, on
    entries the blend never selects, as there)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    context = original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    longest, shortest = context / low_freq_factor, context / high_freq_factor
    scaled = torch.where(wavelen > longest, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    between = ~(wavelen < shortest) * ~(wavelen > longest)
    return torch.where(between, blended, scaled)


def yarn_inv_freq(head_dim: int, theta: float, *, factor: float, beta_fast: float, beta_slow: float,
                  original_max_position_embeddings: int, truncate: bool) -> torch.Tensor:
    """[head_dim / 2] fp32 YaRN frequencies: the original ones on the fast-rotating dimensions, `factor` times
    slower ones on the slow dimensions, a linear ramp between the `beta_fast` and `beta_slow` bounds.

    Computed with the operations of `transformers`' `_compute_yarn_parameters`, in the same order and dtypes (fp32
    tensors, Python floats for the correction range), so the cos/sin tables, and with them the logits, are those of
    `transformers` bit for bit.
    """
    dim = head_dim

    def correction_dim(rotations: float) -> float:
        """The dimension that turns `rotations` times over the original context."""
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dimensions of each head of x [T, heads, head_dim] and keep the rest, as
    `transformers`' GLM-4.5 does with `partial_rotary_factor` < 1 (rotate-half within the rotated part); the
    whole head when the tables are that wide."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
