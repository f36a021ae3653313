"""The DeepSeek families, each extending the one before it (as `transformers`' modular files do).

- `deepseek_v3`: DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, dense first layers).
- `deepseek_v32`: DeepSeek-V3.2 and GLM-5, DeepSeek-V3 with DeepSeek Sparse Attention (a lightning indexer).
"""
