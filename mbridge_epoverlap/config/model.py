"""The model part of a run config: Megatron-Core `TransformerConfig` attribute names and defaults.

`MoEModelConfig` carries the fields this project reads, under the names Megatron-Core and
Megatron-Bridge model providers use, so the validator treats it, a real `TransformerConfig` and a
Megatron-Bridge provider alike. `model_attr` reads any such object and falls back to Megatron-Core's
default for an attribute the object does not have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mbridge_epoverlap.fields import get_field

# Megatron-Core 0.16 TransformerConfig defaults for the attributes the rules read.
MCORE_DEFAULTS: dict[str, Any] = {
    "num_moe_experts": None,
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather",
    "moe_flex_dispatcher_backend": "deepep",
    "moe_shared_expert_overlap": False,
    "moe_shared_expert_intermediate_size": None,
    "moe_use_legacy_grouped_gemm": False,
    "moe_layer_freq": 1,
    "bf16": False,
    "fp16": False,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "recompute_modules": None,
    "mtp_num_layers": None,
    "cuda_graph_impl": "none",
    "cuda_graph_scope": "full",
    "gradient_accumulation_fusion": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "overlap_moe_expert_parallel_comm": False,
    "delay_wgrad_compute": False,
    "ep_overlap_early_attn_memory_release": False,
    "overlap_dispatch_backward_with_experts_wgrad": False,
    "fine_grained_activation_offloading": False,
    "offload_modules": None,
    "use_te_rng_tracker": False,
    "moe_grouped_gemm": False,
    "moe_expert_capacity_factor": None,
    "moe_pad_expert_input_to_capacity": False,
    "moe_expert_rank_capacity_factor": None,
    "moe_ncclep_static_shape": False,
    "moe_ncclep_zero_copy": False,
    "moe_dispatch_fwd_dtype": "bf16",
    "moe_combine_bwd_dtype": "bf16",
    "moe_use_grouped_tensor": False,
    "use_transformer_engine_op_fuser": False,
    "moe_hybridep_num_sms": None,
    "moe_permute_fusion_into_hybridep": False,
}

_MISSING = object()


def provide_class(model_cfg: Any) -> str:
    """The class whose `provide()` builds a model: the run config's `provide_class`, or, for a Megatron-Bridge
    provider object, the first class of its MRO that defines `provide` ("GPTModelProvider" when unknown)."""
    named = get_field(model_cfg, "provide_class", None)
    if named:
        return named
    owner = next((cls.__name__ for cls in type(model_cfg).__mro__ if "provide" in vars(cls)), None)
    return owner or "GPTModelProvider"


def model_attr(model_cfg: Any, name: str) -> Any:
    """Attribute `name` of any TransformerConfig-like object, or Megatron-Core's default."""
    value = get_field(model_cfg, name, _MISSING)
    if value is _MISSING:
        return MCORE_DEFAULTS.get(name)
    return value


@dataclass
class MoEModelConfig:
    """A MoE GPT model as Megatron-Core describes it (a subset of `TransformerConfig` plus vocab/seq).

    Field names match `megatron.core.transformer.transformer_config.TransformerConfig` so overrides
    such as `model.moe_shared_expert_overlap=false` mean the same thing as in Megatron-Bridge.
    """

    # Architecture
    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    kv_channels: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = 1024  # None: the tokenizer's (some recipes leave it to the tokenizer)
    seq_length: int = 128
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    multi_latent_attention: bool = False
    # Layer kinds besides softmax attention + MLP/MoE (Megatron-Bridge providers' names): the hybrid stack's
    # pattern (M Mamba, * attention, - MLP, E MoE, G gated DeltaNet), linear attention every
    # `linear_attention_freq`-th layer pattern, DeepSeek-V4's hyper-connections
    hybrid_layer_pattern: str | None = None
    experimental_attention_variant: str | None = None
    linear_attention_freq: int | list[int] | None = None
    enable_hyper_connections: bool = False
    # The Megatron-Bridge provider class whose `provide()` builds the model (a recipe's, read by its facts): the
    # build-time checks differ (GPTModelProvider's asserts the TE RNG tracker for CUDA graphs; the hybrid and
    # vision-language providers' do not). None: GPTModelProvider's.
    provide_class: str | None = None
    # MoE
    num_moe_experts: int | None = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | list[int] = 1
    moe_router_score_function: str = "softmax"
    moe_router_force_load_balancing: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_grouped_gemm: bool = True
    moe_permute_fusion: bool = False
    moe_use_legacy_grouped_gemm: bool = False
    moe_token_dispatcher_type: str = "alltoall"
    moe_flex_dispatcher_backend: str | None = None
    moe_shared_expert_overlap: bool = False
    mtp_num_layers: int | None = None
    # Token dropping (drop-and-pad), all releases
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    # Flex backends (which release has which field: config/release_fields.py)
    moe_expert_rank_capacity_factor: float | None = None
    moe_hybridep_num_sms: int | None = None
    moe_permute_fusion_into_hybridep: bool = False
    moe_ncclep_static_shape: bool = False
    moe_ncclep_zero_copy: bool = False
    moe_dispatch_fwd_dtype: str = "bf16"
    moe_combine_bwd_dtype: str = "bf16"
    # Transformer Engine's fused grouped-GEMM path
    use_transformer_engine_op_fuser: bool = False
    moe_use_grouped_tensor: bool = False
    # Precision
    bf16: bool = True
    fp16: bool = False
    # Parallelism (Megatron-Bridge keeps these on the model provider)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = 1
    sequence_parallel: bool = False
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Recompute
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None
    # CUDA graphs
    cuda_graph_impl: str = "none"
    cuda_graph_scope: list[str] = field(default_factory=list)
    use_te_rng_tracker: bool = False
    # Fusions
    gradient_accumulation_fusion: bool = False
    # Activation offloading (Megatron-Core >= 0.17)
    fine_grained_activation_offloading: bool = False
    offload_modules: list[str] | None = None
    # EP overlap (mirrored from comm_overlap when the config is finalized)
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    ep_overlap_early_attn_memory_release: bool = False
    overlap_dispatch_backward_with_experts_wgrad: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_transformer_config(self) -> Any:
        """Build a real Megatron-Core `TransformerConfig` (imports megatron.core; call after validation).

        Its constructor stops at the first failed assertion; validate with `CommOverlapConfig.validate`
        first to see every problem at once.
        """
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        names = {f.name for f in dataclasses.fields(TransformerConfig)}
        kwargs = {k: v for k, v in self.to_dict().items() if k in names}
        kwargs["cuda_graph_scope"] = list(self.cuda_graph_scope)
        kwargs["params_dtype"] = torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32
        if self.moe_flex_dispatcher_backend is None:
            kwargs.pop("moe_flex_dispatcher_backend", None)
        kwargs["moe_enable_deepep"] = False
        return TransformerConfig(**kwargs)

    @property
    def moe_ffn_size(self) -> int:
        """Per-expert FFN width (falls back to ffn_hidden_size, then 4*hidden)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a MoE layer under `moe_layer_freq`."""
        if not self.num_moe_experts:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0
