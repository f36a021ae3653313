"""State layers: token mixers that keep a fixed-size state per sequence instead of keys and values.

- `delta_net`: gated DeltaNet (Qwen3-Next), its chunked form for prompts and its one-step recurrence for decode
  tokens, and `GatedDeltaNetAttention`, one layer's projections, convolution, gated norm and attention over the
  state cache.
- `mamba2`: Mamba-2 (Nemotron-H), its chunked scan for prompts and its one-step recurrence for decode tokens, and
  `Mamba2Mixer`, one layer's projections, convolution, gated group norm and scan over the state cache.
- `conv`: the causal depthwise convolution both run, exact (`F.conv1d`) or as multiply-adds (the workers).
- `state_cache`: `StateCache`, each sequence's convolution windows and recurrent states per linear layer, held
  beside the KV cache (`KVCache.states`), and `state_bytes_per_sequence`.
"""
