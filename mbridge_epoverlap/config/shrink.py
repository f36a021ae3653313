"""Shrinking a recipe's model so it trains in a few CPU processes, keeping its structure.

Kept: the expert-count to top-k ratio (top-k capped), shared experts, dense-then-MoE layer pattern,
precision, dispatcher family and every overlap-related setting (so validation means the same thing).
Changed: widths, depth, sequence, vocabulary, and the parallel layout, which is fitted to the
process count (EP = processes unless given; TP = PP = CP = 1); routing is forced balanced unless
`CpuShape.force_balanced_routing` is off (see `CpuShape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.divisors import largest_divisor
from mbridge_epoverlap.errors import UsageError


@dataclass(frozen=True)
class CpuShape:
    """Sizes of the CPU model.

    The defaults are tuned for a 2-core machine running EP=2 over gloo: top-k 8 (Qwen3's own, so each
    token is sent to 8 experts), expert FFN 96 and a short sequence, so that an all-to-all takes about as
    long as the compute stage that hides it; 8 micro-batches so most of an iteration runs in overlappable
    (forward, backward) pairs. Smaller experts do not help on CPU: about two thirds of a gloo all-to-all's
    wall time is CPU work (`benchmarks/gloo_alltoall_cost.py`), and with FFN 48 or 32 the compute that
    should hide it is too short to absorb that work (measured 0.99x there against 1.09-1.18x at 96).
    `force_balanced_routing` sets Megatron's `moe_router_force_load_balancing`: without an auxiliary
    loss, the randomly initialized router of a shrunk model sends up to ~60 % of the rows to one rank's
    experts, and that rank's extra compute, not communication, then sets the step time (Megatron's own
    EP benchmarks force balanced routing too).
    """

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    expert_ffn_hidden_size: int = 96
    seq_length: int = 256
    vocab_size: int = 256
    micro_batch_size: int = 1
    num_micro_batches: int = 8
    max_topk: int = 8
    force_balanced_routing: bool = True


def shrink_for_cpu(
    cfg: RunConfig, num_procs: int, *, ep: int | None = None, shape: CpuShape | None = None
) -> RunConfig:
    """A copy of `cfg` sized for `num_procs` CPU processes.

    Raises:
        UsageError: a layout that cannot fit (EP not dividing the processes or the experts, EP larger
            than the expert count, a non-MoE recipe).
    """
    shape = shape or CpuShape()
    if num_procs < 1:
        raise UsageError(f"-ng {num_procs}: need at least one process")
    out = cfg.copy()
    m = out.model
    experts, topk = m.num_moe_experts or 0, m.moe_router_topk
    if experts <= 1:
        raise UsageError(f"recipe {cfg.recipe} is not a MoE model (num_moe_experts={experts}); "
                         "EP overlap needs experts")
    ep = num_procs if ep is None else ep
    if ep < 1 or num_procs % ep:
        raise UsageError(f"-ep {ep} does not divide -ng {num_procs}; use -ep {num_procs} or change -ng")
    new_topk = min(topk, shape.max_topk)
    new_experts = max(new_topk * max(experts // topk, 1), new_topk + 1) if experts > topk else experts
    if ep > new_experts:
        raise UsageError(f"-ep {ep} is larger than the {new_experts} experts of the CPU-sized {cfg.recipe}; "
                         f"use -ep {largest_divisor(new_experts, limit=num_procs)} or fewer processes")
    if new_experts % ep:
        raise UsageError(f"the CPU-sized {cfg.recipe} has {new_experts} experts, not divisible by -ep {ep}; "
                         f"use -ep {largest_divisor(new_experts, limit=ep)}")
    dense_prefix = 1 if isinstance(m.moe_layer_freq, list) and m.moe_layer_freq and m.moe_layer_freq[0] == 0 else 0
    m.num_layers = dense_prefix + shape.num_layers
    m.moe_layer_freq = [0] * dense_prefix + [1] * shape.num_layers if dense_prefix else 1
    m.hidden_size = shape.hidden_size
    m.num_attention_heads = shape.num_attention_heads
    m.num_query_groups = shape.num_attention_heads if m.num_query_groups is None else min(
        m.num_query_groups, shape.num_attention_heads)
    m.kv_channels = shape.hidden_size // shape.num_attention_heads
    m.ffn_hidden_size = 2 * shape.expert_ffn_hidden_size
    m.moe_ffn_hidden_size = shape.expert_ffn_hidden_size
    if m.moe_shared_expert_intermediate_size:
        m.moe_shared_expert_intermediate_size = shape.expert_ffn_hidden_size
    m.num_moe_experts, m.moe_router_topk = new_experts, new_topk
    if shape.force_balanced_routing:
        m.moe_router_force_load_balancing = True
    m.seq_length, m.vocab_size = shape.seq_length, shape.vocab_size
    m.multi_latent_attention = False
    m.mtp_num_layers = None
    # Layer kinds the reference runtime has no block for (`stand_ins` says what replaced them)
    m.hybrid_layer_pattern = m.experimental_attention_variant = m.linear_attention_freq = None
    m.enable_hyper_connections = False
    m.gated_linear_unit = True  # the runtime's experts are SwiGLU
    m.tensor_model_parallel_size = m.pipeline_model_parallel_size = m.context_parallel_size = 1
    m.virtual_pipeline_model_parallel_size = None
    m.account_for_embedding_in_pipeline_split = m.account_for_loss_in_pipeline_split = False
    m.expert_model_parallel_size, m.expert_tensor_parallel_size = ep, 1
    m.sequence_parallel = False
    if m.moe_token_dispatcher_type == "flex":
        m.moe_token_dispatcher_type = "alltoall"  # DeepEP/HybridEP need GPUs; alltoall is their CPU stand-in
    m.cuda_graph_impl, m.cuda_graph_scope = "none", []
    m.gradient_accumulation_fusion = False
    out.num_gpus, out.gpus_per_node = num_procs, num_procs
    out.train.micro_batch_size = shape.micro_batch_size
    out.train.global_batch_size = shape.micro_batch_size * shape.num_micro_batches * num_procs
    return out


# Megatron-Core's `experimental_attention_variant` values, in words.
ATTENTION_VARIANTS = {"gated_delta_net": "gated DeltaNet linear-attention", "dsa": "DeepSeek Sparse Attention",
                      "dsv4_hybrid": "DeepSeek-V4 compressed sparse attention"}
# Megatron's hybrid-pattern symbols and what each layer is.
HYBRID_SYMBOLS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE", "G": "gated DeltaNet"}


def stand_ins(model: Any) -> list[str]:
    """What the CPU-sized model runs in place of the layer kinds of `model` that the reference runtime (attention
    + MLP/MoE blocks) has no block for: one sentence each, for the run's notes."""
    said = []
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern:
        counts = {HYBRID_SYMBOLS.get(symbol, repr(symbol)): pattern.count(symbol) for symbol in dict.fromkeys(pattern)
                  if symbol in HYBRID_SYMBOLS}
        mix = ", ".join(f"{count} {kind}" for kind, count in counts.items())
        said.append(f"the hybrid stack ({mix} of {len(pattern)} layers) runs as attention + MoE layers: the reference "
                    "runtime has no Mamba or linear-attention block, and EP overlap only reorders the MoE layers' "
                    "dispatch and combine")
    variant = getattr(model, "experimental_attention_variant", None)
    if variant:
        kind = ATTENTION_VARIANTS.get(variant, f"{variant} attention")
        freq = getattr(model, "linear_attention_freq", None)
        where = f" ({sum(1 for f in freq if f)} of {len(freq)} layers)" if isinstance(freq, list) and freq else ""
        said.append(f"the {kind} layers{where} run as softmax attention")
    if getattr(model, "multi_latent_attention", False):
        said.append("multi-latent attention runs as standard multi-head attention")
    if getattr(model, "enable_hyper_connections", False):
        said.append("hyper-connections (several residual streams) run as one residual stream")
    if not getattr(model, "gated_linear_unit", True):
        said.append("the experts without a gate (squared-ReLU) run as SwiGLU experts of the same width")
    if getattr(model, "add_bias_linear", False) or getattr(model, "add_qkv_bias", False):
        said.append("linear-layer biases are left out (the reference runtime's layers have none)")
    if getattr(model, "mtp_num_layers", None):
        said.append(f"the {model.mtp_num_layers} multi-token-prediction layer(s) are left out")
    return said
