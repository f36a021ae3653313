"""The DeepSeek families, each extending the one before it (as `transformers`' modular files do).

- `deepseek_v3`: DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing, dense first layers).
- `deepseek_v32`: DeepSeek-V3.2 and GLM-5, DeepSeek-V3 with DeepSeek Sparse Attention (a lightning indexer).
- `deepseek_v4`: DeepSeek-V4 (compressed attention over a sliding window, hyper-connections, hash-routed first
  layers), its own family: its arithmetic is `serving.model.compressed`'s; `v4_config`: its config.json as
  `transformers` completes it (the older fields of released checkpoints folded in, the two ropes apart).
"""
