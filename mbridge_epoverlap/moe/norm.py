"""RMSNorm, computed in fp32 and cast back (as Transformer Engine does for bf16 models)."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """y = x / rms(x) * weight over the last dimension."""

    def __init__(self, size: int, *, eps: float = 1e-6, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)


class LayerNorm(torch.nn.Module):
    """Bias-free LayerNorm computed in fp32 (DBRX-style models)."""

    def __init__(self, size: int, *, eps: float = 1e-5, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None, self.eps)
        return y.to(x.dtype)


def make_norm(kind: str, size: int, *, dtype: torch.dtype, device: torch.device | None = None) -> torch.nn.Module:
    """The `normalization` of a Megatron-Core config: "RMSNorm" or "LayerNorm"."""
    if kind == "RMSNorm":
        return RMSNorm(size, dtype=dtype, device=device)
    if kind == "LayerNorm":
        return LayerNorm(size, dtype=dtype, device=device)
    raise ValueError(f"normalization={kind!r} is not supported; use RMSNorm or LayerNorm")
