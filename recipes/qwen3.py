"""Qwen3 MoE recipes (dimensions from the public Qwen3-30B-A3B and Qwen3-235B-A22B model configs)."""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.recipes._common import make_run


def qwen3_30b_a3b(task: str = "pretrain") -> RunConfig:
    """Qwen3-30B-A3B on 16 GPUs: TP1/PP1/CP1/EP16, MBS 1, GBS 1024, seq 4096, bf16, alltoall."""
    model = MoEModelConfig(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128,
        ffn_hidden_size=6144, vocab_size=151936, seq_length=4096, qk_layernorm=True,
        num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        expert_model_parallel_size=16,
    )
    return make_run("qwen3_30b_a3b", task, model, num_gpus=16)


def qwen3_235b_a22b(task: str = "pretrain") -> RunConfig:
    """Qwen3-235B-A22B on 64 GPUs: TP2/PP8 (VP4, embedding and loss counted as layers)/EP8."""
    model = MoEModelConfig(
        num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4, kv_channels=128,
        ffn_hidden_size=12288, vocab_size=151936, seq_length=4096, qk_layernorm=True,
        num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=8, virtual_pipeline_model_parallel_size=4,
        account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
        expert_model_parallel_size=8, sequence_parallel=True,
    )
    return make_run("qwen3_235b_a22b", task, model, num_gpus=64)
