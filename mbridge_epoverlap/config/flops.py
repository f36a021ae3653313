"""Model FLOPs of one training iteration (matmuls only), for TFLOP/s per GPU (runtime and harness alike).

Forward per token and layer: QKV and output projections, causal attention (half of QK^T and AV),
and the MLP (dense, or top-k experts + router + shared expert); logits once. Backward is twice the
forward. Elementwise work and recompute are not counted, as in the usual "model FLOPs" convention.
"""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig


def model_flops_per_iteration(cfg: RunConfig) -> float:
    """Training FLOPs of one iteration: 3x (forward + 2x backward) the forward matmul FLOPs of every token."""
    m = cfg.model
    h, seq = m.hidden_size, m.seq_length
    heads = m.num_attention_heads
    kv_channels = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    q_width, kv_width = heads * kv_channels, 2 * groups * kv_channels
    projections = 2 * h * (q_width + kv_width) + 2 * q_width * h
    attention = 2 * seq * q_width  # QK^T + AV, 2 FLOPs per MAC each, halved by the causal mask
    matrices = 3 if m.gated_linear_unit else 2
    dense_mlp = 2 * matrices * h * (m.ffn_hidden_size or 4 * h)
    experts = m.num_moe_experts or 0
    moe_mlp = (m.moe_router_topk * 2 * matrices * h * m.moe_ffn_size + 2 * h * experts
               + 2 * matrices * h * (m.moe_shared_expert_intermediate_size or 0))
    per_token = sum(projections + attention + (moe_mlp if m.is_moe_layer(layer) else dense_mlp)
                    for layer in range(m.num_layers))
    per_token += 2 * h * (m.vocab_size or 0)  # a recipe that leaves it to the tokenizer: the head not counted
    tokens = cfg.train.global_batch_size * seq
    return 3.0 * tokens * per_token

