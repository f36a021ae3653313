"""Linear attention: token mixers that keep a fixed-size state per sequence instead of keys and values.

- `delta_net`: gated DeltaNet (Qwen3-Next), its chunked form for prompts and its one-step recurrence for decode
  tokens, and `GatedDeltaNetAttention`, one layer's projections, convolution, gated norm and attention over the
  state cache.
- `state_cache`: `StateCache`, each sequence's convolution windows and recurrent states per linear layer, held
  beside the KV cache (`KVCache.states`), and `state_bytes_per_sequence`.
"""
