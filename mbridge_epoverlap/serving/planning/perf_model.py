"""MegaScale-Infer's performance model of disaggregated MoE decoding, from rooflines.

All times are seconds for one micro-batch in one layer unless a name says otherwise. Every function
works on floats and, element-wise, on numpy arrays of configurations, which is how the planner
evaluates thousands of deployments at once.

- Attention node (TP group of `tp_a` GPUs): reads its weights once per micro-batch and the KV cache
  of every sequence in it, so `T_a = k1*b_a + k2` with k1 from the KV read (growing with context)
  and k2 from the weights, unless compute binds.
- Expert node (TP group of `tp_e` GPUs holding `experts_per_group` experts): reads the weights of
  the experts that received tokens and runs `2 * tokens * 3*h*f` FLOPs: `T_e = max(compute, weight read)`.
- M2N transfer: `T_c = max(bytes_a / (W_a*util), bytes_e / (W_e*util))` with `bytes_a = b_a*h*K/tp_a`
  and `bytes_e = b_e*h/tp_e` activation elements per GPU.
- Iteration (one decode step, time between tokens): the ping-pong closed form
  `schedule.presets.ping_pong_makespan`, which equals `(T_a + T_e + 2*T_c) + T_f*(m*L - 1)` when the
  pipeline is full; the simulator times the same schedule and the tests hold the two equal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.schedule.presets import ping_pong_makespan
from mbridge_epoverlap.serving.planning.catalog import GPU, Model

Num = Any  # float or numpy array


@dataclass(frozen=True)
class PerfParams:
    """Efficiency factors and fixed costs of the model. Defaults are typical, not measured here.

    Attributes:
        compute_efficiency: share of peak dense FLOP/s that decode GEMMs reach.
        memory_efficiency: share of peak HBM bandwidth that weight and KV reads reach.
        link_utilization: share of NIC bandwidth an M2N transfer reaches (the paper's `util`).
        memory_headroom: share of HBM usable for weights and KV cache (rest: activations, runtime).
        stage_overhead_s: fixed time per stage per micro-batch (kernel launches, synchronisation).
        link_latency_s: fixed time per M2N transfer.
        collective_latency_s: fixed time per tensor-parallel all-reduce.
        weight_bytes: bytes per weight (2 for bf16).
        kv_bytes: bytes per KV-cache element.
        activation_bytes: bytes per activation element sent over links.
        gpus_per_node: GPUs in one server; TP groups stay inside one.
    """

    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    link_utilization: float = 0.7
    memory_headroom: float = 0.9
    stage_overhead_s: float = 20e-6
    link_latency_s: float = 15e-6
    collective_latency_s: float = 10e-6
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    activation_bytes: float = 2.0
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UsageError(f"performance parameter {name} must be a finite number >= 0, got {value!r}")
        for name in ("compute_efficiency", "memory_efficiency", "link_utilization", "memory_headroom"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise UsageError(f"performance parameter {name} must be in (0, 1], got {value!r}")
        for name in ("weight_bytes", "kv_bytes", "activation_bytes", "gpus_per_node"):
            if not getattr(self, name) > 0:
                raise UsageError(f"performance parameter {name} must be > 0, got {getattr(self, name)!r}")


def roofline(flops: Num, bytes_moved: Num, gpu: GPU, tp: Num, p: PerfParams) -> Num:
    """Time of a kernel sequence split evenly over `tp` GPUs: the slower of compute and memory."""
    compute = flops / (tp * gpu.flops * p.compute_efficiency)
    memory = bytes_moved / (tp * gpu.mem_bw * p.memory_efficiency)
    return np.maximum(compute, memory)


def tp_allreduce_time(tokens: Num, model: Model, gpu: GPU, tp: Num, p: PerfParams) -> Num:
    """Ring all-reduce of `tokens` hidden vectors over the TP group's scale-up link (0 when tp = 1)."""
    volume = 2 * (tp - 1) / tp * tokens * model.hidden * p.activation_bytes
    return volume / gpu.scale_up_bw + p.collective_latency_s * (tp > 1)


def attention_time(model: Model, gpu: GPU, tp: Num, batch: Num, context: Num, p: PerfParams) -> Num:
    """T_a: attention, router and shared experts of one MoE layer for `batch` sequences on one node.

    Shared experts see every token, like attention, so they run where attention runs and need no
    dispatch.
    """
    weights = model.attention_params + model.shared_params
    flops = 2 * batch * (weights + model.hidden * model.experts) + batch * context * (
        model.attention_flops_per_context_token
    )
    bytes_moved = weights * p.weight_bytes + batch * context * model.kv_elems_per_token * p.kv_bytes
    reductions = 2 if model.shared_experts else 1
    return (
        roofline(flops, bytes_moved, gpu, tp, p)
        + reductions * tp_allreduce_time(batch, model, gpu, tp, p)
        + p.stage_overhead_s
    )


def dense_layer_time(model: Model, gpu: GPU, tp: Num, batch: Num, context: Num, p: PerfParams) -> Num:
    """A leading dense layer (attention + dense FFN), run entirely on the attention node."""
    weights = model.attention_params + model.dense_ffn_params
    flops = 2 * batch * weights + batch * context * model.attention_flops_per_context_token
    bytes_moved = weights * p.weight_bytes + batch * context * model.kv_elems_per_token * p.kv_bytes
    return (
        roofline(flops, bytes_moved, gpu, tp, p) + 2 * tp_allreduce_time(batch, model, gpu, tp, p) + p.stage_overhead_s
    )


def head_time(model: Model, gpu: GPU, tp: Num, batch: Num, p: PerfParams) -> Num:
    """Embedding lookup and LM head for `batch` tokens, once per decode step, on the attention node."""
    flops = 2 * batch * model.vocab * model.hidden
    bytes_moved = model.vocab * model.hidden * p.weight_bytes
    return roofline(flops, bytes_moved, gpu, tp, p) + p.stage_overhead_s


def active_experts(model: Model, experts_per_group: Num, tokens_per_expert: Num) -> Num:
    """Expected experts of a group that receive at least one token (only those weights are read).

    A micro-batch makes `tokens_per_expert * E` token-expert assignments spread uniformly over E
    experts, so an expert gets none with probability `(1 - 1/E) ** (tokens_per_expert * E)`.
    """
    # exp/log1p form: the same number, but numpy evaluates it much faster than a power.
    idle = np.exp(tokens_per_expert * (model.experts * math.log1p(-1.0 / model.experts)))
    return experts_per_group * (1.0 - idle)


def expert_time(model: Model, gpu: GPU, tp: Num, tokens_per_expert: Num, experts_per_group: Num, p: PerfParams) -> Num:
    """T_e: grouped expert GEMMs of one MoE layer on one expert node.

    Args:
        tokens_per_expert: b_e, tokens each expert receives in one micro-batch (`B*K / (m*E)`).
        experts_per_group: experts held by this node.
    """
    tokens = tokens_per_expert * experts_per_group
    flops = 2 * tokens * model.expert_params
    weights = active_experts(model, experts_per_group, tokens_per_expert) * model.expert_params * p.weight_bytes
    activations = 2 * tokens * model.hidden * p.activation_bytes
    return (
        roofline(flops, weights + activations, gpu, tp, p)
        + tp_allreduce_time(tokens, model, gpu, tp, p)
        + p.stage_overhead_s
    )


def m2n_time(
    model: Model,
    attn_gpu: GPU,
    expert_gpu: GPU,
    tp_a: Num,
    tp_e: Num,
    batch: Num,
    tokens_per_group: Num,
    p: PerfParams,
) -> Num:
    """T_c: one dispatch (or combine) between attention and expert nodes over their NICs.

    Each attention GPU sends its `1/tp_a` share of `b_a*K` hidden vectors; each expert GPU receives
    its `1/tp_e` share of the group's tokens. The slower end sets the time.
    """
    bytes_a = batch * model.hidden * model.top_k * p.activation_bytes / tp_a
    bytes_e = tokens_per_group * model.hidden * p.activation_bytes / tp_e
    send = bytes_a / (attn_gpu.nic_bw * p.link_utilization)
    receive = bytes_e / (expert_gpu.nic_bw * p.link_utilization)
    return np.maximum(send, receive) + p.link_latency_s


def kv_bytes_per_sequence(model: Model, context: Num, p: PerfParams) -> Num:
    """KV cache of one sequence of `context` tokens over all layers (`2*s*h*L/g` elements for GQA)."""
    return context * model.kv_elems_per_token * model.layers * p.kv_bytes


def attention_weight_bytes(model: Model, p: PerfParams) -> float:
    """Weights an attention node holds: attention, router, shared experts, dense layers, embeddings."""
    params = (
        model.layers * model.attention_params
        + model.moe_layers * (model.shared_params + model.hidden * model.experts)
        + model.dense_layers * model.dense_ffn_params
        + model.embedding_params
    )
    return params * p.weight_bytes


def expert_weight_bytes(model: Model, experts_per_group: Num, p: PerfParams) -> Num:
    """Weights an expert node holds: its experts in every MoE layer."""
    return experts_per_group * model.moe_layers * model.expert_params * p.weight_bytes


def usable_memory(gpu: GPU, tp: Num, p: PerfParams) -> Num:
    return tp * gpu.mem_bytes * p.memory_headroom


def max_sequences(model: Model, gpu: GPU, tp: Num, context: Num, p: PerfParams, extra_weights: Num = 0.0) -> Num:
    """Sequences whose KV cache fits on an attention node next to its weights (may be <= 0)."""
    free = usable_memory(gpu, tp, p) - attention_weight_bytes(model, p) - extra_weights
    return np.floor(free / kv_bytes_per_sequence(model, context, p))


def decode_step_time(
    model: Model, t_attn: Num, t_expert: Num, t_comm: Num, m: Num, t_dense: Num = 0.0, t_head: Num = 0.0
) -> Num:
    """Time between tokens for the ping-pong pipeline over the MoE layers.

    Dense leading layers and the LM head run on the attention node alone, once per micro-batch.
    """
    return ping_pong_makespan(t_attn, t_expert, t_comm, m, model.moe_layers) + m * (
        model.dense_layers * t_dense + t_head
    )


def colocated_step_time(
    model: Model, gpu: GPU, tp: Num, groups: Num, batch: Num, context: Num, p: PerfParams
) -> tuple[Num, Num, Num, Num]:
    """Colocated EP with no overlap: `groups` TP groups each run attention on `batch` sequences and
    hold `E/groups` experts; every MoE layer is attention, all-to-all, experts, all-to-all in turn.

    Returns:
        (T_a, T_e, T_c, time between tokens).
    """
    tokens_per_expert = batch * groups * model.top_k / model.experts
    t_attn = attention_time(model, gpu, tp, batch, context, p)
    t_expert = expert_time(model, gpu, tp, tokens_per_expert, model.experts / groups, p)
    # All-to-all among the groups: NVLink (or PCIe) inside a server, the NIC beyond it.
    inside = groups * tp <= p.gpus_per_node
    bandwidth = np.where(inside, gpu.scale_up_bw, gpu.nic_bw) * p.link_utilization
    sent = batch * model.hidden * model.top_k * p.activation_bytes / tp * (groups - 1) / groups
    t_comm = sent / bandwidth + p.link_latency_s * (groups > 1)
    t_dense = dense_layer_time(model, gpu, tp, batch, context, p)
    t_head = head_time(model, gpu, tp, batch, p)
    step = model.moe_layers * (t_attn + t_expert + 2 * t_comm) + model.dense_layers * t_dense + t_head
    return t_attn, t_expert, t_comm, step
