"""Quantized weight formats of the checkpoints, dequantized as they are read.

- `fp8`: FP8 block-scaled weights (DeepSeek-V3, Kimi K2, the `-FP8` releases of Qwen3 and GLM-4.5): the config's
  block size, dequantizing a stored tensor with its `weight_scale_inv`, and writing such checkpoints.
- `mxfp4`: GPT-OSS's MXFP4 expert weights (FP4 blocks, power-of-two scales), dequantized at load.
"""
