"""The causal depthwise convolution every state layer (gated DeltaNet, Mamba-2) runs over its inputs, with SiLU.

A sequence's convolution window is its last `kernel` inputs (zeros before its first token), kept in the state
cache. `exact`: `F.conv1d` as `transformers` calls it (the reference model); else (the engine's workers) K
multiply-adds in fp32, equal to rounding, wherever `F.conv1d` is the slower: in bf16 it loops over the channels on a
CPU (58 ms of a 140 ms decode step of the Qwen3-Next-shaped bench model, AVX2 AMD EPYC), and in fp32 it takes 2.0 ms
for a decode step of 64 sequences of 640 channels against 0.8 (a prompt of 90 tokens: 0.3 against 0.8 ms, so fp32
prompts keep it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prompt_conv(window: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt or prompt chunk x [channels, L] after `window` [channels, kernel] (None: the sequence's first
    tokens) -> (SiLU(conv) [L, channels] in x's dtype, the new window). `weight` [channels, 1, kernel]."""
    kernel, length = weight.shape[-1], x.shape[-1]
    full = x[None] if window is None else torch.cat([window, x], dim=-1)[None]
    if full.shape[-1] < kernel:  # fewer inputs than taps: zeros before them, as transformers' cache pads
        full = F.pad(full, (kernel - full.shape[-1], 0))
    if exact or weight.dtype == torch.float32:
        out = F.conv1d(full.to(weight.dtype), weight, bias, padding=kernel - 1, groups=full.shape[1])
        out = F.silu(out[..., :full.shape[-1]]).to(x.dtype)[0, :, -length:]
    else:  # output t: the K inputs ending at t (zeros before the first) times the taps, summed in fp32
        taps = F.pad(full[0].float(), (kernel - 1, 0)).unfold(-1, kernel, 1)[:, -length:]
        summed = (taps * weight[:, 0, None, :].float()).sum(-1)
        out = F.silu(summed if bias is None else summed + bias.float()[:, None]).to(x.dtype)
    return out.t(), full[0, :, -kernel:]


def step_conv(windows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
              exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: windows [B, channels, kernel], x [B, channels] -> (SiLU(conv) [B, channels]
    in x's dtype, the new windows [B, channels, kernel] in the weight's dtype)."""
    full = torch.cat([windows, x[:, :, None].to(windows.dtype)], dim=-1).to(weight.dtype)
    new = full[..., 1:]
    if exact:
        out = F.conv1d(full, weight, bias, groups=full.shape[1])[..., -1]
        return F.silu(out).to(x.dtype), new
    summed = (new.float() * weight[:, 0, :].float()).sum(-1)
    return F.silu(summed if bias is None else summed + bias.float()).to(x.dtype), new
