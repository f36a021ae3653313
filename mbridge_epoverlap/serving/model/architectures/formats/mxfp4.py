"""MXFP4 expert weights (GPT-OSS's released checkpoints), dequantized when an expert is loaded.

A checkpoint stores a projection's weight [out, in] as `*_blocks` [..., out, in / 32, 16] uint8 and `*_scales`
[..., out, in / 32] uint8: each block of 32 consecutive inputs holds 32 FP4 (e2m1) codes, two per byte (the low
nibble first), and one shared power-of-two scale (e8m0: the exponent plus 127). The value of code c in a block
of scale s is `E2M1[c] * 2 ** (s - 127)`, the layout `transformers`' `convert_moe_packed_tensors` reads. Every
such value is exact in bf16 and fp32 (at most two significant bits), so dequantizing in fp32 and converting to
the model dtype gives what dequantizing in that dtype gives.
"""

from __future__ import annotations

import torch

BLOCK = 32  # inputs per scale
# e2m1 code -> value: codes 0-7 positive (0, 0.5, 1, 1.5, 2, 3, 4, 6), 8-15 their negatives
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., out, groups, 16] uint8 and scales [..., out, groups] uint8 -> the fp32 weight
    [..., out, groups * 32] ([out, in], as `F.linear` takes it)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         f"(expected blocks [..., groups, {BLOCK // 2}])")
    table = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], BLOCK, dtype=torch.float32)
    values[..., 0::2] = table[(blocks & 0x0F).long()]
    values[..., 1::2] = table[(blocks >> 4).long()]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (in a multiple of 32) -> (blocks, scales) that `dequantize` maps to the nearest
    MXFP4 weight: each block's scale the smallest power of two that brings its largest magnitude within 6. For
    tests and for writing small MXFP4 checkpoints; not the released checkpoints' quantizer."""
    *lead, inputs = weight.shape
    if inputs % BLOCK:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {BLOCK}, got {inputs}")
    w = weight.float().reshape(*lead, inputs // BLOCK, BLOCK)
    top = w.abs().amax(dim=-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127).to(torch.int32)
    scaled = torch.ldexp(w, -exponent[..., None])
    magnitudes = torch.tensor(E2M1[:8], dtype=torch.float32)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = torch.where(scaled < 0, codes + 8, codes).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)
