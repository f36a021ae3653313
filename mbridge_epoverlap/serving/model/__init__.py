"""The model room: what a serving process knows about the MoE model, and the arithmetic of decoding it.

Nothing here knows processes or messages; workers hold these pieces and call them.

- `spec`: `ModelSpec`, the small frozen description of a model every worker gets.
- `architectures`: one module per Hugging Face architecture family (Mixtral, the Qwen MoEs, OLMoE, DBRX, GPT-OSS,
  GLM-4.5, DeepSeek-V3, DeepSeek-V3.2 and GLM-5, DeepSeek-V4, MiniMax-M2, Nemotron-H, ...) and the registry: its config
  defaults, what its config.json means for the spec, and its tensor names; the quantized weight formats.
- `checkpoint`: `load_spec` of a Hugging Face checkpoint directory (any registered architecture) or a recipe
  name, checked up front, and `CheckpointReader` for single tensors.
- `hf_layout`: where each parameter lives in a Hugging Face checkpoint, and its expected shape (the spec's
  architecture module says).
- `layers`: the shared pieces the architectures compose: attention (biases, q/k norm per head or over the
  projection, sinks), multi-head latent attention, SwiGLU MLPs, shared experts plain or sigmoid-gated, RMSNorm as
  `transformers` computes it, the rotary embedding a spec asks for (default, YaRN, partial).
- `parts`: the model in two parts, `AttentionPart` (attention side, router) and `ExpertPart` (some
  routed experts), `LocalModel` and `generate_reference`, the tokens every engine mode must reproduce.
- `packed`: `PackedExperts`, the engine's expert GEMMs on oneDNN-packed weights (the reference model keeps
  transformers' GEMMs), and on tiled weights for experts of a few rows.
- `kernels`: compiled kernels (`small_gemm`: the tiled GEMM of a few rows; `combine`: a MoE layer's combine in
  one pass), built at first use.
- `expert_store`: the expert weights one expert worker holds, and how they change (restores, moves).
- `batch`: `TokenBatch`, the tokens of one step from several sequences, flat, and how they attend.
- `kv_cache`: `KVCache`, the keys and values of every sequence (and a hybrid model's `StateCache`), and decode
  attention over them (the one owner of `decode_attention` and `cached_attention`); `LatentKVCache`, DeepSeek-V3's
  cache of latents (and DeepSeek-V3.2's indexer keys).
- `linear`: the state layers (Qwen3-Next's gated DeltaNet, Nemotron-H's Mamba-2) and `StateCache`, the
  per-sequence states they keep beside the KV cache.
- `latent`: DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5) and its choice of the cached
  latents each query reads.
- `compressed`: DeepSeek-V4's attention (a sliding window of one shared key-value head, entries pooled from
  windows of tokens, a lightning indexer over them), its per-sequence `CompressedCache`, and its hyper-connections.
- `prefix_cache`: `PrefixCache`, full blocks of prompts' cached keys and values (or latents) reused by later
  prompts that begin with the same tokens (automatic prefix caching), least recently used evicted.
- `tokenizer`: text prompts for checkpoints that ship a `tokenizer.json`.

Nothing is imported here, so importing the package stays cheap.
"""
