"""DeepSeek-V4's attention side: compressed attention over a sliding window, and hyper-connections.

- `rope`: the interleaved rotary embedding on the trailing dimensions of each head, its angles in fp32.
- `state`: `CompressedCache`, what each sequence keeps per layer: the sliding window's keys and each pool's buffered
  tokens, overlap and pooled entries (added and freed with the sequence, beside the KV cache).
- `pool`: `Pool`, a compressor turning windows of tokens into single entries (overlapping windows and the
  lightning indexer's keys for compressed sparse attention, non-overlapping for heavily compressed attention).
- `attention`: `CompressedAttention`, one layer's queries, shared key = value, pools and indexer, the attention
  with sinks per sequence, and the grouped low-rank output projection.
- `hyper`: `HyperConnection` and `HyperHead`, the residual streams' mixing, and the router and clamped shared
  expert of the MoE layers (`ScoreRouter`, `LimitedSwiGLU`).

The arithmetic follows `transformers`' `modeling_deepseek_v4` operation by operation, each sequence's attention in
the shapes it has there, so the reference model's logits equal the eager model's bit for bit.
"""
