"""Rotary position embeddings (RoPE), the "rotate half" variant of Llama, Mixtral and Qwen3.

The angles are computed in fp32 from integer positions, one product per (position, frequency) pair, and
the rotation is `x * cos + rotate_half(x) * sin`, the same operations in the same order as Hugging Face
`transformers`, so a model decoded here gives its logits bit for bit where the rest of the model does.
"""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables of the default (unscaled) rope for `head_dim` and base `theta`.

    Args:
        head_dim: width of one attention head (even).
        theta: the rope base (`rope_theta`).
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim, self.theta = head_dim, float(theta)
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / (self.theta ** exponent), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, head_dim] fp32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: [T, heads, head_dim] by the angles of its tokens (cos, sin: [T, head_dim])."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return (x * cos) + (rotate_half(x) * sin)
