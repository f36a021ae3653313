"""The Qwen MoE families, each extending the one before it (as `transformers`' modular files do).

- `qwen2_moe`: Qwen2-MoE (q/k/v biases, a shared expert scaled by sigmoid(`shared_expert_gate`)).
- `qwen3_moe`: Qwen3-MoE (q/k RMSNorm per head, routed weights in the model dtype).
- `qwen3_next`: Qwen3-Next, a hybrid of gated DeltaNet layers and gated full attention, on Qwen2-MoE's MoE layers.
- `qwen3_5_moe`: Qwen3.5-MoE, Qwen3-Next with its DeltaNet projections stored apart, every layer MoE.
"""
