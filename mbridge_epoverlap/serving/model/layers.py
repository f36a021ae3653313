"""The pieces every architecture's attention side is built from, chosen by the `ModelSpec`'s fields.

- `Attention`: q, k and v projections (with biases where the checkpoint has them), RMSNorm on queries and
  keys per head (Qwen3-MoE) or over the whole projection (OLMoE), the output projection (with a bias: GPT-OSS)
  and GPT-OSS's per-head attention sinks (which the KV cache's attention uses). Decode
  attention itself is the KV cache's (`serving.model.kv_cache`); this module only projects in and out.
- `SwiGLU`: a dense SwiGLU MLP, the MLP of a dense layer or a shared expert.
- `SharedExpert`: the always-on expert of a MoE layer, plain or scaled by sigmoid(a [1, hidden] gate)
  (Qwen2-MoE).
- `RMSNorm`, `make_norm`: the checkpoints' RMSNorm (or LayerNorm, as the spec says).
- `weightless_rms_norm`, `temperature_scaled`: Llama 4's q/k norm without weights and the attention temperature
  of its layers without rope.
- `MultiLatentAttention`: DeepSeek-V3's latent attention projections (queries directly or through a
  `q_lora_rank` bottleneck, the compressed latent, its per-head up-projection, interleaved rotary); the attention
  over the cached latents is the KV cache's (`LatentKVCache`).

`routing_for` picks each layer's routing once from the spec (the family's `moe.router` method: softmax then
top-k, top-k then softmax or sigmoid, grouped sigmoid, a p-norm); the routed experts are
`serving.model.parts.ExpertPart`'s. With `separate` (the reference model) every projection
that `transformers` runs as its own GEMM runs as its own GEMM here too (views of the stacked weights, no copy),
so the products have `transformers`' shapes on every CPU (`docs/numerics.md`); without it (the engine's
workers) q, k, v and gate, up run as one GEMM each, the same sums rounded differently in the last bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.norm import LayerNorm
from mbridge_epoverlap.moe.rotary import (
    RotaryEmbedding,
    apply_pair_rotary,
    apply_partial_rotary,
    apply_rotary,
    llama3_inv_freq,
    yarn_inv_freq,
)
from mbridge_epoverlap.moe.wgrad import Linear
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.kv_cache import KVCache, LatentKVCache
from mbridge_epoverlap.serving.model.latent.indexer import IndexQueries, LightningIndexer, rotate_pairs
from mbridge_epoverlap.serving.model.spec import LatentAttention, ModelSpec

# A layer's rotary angles (cos, sin [T, rotated dims] fp32) for the batch's positions, computed when first asked
# (`AttentionPart` computes them once a step for every layer that turns them)
Angles = Callable[[], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(torch.nn.Module):
    """y = weight * (x / rms(x)), the normalised x computed in fp32 and rounded to x's dtype before the weight
    multiplies it in that dtype, as every architecture here does it in `transformers`. (`moe.norm.RMSNorm`
    multiplies by the weight in fp32 before rounding: the same in fp32, another bf16 result unless the weight
    is all ones.) With `round_after_weight` (GPT-OSS, `spec.norm_round_after_weight`) the weight multiplies the
    fp32 normalised x and the product is rounded once, as `transformers` does for that model. With `zero_centred`
    (Qwen3-Next, `spec.norm_zero_centred`) the scale is 1 + weight, in fp32, and the product is rounded once."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype, round_after_weight: bool = False,
                 zero_centred: bool = False) -> None:
        super().__init__()
        self.eps, self.round_after_weight, self.zero_centred = eps, round_after_weight, zero_centred
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if self.round_after_weight:  # GPT-OSS: the weight times the fp32 input (in fp32), rounded once
            return (self.weight * h).to(x.dtype)
        return self.weight * h.to(x.dtype)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in fp32, rounded to x's dtype: Llama 4's q/k norm (no weight)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scaled(q: torch.Tensor, positions: torch.Tensor, floor_scale: float,
                       attn_scale: float) -> torch.Tensor:
    """Queries q [T, heads, head_dim] of the tokens at `positions` times log1p(floor((p + 1) / floor_scale)) *
    attn_scale + 1, the scale in fp32 and the product rounded to q's dtype: Llama 4's attention temperature on its
    layers without rope, which sharpens the softmax of far positions."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * scales[:, None, None]).to(q.dtype)


def make_norm(spec: ModelSpec, size: int, dtype: torch.dtype) -> torch.nn.Module:
    """The spec's normalisation over `size` features."""
    if spec.normalization == "LayerNorm":
        return LayerNorm(size, eps=spec.norm_eps, dtype=dtype)
    return RMSNorm(size, eps=spec.norm_eps, dtype=dtype, round_after_weight=spec.norm_round_after_weight,
                   zero_centred=spec.norm_zero_centred)


class Attention(torch.nn.Module):
    """The projections of grouped-query self-attention; parameters uninitialised.

    Parameters: `qkv.weight` [(heads + 2 * groups) * head_dim, hidden] (q rows, then k, then v), `qkv_bias`
    (same rows, `spec.qkv_bias`), `q_norm.weight` / `k_norm.weight` (`spec.qk_norm`: [head_dim] each per head,
    or [heads * head_dim] / [groups * head_dim] over the projection), `proj.weight` [hidden, heads * head_dim],
    `proj_bias` [hidden] (`spec.attention_out_bias`), `sinks` [heads] (`spec.attention_sinks`: one logit per
    head that joins the softmax; the KV cache's attention uses it). With `spec.attention_output_gate` (Qwen3-Next)
    the q rows are per head its query then its gate (2 * heads * head_dim rows); `project_qkv` returns the gate
    and `project_out` multiplies the attention output by its sigmoid first.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.heads, self.groups, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.output_gate = spec.attention_output_gate
        self.widths = [self.heads * d * (2 if self.output_gate else 1), self.groups * d, self.groups * d]
        self.qkv = Linear(h, sum(self.widths), dtype=dtype)
        self.qkv_bias = torch.nn.Parameter(torch.empty(sum(self.widths), dtype=dtype)) if spec.qkv_bias else None
        self.proj = Linear(self.heads * d, h, dtype=dtype)
        self.proj_bias = torch.nn.Parameter(torch.empty(h, dtype=dtype)) if spec.attention_out_bias else None
        self.sinks = torch.nn.Parameter(torch.empty(self.heads, dtype=dtype)) if spec.attention_sinks else None
        if spec.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"qk_norm_scope {spec.qk_norm_scope!r} must be 'head' or 'projection'")
        self.norm_per_head = spec.qk_norm_scope == "head"
        self.clip = spec.clip_qkv
        self.fused = spec.fused_qkv
        q_size, k_size = (d, d) if self.norm_per_head else (self.widths[0], self.widths[1])
        zero = spec.norm_zero_centred
        self.q_norm = RMSNorm(q_size, eps=spec.norm_eps, dtype=dtype, zero_centred=zero) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_size, eps=spec.norm_eps, dtype=dtype, zero_centred=zero) if spec.qk_norm else None
        # oneDNN-packed copies of the fused q/k/v and output weights (`AttentionPart(packed=True)` sets them)
        self.packed_qkv: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.packed_proj: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.spec = spec
        self.separate = True  # q, k and v as the checkpoint's three GEMMs (the engine's workers: one fused GEMM)

    def mix(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: KVCache, angles: Angles) -> torch.Tensor:
        """Layer `layer`'s attention for the batch's tokens (x [T, hidden], normalised; their keys and values go
        into `cache`, whose attention this is) -> [T, hidden]."""
        q, k, v, gate = self.project_qkv(x, separate=self.separate)
        q, k = self.positioned(layer, q, k, batch.positions, angles)
        heads = cache.attend(layer, q, k, v, batch, sliding_window=self.spec.window_of(layer), sinks=self.sinks,
                             chunk=self.spec.chunk_of(layer))
        return self.project_out(heads, gate)

    def positioned(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, angles: Angles
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s queries and keys with their positions in: turned by the rotary embedding (then normalised
        by `spec.qk_l2_norm`), or, on a layer without rope, the queries scaled by `spec.attn_temperature`.
        Nemotron-H's attention and Llama 4's NoPE layers have no rope: positions reach them otherwise."""
        spec = self.spec
        if spec.rope_of(layer):
            cos, sin = angles()
            # Llama 4 turns adjacent pairs; GLM-4.5 and others only the head's first `rotary_dim` dimensions
            turn = apply_pair_rotary if spec.rope_pairs else apply_partial_rotary if spec.rotary_dim else apply_rotary
            q, k = turn(q, cos, sin), turn(k, cos, sin)
            if spec.qk_l2_norm:
                q, k = weightless_rms_norm(q, spec.norm_eps), weightless_rms_norm(k, spec.norm_eps)
        elif spec.attn_temperature is not None:
            q = temperature_scaled(q, positions, *spec.attn_temperature)
        return q, k

    def project_qkv(self, x: torch.Tensor, *, separate: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> q [T, heads, head_dim], k and v [T, groups, head_dim] (q and k normalised, not rotated)
        and the output gate [T, heads * head_dim] for `project_out` (None without `spec.attention_output_gate`).

        `separate`: three GEMMs over the stacked weight's row blocks, as checkpoints define the projections (one
        where the checkpoint has one fused projection, `spec.fused_qkv`).
        """
        biases = self.qkv_bias.split(self.widths) if self.qkv_bias is not None else (None, None, None)
        if separate and not self.fused:
            q, k, v = (F.linear(x, w, b) for w, b in zip(self.qkv.weight.split(self.widths), biases, strict=True))
        elif self.packed_qkv is not None:
            fused = self.packed_qkv(x)
            q, k, v = (fused if self.qkv_bias is None else fused + self.qkv_bias).split(self.widths, dim=-1)
        else:
            q, k, v = F.linear(x, self.qkv.weight, self.qkv_bias).split(self.widths, dim=-1)
        if self.clip is not None:
            # DBRX clamps the fused projection; elementwise, so the same on q, k and v apart
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        gate = None
        if self.output_gate:  # per head: its query, then its gate
            q, gate = q.reshape(x.shape[0], self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(x.shape[0], -1)
        norms = self.q_norm is not None and self.k_norm is not None
        if norms and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(x.shape[0], self.heads, self.head_dim)
        k = k.reshape(x.shape[0], self.groups, self.head_dim)
        v = v.reshape(x.shape[0], self.groups, self.head_dim)
        if norms and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def project_out(self, heads_out: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """[T, heads * head_dim] attention output (times sigmoid(`gate`), `project_qkv`'s) -> [T, hidden]."""
        if gate is not None:
            heads_out = heads_out * torch.sigmoid(gate)
        if self.packed_proj is not None:
            out = self.packed_proj(heads_out)
            return out if self.proj_bias is None else out + self.proj_bias
        if self.proj_bias is not None:
            return F.linear(heads_out, self.proj.weight, self.proj_bias)
        return self.proj(heads_out)


class SwiGLU(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); `fc1.weight` [2 * ffn, hidden] (gate rows, then up), `fc2.weight` [hidden, ffn]."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(hidden, 2 * ffn, dtype=dtype)
        self.fc2 = Linear(ffn, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, *, separate: bool = True) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `separate`: the gate and up projections as two GEMMs."""
        if separate:
            gate, up = (F.linear(x, w) for w in self.fc1.weight.chunk(2))
        else:
            gate, up = F.linear(x, self.fc1.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2.weight)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2, Nemotron-H's MLP activation (`transformers`' "relu2")."""
    return torch.square(F.relu(x))


class ReluSquaredMLP(torch.nn.Module):
    """down(relu(up(x))^2), an MLP without a gate projection (Nemotron-H); `up.weight` [ffn, hidden], `down.weight`
    [hidden, ffn]."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.up = Linear(hidden, ffn, dtype=dtype)
        self.down = Linear(ffn, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, *, separate: bool = True) -> torch.Tensor:
        return F.linear(relu_squared(F.linear(x, self.up.weight)), self.down.weight)


def dense_mlp(spec: ModelSpec, hidden: int, ffn: int, dtype: torch.dtype) -> SwiGLU | ReluSquaredMLP:
    """The spec's MLP of a dense layer (`spec.mlp_activation`)."""
    return ReluSquaredMLP(hidden, ffn, dtype) if spec.mlp_activation == "relu2" else SwiGLU(hidden, ffn, dtype)


class SharedExpert(torch.nn.Module):
    """A MoE layer's always-on expert, its output scaled by sigmoid(gate(x)) when `gated` (`gate.weight`
    [1, hidden]); a SwiGLU MLP, or relu(up x)^2 with `activation` "relu2"."""

    def __init__(self, hidden: int, ffn: int, *, gated: bool, dtype: torch.dtype, activation: str = "swiglu") -> None:
        super().__init__()
        self.mlp = ReluSquaredMLP(hidden, ffn, dtype) if activation == "relu2" else SwiGLU(hidden, ffn, dtype)
        self.gate = Linear(hidden, 1, dtype=dtype) if gated else None

    def forward(self, x: torch.Tensor, *, separate: bool = True) -> torch.Tensor:
        out = self.mlp(x, separate=separate)
        if self.gate is None:
            return out
        return torch.sigmoid(F.linear(x, self.gate.weight)) * out


Routing = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def routing_for(spec: ModelSpec, router: torch.nn.Module) -> Routing:
    """The spec's routing through `router`, chosen once per layer: normalised tokens [T, hidden] -> (expert ids
    [T, k], combine weights [T, k]) as the family's `transformers` router computes them. DeepSeek-style grouped
    sigmoid (`spec.grouped_routing`), top-k then softmax (GPT-OSS), top-k then sigmoid (Llama 4), softmax then
    top-k divided by a p-norm or in the logits' dtype (DBRX, OLMoE), or softmax then top-k, renormalised or not."""
    if spec.grouped_routing is not None:
        return lambda tokens: _pair(router.route(tokens))
    if spec.router_softmax_after_topk:
        return lambda tokens: _pair(router.topk_softmax(tokens))
    if spec.router_sigmoid_after_topk:
        return lambda tokens: _pair(router.topk_sigmoid(tokens))
    if spec.router_softmax_in_dtype or spec.topk_norm_p is not None:
        return lambda tokens: softmax_topk_pnorm(router, tokens, spec.top_k, in_dtype=spec.router_softmax_in_dtype,
                                                 p=spec.topk_norm_p)
    return lambda tokens: _pair(router.softmax_topk(tokens, normalize=spec.norm_topk_prob))


def _pair(routing: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return routing.experts, routing.weights


def softmax_topk_pnorm(router: torch.nn.Module, x: torch.Tensor, top_k: int, *, in_dtype: bool,
                       p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DBRX's routing: (expert ids [T, k], weights [T, k]) from a softmax over all experts' logits (in the
    logits' dtype when `in_dtype`, else fp32), the k largest, divided by their p-norm (`torch.norm`, as
    `transformers` does: for p=1 that is not always the same bits as a sum) unless `p` is None. The weights
    stay in the softmax's dtype."""
    logits = F.linear(x, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype if in_dtype else torch.float32)
    top, experts = torch.topk(probs, top_k, dim=-1)
    if p is not None:
        top = top / torch.norm(top, p=p, dim=-1, keepdim=True)
    return experts, top


# transformers builds DeepSeek-V3's `q_a_layernorm` and `kv_a_layernorm` with DeepseekV3RMSNorm's default epsilon,
# not the config's `rms_norm_eps`
LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(torch.nn.Module):
    """The projections of one multi-head latent attention layer (DeepSeek-V2/V3, `ModelSpec.mla`); parameters
    uninitialised.

    A token's keys and values come from one compressed latent: `kv_a_proj` maps the input to `kv_lora_rank` values
    (normalised by `kv_a_norm`) and a rotary key shared by every head; `kv_b_proj` expands the latent into each
    head's key (`qk_nope_head_dim`, the shared rotary part appended) and value (`v_head_dim`). The cache holds only
    the latent and the rotary key (`kv_cache.LatentKVCache`), and attends to them exactly (every head's keys and
    values rebuilt, `transformers`' products) or with the up-projections absorbed into the query and the output
    (the workers' decode batches, as DeepSeek's inference code, vLLM and SGLang decode).

    Parameters: `q_proj.weight` [heads * qk, hidden] (no `q_lora_rank`) or `q_a_proj.weight` [q_lora_rank, hidden]
    (+ `q_a_bias` with `attention_bias`), `q_a_norm.weight` [q_lora_rank], `q_b_proj.weight`
    [heads * qk, q_lora_rank]; `kv_a_proj.weight` [kv_lora_rank + rope, hidden] (+ `kv_a_bias`), `kv_a_norm.weight`
    [kv_lora_rank], `kv_b_proj.weight` [heads * (nope + v), kv_lora_rank]; `o_proj.weight` [hidden, heads * v]
    (+ `o_bias`). qk = nope + rope: `qk_nope_head_dim` + `qk_rope_head_dim`.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, *, bias: bool = False, layer: int = 0) -> None:
        super().__init__()
        if spec.mla is None:
            raise ValueError(f"{spec.source} has no latent attention (spec.mla is None)")
        m: LatentAttention = spec.mla
        h, self.heads = spec.hidden_size, spec.num_heads
        self.mla = m
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank = m.kv_lora_rank
        qk = self.nope + self.rope

        def vector(size: int) -> torch.nn.Parameter | None:
            return torch.nn.Parameter(torch.empty(size, dtype=dtype)) if bias else None

        if m.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(h, self.heads * qk, dtype=dtype)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
            self.q_a_bias = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, m.q_lora_rank, dtype=dtype)
            self.q_a_bias = vector(m.q_lora_rank)
            self.q_a_norm = RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(m.q_lora_rank, self.heads * qk, dtype=dtype)
        self.kv_a_proj = Linear(h, self.rank + self.rope, dtype=dtype)
        self.kv_a_bias = vector(self.rank + self.rope)
        self.kv_a_norm = RMSNorm(self.rank, eps=LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), dtype=dtype)
        self.o_proj = Linear(self.heads * self.v_dim, h, dtype=dtype)
        self.o_bias = vector(h)
        # DeepSeek Sparse Attention: this layer's indexer, or (GLM-5's shared layers) the selection of the layer before
        self.sparse = m.indexer
        self.indexer = (LightningIndexer(spec, dtype)
                        if m.indexer is not None and layer not in m.indexer.shared_layers else None)

    # --- projections --------------------------------------------------------------------------------

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] (normalised) -> q [T, heads, nope + rope], the normalised latent [T, kv_lora_rank], the
        rotary key [T, rope] (neither rotated) and the normalised query bottleneck [T, q_lora_rank] (None without
        one)."""
        q_resid = None
        if self.q_proj is not None:
            q = F.linear(x, self.q_proj.weight)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q_resid = self.q_a_norm(F.linear(x, self.q_a_proj.weight, self.q_a_bias))
            q = F.linear(q_resid, self.q_b_proj.weight)
        compressed = F.linear(x, self.kv_a_proj.weight, self.kv_a_bias)
        latent, k_rope = compressed.split([self.rank, self.rope], dim=-1)
        return q.view(x.shape[0], self.heads, self.nope + self.rope), self.kv_a_norm(latent), k_rope, q_resid

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, rope] by its tokens' angles (cos, sin [T, rope] fp32). With `rope_interleave` the
        pairs are (x0, x1), (x2, x3), ... and the result holds the first of each pair, then the second (as
        `transformers`' `apply_rotary_pos_emb_interleave` lays it out; queries and keys alike, so their dot
        products are those of the interleaved rotation)."""
        return rotate_pairs(x, cos, sin, interleave=self.mla.rope_interleave)

    def project_out(self, heads_out: torch.Tensor) -> torch.Tensor:
        """[T, heads * v] attention output -> [T, hidden]."""
        return F.linear(heads_out, self.o_proj.weight, self.o_bias)

    def mix(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: KVCache, angles: Angles) -> torch.Tensor:
        """`Attention.mix` over a cache of latents (`KVCache.for_spec` makes one for an MLA spec)."""
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"{self.mla} attends over a LatentKVCache (KVCache.for_spec makes one)")
        return self.project_out(self.attend(layer, x, batch, cache, angles()))

    def attend(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: LatentKVCache,
               cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The attention of layer `layer` for the batch's tokens (their latents go into `cache`) -> [T, heads * v]."""
        q, latent, k_rope, q_resid = self.project(x)
        cos, sin = cos_sin
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = self.rotate(q_rope, cos, sin)
        k_rope = self.rotate(k_rope[:, None, :], cos, sin)[:, 0]
        index = None
        if self.sparse is not None:
            index = IndexQueries(None, None, None, self.sparse.topk)
            if self.indexer is not None:
                assert q_resid is not None
                q_index, k_index, weights = self.indexer.project(x, q_resid, cos, sin)
                index = IndexQueries(q=q_index, weights=weights, keys=k_index, topk=self.sparse.topk)
        return cache.attend_latent(layer, q_nope, q_rope, latent, k_rope, batch, self.kv_b_proj.weight, self.mla,
                                   index=index)


def rotary_for(spec: ModelSpec) -> RotaryEmbedding:
    """The spec's rotary embedding: the default rope over its rotated dimensions, Llama 3's scaled frequencies, or
    YaRN's (cos and sin scaled by its attention factor); tables of one angle per pair with `spec.rope_pairs`."""
    scaling = spec.rope_scaling
    if scaling is None:
        return RotaryEmbedding(spec.rope_dim, spec.rope_theta, pairs=spec.rope_pairs)
    if scaling.kind == "llama3":
        inv_freq = llama3_inv_freq(spec.rope_dim, spec.rope_theta, factor=scaling.factor,
                                   low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                                   original_max_position_embeddings=scaling.original_max_position_embeddings)
        return RotaryEmbedding(spec.rope_dim, spec.rope_theta, inv_freq=inv_freq, pairs=spec.rope_pairs)
    if scaling.kind != "yarn":
        raise ValueError(f"rope scaling {scaling.kind!r} is not implemented (only 'yarn' and 'llama3')")
    inv_freq = yarn_inv_freq(spec.rope_dim, spec.rope_theta, factor=scaling.factor, beta_fast=scaling.beta_fast,
                             beta_slow=scaling.beta_slow, truncate=scaling.truncate,
                             original_max_position_embeddings=scaling.original_max_position_embeddings)
    return RotaryEmbedding(spec.rope_dim, spec.rope_theta, inv_freq=inv_freq,
                           attention_scaling=scaling.attention_factor, pairs=spec.rope_pairs)
