"""DeepSeek-V3 recipe (dimensions from the public DeepSeek-V3 model config)."""

from __future__ import annotations

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.model import MoEModelConfig
from mbridge_epoverlap.recipes._common import make_run


def deepseek_v3(task: str = "pretrain") -> RunConfig:
    """DeepSeek-V3 (671B) on 1024 GPUs: TP1/PP16 (VP2)/EP64, MLA, 3 dense layers then MoE, one MTP layer."""
    model = MoEModelConfig(
        num_layers=61, hidden_size=7168, num_attention_heads=128, kv_channels=128,
        ffn_hidden_size=18432, vocab_size=129280, seq_length=4096, multi_latent_attention=True,
        num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_layer_freq=[0] * 3 + [1] * 58,
        moe_router_score_function="sigmoid", mtp_num_layers=1,
        pipeline_model_parallel_size=16, virtual_pipeline_model_parallel_size=2,
        account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
        expert_model_parallel_size=64,
    )
    return make_run("deepseek_v3", task, model, num_gpus=1024, global_batch_size=8192)
