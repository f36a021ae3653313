"""Serving MoE models with disaggregated expert parallelism.

- `catalog`: GPUs and models, with sources.
- `perf_model`: MegaScale-Infer's roofline performance model.
- `planner`: deployment search (Algorithm 1) and the colocated baseline; `cli`: `mbridge-epoverlap plan`.
- `checkpoint`: `load_spec` of a Hugging Face Mixtral / Qwen3-MoE checkpoint directory or a recipe name,
  validated up front; `spec` (`ModelSpec`), `hf_layout` (checkpoint tensor names and shapes).
- `model`: the inference model as an `AttentionPart` and `ExpertPart`s, `generate_reference`;
  `batch` (`TokenBatch`), `kv_cache` (`KVCache`), `sampling` (greedy, stop rules), `tokenizer`.

Nothing is imported here, so importing the package (and `mbridge-epoverlap --help`) stays cheap.
"""
