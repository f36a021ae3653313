"""What multi-head latent attention adds for DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5).

- `indexer`: the lightning indexer (`LightningIndexer`: its small queries, its key per token, the weight of each of
  its heads) and the choice of the tokens each query attends to: `exact_selection` as `transformers` computes it,
  one sequence at a time; `padded_selection` for a batch of decode tokens at once (the engine's workers).

The latent projections are `layers.MultiLatentAttention`'s; the latents and the indexer's keys live in
`kv_cache.LatentKVCache`, which attends over the selected rows.
"""
