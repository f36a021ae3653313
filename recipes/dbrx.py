"""DBRX recipe (dimensions from the public DBRX model config)."""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.recipes._common import make_run


def dbrx(task: str = "pretrain") -> RunConfig:
    """DBRX (132B) on 64 GPUs: TP2/PP4 (VP5)/EP8, 16 experts top-4."""
    model = MoEModelConfig(
        num_layers=40, hidden_size=6144, num_attention_heads=48, num_query_groups=8, kv_channels=128,
        ffn_hidden_size=10752, vocab_size=100352, seq_length=4096, normalization="LayerNorm",
        num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=10752,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=5,
        expert_model_parallel_size=8, sequence_parallel=True,
    )
    return make_run("dbrx", task, model, num_gpus=64, global_batch_size=512)
