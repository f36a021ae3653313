"""Mixtral recipe (dimensions from the public Mixtral-8x22B model config)."""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.recipes._common import make_run


def mixtral_8x22b(task: str = "pretrain") -> RunConfig:
    """Mixtral-8x22B on 64 GPUs: TP2/PP4 (VP7)/EP8, 8 experts top-2."""
    model = MoEModelConfig(
        num_layers=56, hidden_size=6144, num_attention_heads=48, num_query_groups=8, kv_channels=128,
        ffn_hidden_size=16384, vocab_size=32768, seq_length=4096,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16384,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=7,
        expert_model_parallel_size=8, sequence_parallel=True,
    )
    return make_run("mixtral_8x22b", task, model, num_gpus=64, global_batch_size=256)
