"""Catalogs of GPUs and MoE models, with where each number comes from.

GPU figures come from `mbridge_epoverlap.gpus` (vendor datasheet peaks: dense bf16 tensor FLOP/s, i.e.
without 2:4 sparsity, HBM capacity and bandwidth, the per-GPU scale-out NIC of the usual 8-GPU server,
and the scale-up link, aggregate bidirectional NVLink or PCIe where there is none). Prices are relative
rental prices per GPU-hour, only good for ratios; pass your own (`prices=` in Python, `--price GPU=X` on
the command line) for a real decision.

Model figures are copied from each model's public `config.json` (Hugging Face); each entry names it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import TypeVar

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.gpus import GPU_FACTS, GpuFacts, gpu_facts

# The GPU figures live in the one project-wide catalog (`mbridge_epoverlap.gpus`); the planner models the
# entries whose serving figures are known, under their display names.
GPU = GpuFacts

GPUS: dict[str, GPU] = {facts.name: facts for facts in GPU_FACTS.values() if facts.modelled}


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention dimensions (DeepSeek-V2/V3)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Model:
    """A MoE decoder's shape.

    Attributes:
        name: catalog name.
        layers: decoder layers (dense and MoE).
        hidden: hidden size h.
        heads: attention (query) heads.
        kv_heads: key/value heads (GQA groups; equal to `heads` for MHA).
        head_dim: per-head dimension.
        experts: routed experts E per MoE layer.
        top_k: experts per token K.
        expert_ffn: intermediate size of one routed expert (SwiGLU: three h x f matrices).
        shared_experts: shared experts per MoE layer, each of size `shared_ffn`.
        shared_ffn: intermediate size of one shared expert.
        vocab: vocabulary size.
        dense_layers: leading layers with a dense FFN instead of experts.
        dense_ffn: intermediate size of those dense FFNs.
        tied_embeddings: input embedding and LM head share weights.
        mla: MLA dimensions, when attention is latent.
        published_params_b: total parameters as published, billions (for a sanity check).
        source: where the numbers come from.
        note: anything that is not a published fact.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    shared_experts: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    tied_embeddings: bool = False
    mla: MLA | None = None
    published_params_b: float = 0.0
    source: str = ""
    note: str = ""

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def attention_params(self) -> int:
        """Attention weights of one layer."""
        h = self.hidden
        if self.mla is not None:
            a = self.mla
            q = h * a.q_lora_rank + a.q_lora_rank * self.heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
            kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * self.heads * (
                a.qk_nope_head_dim + a.v_head_dim
            )
            return q + kv + self.heads * a.v_head_dim * h
        q_and_o = 2 * h * self.heads * self.head_dim
        return q_and_o + 2 * h * self.kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """One routed expert in one layer (gate, up and down projections)."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def shared_params(self) -> int:
        """Shared experts of one MoE layer."""
        return 3 * self.hidden * self.shared_ffn * self.shared_experts

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> int:
        """All weights, counted from the shape (norms and router omitted: well under 0.1 %)."""
        return (
            self.layers * self.attention_params
            + self.moe_layers * (self.experts * self.expert_params + self.shared_params)
            + self.dense_layers * self.dense_ffn_params
            + self.embedding_params
        )

    @property
    def kv_elems_per_token(self) -> int:
        """KV-cache elements one token keeps in one layer."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def attention_flops_per_context_token(self) -> int:
        """FLOPs of QK^T and AV for one query token against one cached token, one layer."""
        if self.mla is not None:
            # Absorbed MLA decode: scores over the latent plus rope part, values over the latent.
            a = self.mla
            return 2 * self.heads * (a.kv_lora_rank + a.qk_rope_head_dim) + 2 * self.heads * a.kv_lora_rank
        return 4 * self.heads * self.head_dim


MODELS: dict[str, Model] = {
    model.name: model
    for model in (
        Model(
            "Mixtral-8x22B",
            layers=56,
            hidden=6144,
            heads=48,
            kv_heads=8,
            head_dim=128,
            experts=8,
            top_k=2,
            expert_ffn=16384,
            vocab=32000,
            published_params_b=141,
            source="huggingface.co/mistralai/Mixtral-8x22B-v0.1 config.json",
        ),
        Model(
            "DBRX",
            layers=40,
            hidden=6144,
            heads=48,
            kv_heads=8,
            head_dim=128,
            experts=16,
            top_k=4,
            expert_ffn=10752,
            vocab=100352,
            published_params_b=132,
            source="huggingface.co/databricks/dbrx-base config.json (d_model, n_heads, kv_n_heads, ffn_hidden_size)",
        ),
        Model(
            "Scaled-MoE",
            layers=48,
            hidden=8192,
            heads=64,
            kv_heads=8,
            head_dim=128,
            experts=32,
            top_k=4,
            expert_ffn=8192,
            vocab=32000,
            published_params_b=317,
            source="MegaScale-Infer (arXiv 2504.02263) Table 2: 48 layers, hidden 8192, 32 experts, top-4, 317B",
            note="heads, KV heads, expert FFN and vocabulary are not published; chosen so the total is 317B",
        ),
        Model(
            "Qwen3-30B-A3B",
            layers=48,
            hidden=2048,
            heads=32,
            kv_heads=4,
            head_dim=128,
            experts=128,
            top_k=8,
            expert_ffn=768,
            vocab=151936,
            published_params_b=30.5,
            source="huggingface.co/Qwen/Qwen3-30B-A3B config.json",
        ),
        Model(
            "Qwen3-235B-A22B",
            layers=94,
            hidden=4096,
            heads=64,
            kv_heads=4,
            head_dim=128,
            experts=128,
            top_k=8,
            expert_ffn=1536,
            vocab=151936,
            published_params_b=235,
            source="huggingface.co/Qwen/Qwen3-235B-A22B config.json",
        ),
        Model(
            "DeepSeek-V3",
            layers=61,
            hidden=7168,
            heads=128,
            kv_heads=128,
            head_dim=128,
            experts=256,
            top_k=8,
            expert_ffn=2048,
            vocab=129280,
            shared_experts=1,
            shared_ffn=2048,
            dense_layers=3,
            dense_ffn=18432,
            mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            published_params_b=671,
            source="huggingface.co/deepseek-ai/DeepSeek-V3 config.json (first_k_dense_replace=3)",
            note="modelled in bf16; the released checkpoint is fp8",
        ),
    )
}


_T = TypeVar("_T")


def _lookup(kind: str, flag: str, name: str, table: dict[str, _T]) -> _T:
    folded = {key.casefold(): value for key, value in table.items()}
    found = folded.get(str(name).strip().casefold())
    if found is not None:
        return found
    close = difflib.get_close_matches(str(name), list(table), n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(f"unknown {kind} {name!r} for {flag}{hint}; known: {', '.join(table)}")


def get_gpu(name: str, *, flag: str = "--attn-gpu/--expert-gpu", prices: dict[str, float] | None = None) -> GPU:
    """The catalog GPU called `name` (case-insensitive), with an overridden price if `prices` has one.

    Raises:
        UsageError: unknown name (the message lists the known ones) or a price that is not > 0.
    """
    try:  # the harness spelling (h100, a100) names the same GPU as the display name (H100, A100-80G)
        facts: GPU | None = gpu_facts(name, setting=flag)
    except UsageError:
        facts = None
    gpu = facts if facts is not None and facts.modelled else _lookup("GPU", flag, name, GPUS)
    for key, price in (prices or {}).items():
        if key.casefold() == gpu.name.casefold():
            if not price > 0:
                raise UsageError(f"price of {gpu.name} must be > 0, got {price!r}; pass --price {gpu.name}=1.5")
            gpu = replace(gpu, price=float(price))
    return gpu


def get_model(name: str) -> Model:
    """The catalog model called `name` (case-insensitive).

    Raises:
        UsageError: unknown name; the message lists the known ones.
    """
    return _lookup("model", "--model", name, MODELS)
