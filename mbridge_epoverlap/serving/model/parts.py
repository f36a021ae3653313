"""The inference model in two parts, as disaggregated serving places them.

- `AttentionPart`: everything but the routed experts: embedding, per layer the norms, attention with
  rotary embeddings and a KV cache, the router (or the dense MLP of a dense layer, and a shared expert if
  any), the final norm and the output head. Attention workers hold one each.
- `ExpertPart`: a subset of the routed experts of every MoE layer. Expert workers hold one each.

One decode step per layer is `attention_step` -> each (token, slot) row through its expert
(`ExpertPart.forward`, wherever that expert lives) -> `post_step`. `LocalModel` chains them in one
process and `generate_reference` decodes with it: the output every engine mode must reproduce.

The arithmetic follows Hugging Face `transformers` (eager attention, eager experts) step by step, in
the same order, so greedy decoding gives the same tokens as `generate(do_sample=False)`: routing is a
softmax over all experts then top-k (then renormalised), and a token's expert outputs are added in
ascending expert id starting from zero, as `index_add_` over experts does there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.moe.experts import GroupedExperts, clamped_swiglu, grouped_expert_swiglu
from mbridge_epoverlap.moe.model import seeded_normal
from mbridge_epoverlap.moe.router import GroupedSigmoidRouter, TopKRouter
from mbridge_epoverlap.moe.wgrad import Linear
from mbridge_epoverlap.serving.decoding.sampling import StopRule, greedy
from mbridge_epoverlap.serving.model import architectures
from mbridge_epoverlap.serving.model import packed as packed_gemm
from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.compressed.attention import CompressedAttention
from mbridge_epoverlap.serving.model.compressed.hyper import (
    HyperConnection,
    HyperHead,
    LimitedSwiGLU,
    ScoreRouter,
    limited_swiglu,
    mix,
)
from mbridge_epoverlap.serving.model.compressed.rope import fp32_norm
from mbridge_epoverlap.serving.model.kernels import combine
from mbridge_epoverlap.serving.model.kv_cache import KVCache, exact_attention_asked
from mbridge_epoverlap.serving.model.layers import (
    Attention,
    MultiLatentAttention,
    Routing,
    SharedExpert,
    dense_mlp,
    make_norm,
    relu_squared,
    rotary_for,
    routing_for,
)
from mbridge_epoverlap.serving.model.linear.delta_net import GatedDeltaNetAttention
from mbridge_epoverlap.serving.model.linear.mamba2 import Mamba2Mixer
from mbridge_epoverlap.serving.model.spec import ModelSpec

__all__ = [
    "AttentionPart", "AttnOut", "ExpertPart", "KVCache", "LocalModel", "TokenBatch", "generate_reference",
    "load_attention_part", "load_expert_part", "run_experts",
]

ANGLES_KEPT = 4  # micro-batches whose rotary angles are kept (two in flight, with room)


@dataclass
class AttnOut:
    """What `AttentionPart.attention_step` hands to the experts and to `post_step`.

    Attributes:
        resid: [T, hidden] the layer input plus attention (the residual stream).
        tokens: [T, hidden] the normalised input of the experts (or of the dense MLP); with
            `spec.router_scales_input` already multiplied by each token's router score.
        expert_ids: [T, k] int64 global expert ids, or None for a dense layer.
        gate_weights: [T, k] fp32 combine weights, or None for a dense layer.
        normed: [T, hidden] the normalised input of the shared expert where `tokens` is scaled (Llama 4); None:
            `tokens`.
        streams: DeepSeek-V4 (`resid` then [T, hc_mult, hidden], the residual streams): the MLP block's post
            [T, hc_mult] and comb [T, hc_mult, hc_mult] weights that `post_step` mixes them by; None: no streams.
    """

    resid: torch.Tensor
    tokens: torch.Tensor
    expert_ids: torch.Tensor | None
    gate_weights: torch.Tensor | None
    normed: torch.Tensor | None = None
    streams: tuple[torch.Tensor, torch.Tensor] | None = None


class DecodeLayer(torch.nn.Module):
    """The attention-side modules of one layer, the pieces of `serving.model.layers` the spec selects."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h = spec.hidden_size
        if spec.compressed is not None:  # DeepSeek-V4: its own attention, streams, router and shared expert
            self._compressed(spec, layer, dtype)
            return
        # a Nemotron-H layer may lack its mixer (an MLP block after another MLP block) or its MLP
        self.input_norm = make_norm(spec, h, dtype) if spec.has_mixer(layer) else None
        self.attention: Attention | MultiLatentAttention | GatedDeltaNetAttention | Mamba2Mixer | None
        if not spec.has_mixer(layer):
            self.attention = None
        elif spec.is_linear(layer):  # Qwen3-Next's gated DeltaNet: a state per sequence, no keys or values
            self.attention = GatedDeltaNetAttention(spec, dtype)
        elif spec.is_mamba(layer):  # Nemotron-H's Mamba-2: likewise
            self.attention = Mamba2Mixer(spec, dtype)
        elif spec.mla is not None:
            self.attention = MultiLatentAttention(spec, dtype, bias=spec.qkv_bias, layer=layer)
        else:
            self.attention = Attention(spec, dtype)
        self.post_norm = make_norm(spec, h, dtype) if spec.has_ffn(layer) else None
        self.router: GroupedSigmoidRouter | TopKRouter | None = None
        if spec.is_moe(layer) and spec.grouped_routing is not None:  # DeepSeek-V3, GLM-4.5, MiniMax-M2
            g = spec.grouped_routing
            self.router = GroupedSigmoidRouter(h, spec.num_experts, spec.top_k, n_group=g.n_group,
                                               topk_group=g.topk_group, scaling=g.routed_scaling_factor,
                                               normalize=spec.norm_topk_prob,
                                               logits_dtype=dtype if g.logits_in_model_dtype else None)
        elif spec.is_moe(layer):
            self.router = TopKRouter(h, spec.num_experts, spec.top_k, dtype=dtype, bias=spec.router_bias)
        # the family's routing, chosen here once rather than at every step
        self.route: Routing | None = routing_for(spec, self.router) if self.router is not None else None
        self.mlp = (dense_mlp(spec, h, spec.dense_ffn, dtype)
                    if not spec.is_moe(layer) and spec.has_ffn(layer) else None)
        self.shared_expert = (SharedExpert(h, spec.shared_expert_ffn, gated=spec.shared_expert_gate, dtype=dtype,
                                           activation=spec.mlp_activation)
                              if spec.is_moe(layer) and spec.shared_expert_ffn else None)

    def _compressed(self, spec: ModelSpec, layer: int, dtype: torch.dtype) -> None:
        c = spec.compressed
        assert c is not None
        h = spec.hidden_size
        self.input_norm, self.post_norm = fp32_norm(h, spec.norm_eps), fp32_norm(h, spec.norm_eps)
        self.attention = CompressedAttention(spec, layer, dtype)
        self.attn_hc, self.ffn_hc = (HyperConnection(c.hc_mult, h, iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                                                     norm_eps=spec.norm_eps) for _ in range(2))
        self.router = ScoreRouter(h, spec.num_experts, spec.top_k, scoring=c.scoring, scaling=c.routed_scaling_factor,
                                  vocab=spec.vocab_size if layer in c.hash_layers else None, dtype=dtype)
        self.route = None  # its step routes through the ScoreRouter itself (hash layers take the token ids)
        self.mlp = None
        self.shared_expert = LimitedSwiGLU(h, spec.shared_expert_ffn, spec.swiglu_limit, dtype)


class AttentionPart(torch.nn.Module):
    """Embedding, attention, routers, dense MLPs, final norm and head; parameters uninitialised
    (`load_attention_part` fills them).

    With `packed` (the engine's workers, fp32) the head and the fused q/k/v and output projections run on
    oneDNN-packed copies of their weights (`serving.model.packed.PackedLinear`): faster, rounded differently in
    the last bits, and q, k and v (and a SwiGLU's gate and up) come from one fused GEMM. Without it (the reference
    model) every GEMM is `transformers`', bit for bit on every CPU: the head's, q, k and v as three projections,
    gate and up as two (`docs/numerics.md`). MKL runs `F.linear` with its AVX2 kernels on AMD CPUs: a
    [1,024 x 512] x [512 -> 1,024] GEMM at ~100 GFLOP/s against oneDNN's ~240 on the same core (Zen 4, one
    thread), so packing the projections took a 1,024-token prefill of the 57M Mixtral from 305 to 267 ms and a
    64-sequence decode step from 33.7 to 30.7 ms. The price is a near tie now and then: one Mixtral sequence of
    the 64 of `serving_peers_bench.py` leaves `transformers`' greedy tokens at its token 50.
    """

    memory_role: ClassVar[str] = "weights"  # what `memory.resident_bytes` counts its tensors as

    def __init__(self, spec: ModelSpec, *, packed: bool = False) -> None:
        super().__init__()
        dtype = spec.torch_dtype()
        self.spec = spec
        self.embedding = torch.nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype))
        self.layers = torch.nn.ModuleList(DecodeLayer(spec, i, dtype) for i in range(spec.num_layers))
        self.final_norm = (make_norm(spec, spec.hidden_size, dtype) if spec.compressed is None
                           else fp32_norm(spec.hidden_size, spec.norm_eps))
        c = spec.compressed
        self.hc_head = None if c is None else HyperHead(c.hc_mult, spec.hidden_size, eps=c.hc_eps,
                                                        norm_eps=spec.norm_eps)
        self.head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, dtype=dtype)
        self.rotary = rotary_for(spec)
        # (positions, (cos, sin)) of the last batches: every layer of a step turns the same positions, so they are
        # computed once a step per micro-batch, not once a layer (the tensor held here: its identity stays its own)
        self._angles: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []
        self.requires_grad_(False)
        # fp32 only: measured there; bf16 keeps F.linear (its own oneDNN path), whose tokens the bf16 figures show
        pack = packed and dtype == torch.float32 and packed_gemm.available(dtype)
        self._head = (packed_gemm.PackedLinear(self.embedding if self.head is None else self.head.weight)
                      if pack else None)
        self._separate = not packed
        self._packed_attention: list[packed_gemm.PackedLinear] = []
        for block in self.layers:  # the workers' state layers' arithmetic is arranged for speed (`linear`)
            if isinstance(block.attention, GatedDeltaNetAttention | Mamba2Mixer):
                block.attention.exact = not packed or exact_attention_asked()
            elif isinstance(block.attention, Attention):
                block.attention.separate = self._separate
        if pack:
            for block in self.layers:
                if isinstance(block.attention, Attention):
                    block.attention.packed_qkv = packed_gemm.PackedLinear(block.attention.qkv.weight)
                    block.attention.packed_proj = packed_gemm.PackedLinear(block.attention.proj.weight)
                    self._packed_attention += [block.attention.packed_qkv, block.attention.packed_proj]
                elif isinstance(block.attention, Mamba2Mixer):  # its two projections, as attention's
                    block.attention.packed_in = packed_gemm.PackedLinear(block.attention.in_proj.weight)
                    block.attention.packed_out = packed_gemm.PackedLinear(block.attention.out_proj.weight)
                    self._packed_attention += [block.attention.packed_in, block.attention.packed_out]

    def prepack(self) -> None:
        """Pack the head now (loading does), not in the first step that needs it."""
        if self._head is not None:
            self._head.refresh()
        for linear in self._packed_attention:
            linear.refresh()

    @torch.no_grad()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] (DeepSeek-V4: [T, hc_mult, hidden], each stream the embedding)."""
        x = F.embedding(token_ids, self.embedding)
        if self.spec.compressed is not None:
            return x.unsqueeze(1).expand(-1, self.spec.compressed.hc_mult, -1).contiguous()
        return x

    @torch.no_grad()
    def attention_step(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: KVCache) -> AttnOut:
        """Attention of layer `layer` for the batch's tokens (their keys/values go into `cache`), then the
        pre-MLP norm and the router.

        Args:
            layer: 0-based layer index.
            x: [T, hidden] the layer input, rows in batch order.
            batch: the tokens' sequence ids and positions.
            cache: holds every sequence of the batch; each sequence's tokens start at its cached length.
        """
        block = self.layers[layer]
        if isinstance(block.attention, CompressedAttention):
            return self._compressed_step(layer, x, batch, cache)
        if block.attention is None or block.input_norm is None:  # a layer of an MLP alone (Nemotron-H)
            return self._after_mixer(layer, x)
        # each kind of mixer attends over its own part of the cache (keys and values, latents, states)
        mixed = block.attention.mix(layer, block.input_norm(x), batch, cache, lambda: self._cos_sin(batch.positions))
        return self._after_mixer(layer, x + mixed)

    def _compressed_step(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: KVCache) -> AttnOut:
        """DeepSeek-V4's layer up to its experts: x [T, hc_mult, hidden] the streams; the attention block between
        its hyper-connection's collapse and mix, then the MLP block's collapse, norm and routing (hash layers take
        their experts from the batch's token ids)."""
        block = self.layers[layer]
        if cache.compressed is None:
            raise TypeError(f"{self.spec.architecture} needs a KVCache with a compressed cache (KVCache.for_spec)")
        post, comb, collapsed = block.attn_hc(x)
        streams = mix(x, block.attention(block.input_norm(collapsed), batch, cache.compressed), post, comb)
        post, comb, collapsed = block.ffn_hc(streams)
        tokens = block.post_norm(collapsed)
        ids, weights = block.router.route(tokens, batch.token_ids)
        return AttnOut(resid=streams, tokens=tokens, expert_ids=ids, gate_weights=weights, streams=(post, comb))

    def _after_mixer(self, layer: int, resid: torch.Tensor) -> AttnOut:
        """The pre-MLP norm and the router of layer `layer` on the residual stream after its mixer."""
        block = self.layers[layer]
        if block.post_norm is None:  # a layer of a mixer alone (Nemotron-H): its MLP step adds nothing
            return AttnOut(resid=resid, tokens=resid, expert_ids=None, gate_weights=None)
        tokens = block.post_norm(resid)
        if block.route is None:
            return AttnOut(resid=resid, tokens=tokens, expert_ids=None, gate_weights=None)
        ids, weights = block.route(tokens)
        if self.spec.router_scales_input:
            # the expert takes its token times the score and its output adds with weight 1: one row per token, so
            # each token has one expert (the architecture refuses more), and every transport sends these rows
            if ids.shape[1] != 1:
                raise ValueError(f"router scores scale the experts' input only with one expert per token, not "
                                 f"{ids.shape[1]}")
            return AttnOut(resid=resid, tokens=tokens * weights.to(tokens.dtype), expert_ids=ids,
                           gate_weights=torch.ones(ids.shape), normed=tokens)
        weights = weights.to(tokens.dtype) if self.spec.router_weights_in_dtype else weights
        return AttnOut(resid=resid, tokens=tokens, expert_ids=ids, gate_weights=weights)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for seen, angles in self._angles:
            if seen is positions:
                return angles
        angles = self.rotary.cos_sin(positions)
        self._angles = [*self._angles[-(ANGLES_KEPT - 1):], (positions, angles)]
        return angles

    @torch.no_grad()
    def post_step(self, layer: int, attn: AttnOut, expert_out: torch.Tensor | None) -> torch.Tensor:
        """The layer output [T, hidden]: residual + the gate-weighted sum of the k expert outputs
        (`expert_out` [T, k, hidden], column j from expert `attn.expert_ids[:, j]`), added in ascending
        expert id, (+ shared expert); for a dense layer the dense MLP runs here (`expert_out` None)."""
        block = self.layers[layer]
        if attn.expert_ids is None or attn.gate_weights is None:
            if block.mlp is None and block.post_norm is None:  # no MLP in this layer
                return attn.resid
            if block.mlp is None:
                raise ValueError(f"layer {layer} is a MoE layer; its AttnOut needs expert ids and gate weights")
            return attn.resid + block.mlp(attn.tokens, separate=self._separate)
        if expert_out is None or expert_out.shape[:2] != attn.expert_ids.shape:
            shape = None if expert_out is None else list(expert_out.shape)
            raise ValueError(f"layer {layer}: expert outputs {shape} do not match expert ids "
                             f"{list(attn.expert_ids.shape)} (expected [T, k, hidden])")
        if attn.streams is not None:  # DeepSeek-V4: the routed and shared experts' sum spread into the streams
            mlp = gate_weighted_sum(expert_out, attn.expert_ids, attn.gate_weights, attn.resid.dtype)
            return mix(attn.resid, mlp + block.shared_expert(attn.tokens), *attn.streams)
        if block.shared_expert is None and combine.applies(expert_out, attn.expert_ids, attn.gate_weights, attn.resid):
            # gate_weighted_sum and the residual in one pass, the same bits (kernels/combine.py)
            return combine.weighted_sum(expert_out, attn.expert_ids, attn.gate_weights, attn.resid)
        mlp = gate_weighted_sum(expert_out, attn.expert_ids, attn.gate_weights, attn.resid.dtype)
        if block.shared_expert is not None:
            normed = attn.tokens if attn.normed is None else attn.normed
            mlp = mlp + block.shared_expert(normed, separate=self._separate)
        return attn.resid + mlp

    @torch.no_grad()
    def logits(self, x_last: torch.Tensor) -> torch.Tensor:
        """[n, hidden] last-layer outputs -> [n, vocab] fp32 logits (final norm, then the head); DeepSeek-V4's
        [n, hc_mult, hidden] streams are collapsed first."""
        if self.hc_head is not None:
            x_last = self.hc_head(x_last)
        if self._head is not None:
            return self._head(self.final_norm(x_last)).float()
        weight = self.embedding if self.head is None else self.head.weight
        return F.linear(self.final_norm(x_last), weight).float()


def gate_weighted_sum(expert_out: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """[T, hidden] in `dtype`: per token, 0 + each expert output [T, k, hidden] times its gate, added in ascending
    expert id, each product rounded to `dtype` before its sum (as `transformers`' `index_add_` over experts)."""
    order = torch.argsort(expert_ids, dim=1)
    tokens, k, hidden = expert_out.shape
    # Rows in ascending expert id per token: one index_select over [T * k] rows (a gather along dim 1 of
    # [T, k, hidden] does the same copy several times slower on CPU).
    flat = (torch.arange(tokens)[:, None] * k + order).reshape(-1)
    outs = expert_out.reshape(tokens * k, hidden).index_select(0, flat).view(tokens, k, hidden)
    weights = gates.gather(1, order)
    mlp = torch.zeros(tokens, hidden, dtype=dtype)
    for j in range(k):
        mlp = mlp + (outs[:, j] * weights[:, j, None]).to(dtype)
    return mlp


class ExpertPart(torch.nn.Module):
    """The routed experts `expert_ids` (global ids) of every MoE layer; uninitialised until loaded.

    With `packed` (the engine's workers) the expert GEMMs run on oneDNN-packed copies of the weights where this
    torch has them (`serving.model.packed`): faster, rounded differently in the last bits. Without it (the
    reference model) they are the GEMMs `transformers` runs, bit for bit.
    """

    memory_role: ClassVar[str] = "weights"

    def __init__(self, spec: ModelSpec, expert_ids: Sequence[int], *, packed: bool = False) -> None:
        super().__init__()
        ids = [int(e) for e in expert_ids]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= e < spec.num_experts for e in ids):
            raise UsageError(f"expert ids {ids} must be distinct ids in [0, {spec.num_experts}) and not empty")
        self.spec, self.expert_ids = spec, tuple(sorted(ids))
        local = torch.full((spec.num_experts,), -1, dtype=torch.int64)
        local[list(self.expert_ids)] = torch.arange(len(ids))
        self.register_buffer("local_index", local, persistent=False)
        dtype = spec.torch_dtype()
        self.experts = torch.nn.ModuleDict({
            str(layer): GroupedExperts(len(ids), spec.hidden_size, spec.expert_ffn, dtype=dtype)
            for layer in spec.moe_layer_ids
        })
        if not spec.expert_gated:  # Nemotron-H: an up projection alone, relu(up x)^2
            for e in self.experts.values():
                e.w1 = torch.nn.Parameter(e.w1.new_empty(len(ids), spec.expert_w1_rows, spec.hidden_size))
        if spec.expert_weights_in_out:
            # transformers multiplies by the weights as a checkpoint stores them, [in, out]; holding them in that
            # layout (w1, w2 are transposed views of it) makes each expert GEMM its GEMM (docs/numerics.md)
            for e in self.experts.values():
                e.w1.data = e.w1.data.transpose(1, 2).contiguous().transpose(1, 2)
                e.w2.data = e.w2.data.transpose(1, 2).contiguous().transpose(1, 2)
        self.biases = torch.nn.ModuleDict({
            str(layer): ExpertBiases(len(ids), spec.hidden_size, spec.expert_ffn, dtype=dtype)
            for layer in spec.moe_layer_ids
        }) if spec.expert_bias else None
        self.activation = expert_activation(spec)
        # Llama 4's reference: `transformers` runs every expert over every token (those routed elsewhere scaled to
        # zero), and a GEMM may round a row by the rows beside it, so each expert multiplies all the rows given
        self.every_row = spec.router_scales_input and not packed
        # layer -> per local expert its weights as the checkpoint stores them, for the reference model: (gate, up,
        # down), each [ffn, hidden], of `spec.expert_gate_up_separate`; (gate_up [hidden, 2*ffn], down
        # [ffn, hidden]) of `every_row` (`load_expert_part` fills it)
        self.stored: dict[str, list[tuple[torch.Tensor, ...]]] = {}
        self.requires_grad_(False)
        # where the checkpoint is FP8, each expert's row scales (`load_expert_part` fills them), so a decode step
        # reads its few-row experts' weights as FP8 tiles (`packed.PackedExperts`)
        self.fp8_scales = {str(layer): packed_gemm.Fp8RowScales.empty(len(ids), spec)
                           for layer in spec.moe_layer_ids} if packed and packed_gemm.fp8_tiles_for(spec) else {}
        self._packed = ({str(layer): packed_gemm.PackedExperts(e.w1, e.w2, self.fp8_scales.get(layer))
                         for layer, e in self.experts.items()} if packed and packed_gemm.available(dtype) else {})

    def prepack(self) -> None:
        """Pack the weights now (loading does), not in the first step that needs them."""
        for experts in self._packed.values():
            experts.refresh()

    @property
    def packed_layers(self) -> dict[str, packed_gemm.PackedExperts]:
        """Layer -> its packed experts; empty where the part computes on unpacked weights (not `packed`, or no
        packed GEMMs in this torch for the dtype). `expert_store` reuses them for experts held across an epoch."""
        return self._packed

    def owns(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the ids this part holds."""
        return self.local_index[expert_ids] >= 0

    @torch.no_grad()
    def forward(self, layer: int, tokens: torch.Tensor, expert_ids: torch.Tensor,
                token_index: torch.Tensor | None = None) -> torch.Tensor:
        """Each row of tokens [n, hidden] through its expert expert_ids[n] (global), unweighted -> [n, hidden].

        With `token_index` [n], row i is `tokens[token_index[i]]` (each token given once, however many of
        its experts are here).
        """
        if str(layer) not in self.experts:
            raise ValueError(f"layer {layer} is not a MoE layer of {self.spec.source}")
        experts = self.experts[str(layer)]
        local = self.local_index[expert_ids]
        if bool((local < 0).any()):
            stray = sorted(set(expert_ids[local < 0].tolist()))
            raise ValueError(f"experts {stray} are not in this part (it holds {list(self.expert_ids)})")
        if self.every_row:
            return every_row_experts(experts, tokens if token_index is None else tokens[token_index], local,
                                     self.stored.get(str(layer)))
        # One stable sort groups the rows by expert (each expert's rows keep their order, so every expert sees
        # the same GEMM as row-by-row selection would give it) instead of a search over all rows per expert:
        # with many small experts that search, not the GEMMs, was the expert stage's cost.
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=len(self.expert_ids)).tolist()
        rows = order if token_index is None else token_index[order]
        extra = {}
        if self.biases is not None:
            extra = {"b1": self.biases[str(layer)].b1, "b2": self.biases[str(layer)].b2}
        if self.activation is not None:
            extra["activation"] = self.activation
        grouped = tokens.index_select(0, rows)  # a third of the time of tokens[rows] (advanced indexing) here
        if str(layer) in self._packed:
            done = packed_expert_swiglu(self._packed[str(layer)], grouped, counts, **extra)
        elif str(layer) in self.stored and not extra:
            done = separate_gate_up_swiglu(grouped, self.stored[str(layer)], counts)
        else:
            done = grouped_expert_swiglu(grouped, experts.w1, experts.w2, counts, **extra)
        # Back in input order as a gather through the inverse permutation: half the time of out[order] = done.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        return done.index_select(0, inverse)


def every_row_experts(experts: GroupedExperts, rows: torch.Tensor, local: torch.Tensor,
                      stored: Sequence[tuple[torch.Tensor, ...]] | None = None) -> torch.Tensor:
    """Each row of rows [n, hidden] through its expert (`local`: local ids [n]) as `transformers` runs Llama 4's
    experts: each expert chosen by some row multiplies all n rows, those of the other experts zero, by its weights
    in their stored [in, out] layout (`spec.expert_weights_in_out`), and keeps its own rows' results. `stored`: per
    local expert (gate_up [hidden, 2*ffn], down [ffn, hidden]) at their file offsets (a GEMM of a few rows rounds by
    its weight's alignment); None: views of `experts`' weights."""
    out = rows.new_empty(rows.shape)
    for e in torch.unique(local).tolist():
        chosen = local == e
        gate_up, down = stored[e] if stored is not None else (experts.w1[e].t(), experts.w2[e].t())
        x = torch.zeros_like(rows)
        x[chosen] = rows[chosen]
        gate, up = torch.matmul(x, gate_up).chunk(2, dim=-1)
        out[chosen] = torch.matmul(up * F.silu(gate), down)[chosen]
    return out


def packed_expert_swiglu(experts: packed_gemm.PackedExperts, x: torch.Tensor, counts: list[int],
                         **extra: Any) -> torch.Tensor:
    """`grouped_expert_swiglu` on packed weights (a module function, so `engine.breakdown` can time it); `extra`:
    the biases and activation of `PackedExperts.swiglu`."""
    return experts.swiglu(x, counts, **extra)


def separate_gate_up_swiglu(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                            counts: list[int]) -> torch.Tensor:
    """`grouped_expert_swiglu` one expert at a time as `transformers` runs DBRX's: x [rows, hidden] grouped by
    expert, `weights[e]` = (gate, up, down), each [ffn, hidden] as stored (down multiplied untransposed).

    The gate and up projections are two GEMMs (a GEMM of one row rounds differently with twice the output
    columns) and the activation runs on a contiguous gate (ATen's vector path, where a column slice of
    [gate | up] may take the scalar one for the last elements)."""
    out = x.new_empty(x.shape)
    start = 0
    for (gate_w, up_w, down_w), n in zip(weights, counts, strict=True):
        if n:
            rows = x[start:start + n]
            out[start:start + n] = torch.matmul(F.silu(F.linear(rows, gate_w)) * F.linear(rows, up_w), down_w)
        start += n
    return out


def _at_file_offset(tensor: torch.Tensor, offset: int | None) -> torch.Tensor:
    """A copy of `tensor` starting `offset` bytes past a 64-byte boundary (None: wherever torch puts it).

    `transformers` multiplies by a checkpoint tensor that keeps its stored dtype as a view of the memory-mapped
    file, so at the address offset the file gives it, and a GEMM of one row (a matrix-vector product) rounds by
    its weight's alignment: the reference model's copy sits at the same offset."""
    size = tensor.element_size()
    if offset is None or offset % size:
        return tensor.clone()
    buffer = torch.empty(tensor.numel() + 128 // size, dtype=tensor.dtype)
    skip = next((k for k in range(128 // size) if (buffer.data_ptr() + k * size) % 64 == offset % 64), None)
    if skip is None:
        return tensor.clone()
    out = buffer[skip:skip + tensor.numel()].view(tensor.shape)
    out.copy_(tensor)
    return out


class ExpertBiases(torch.nn.Module):
    """One MoE layer's expert biases (`spec.expert_bias`): b1 [experts, 2*ffn] (gate, then up, as w1's rows) and
    b2 [experts, hidden]."""

    def __init__(self, experts: int, hidden: int, ffn: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.b1 = torch.nn.Parameter(torch.empty(experts, 2 * ffn, dtype=dtype))
        self.b2 = torch.nn.Parameter(torch.empty(experts, hidden, dtype=dtype))


def expert_activation(spec: ModelSpec) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The spec's expert activation of [gate | up] rows; None for plain SwiGLU (the experts' default)."""
    if spec.expert_activation == "swiglu":
        return None
    if spec.expert_activation == "clamped_swiglu":
        return functools.partial(clamped_swiglu, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
    if spec.expert_activation == "relu2":
        return relu_squared
    if spec.expert_activation == "limited_swiglu":
        return functools.partial(limited_swiglu, limit=spec.swiglu_limit)
    raise ValueError(f"expert activation {spec.expert_activation!r} must be 'swiglu', 'relu2', 'clamped_swiglu' or "
                     "'limited_swiglu'")


def run_experts(parts: Sequence[ExpertPart], layer: int, attn: AttnOut) -> torch.Tensor:
    """In one process, every (token, slot) row of `attn` through the part holding its expert -> [T, k, hidden].

    Each expert takes its rows slot-major (the tokens that chose it first, then those that chose it second, each
    in token order), the order `transformers`' eager experts give it (`torch.where` over [slot, token]). A GEMM
    may round a row by its position in the product (a row in a partial block of rows runs another kernel on
    some CPUs), so the same rows in another order are equal only to rounding.
    """
    if attn.expert_ids is None:
        raise ValueError(f"layer {layer} is dense; it has no routed experts")
    t, k = attn.expert_ids.shape
    flat_ids = attn.expert_ids.t().reshape(-1)
    token_of_row = torch.arange(t).repeat(k)
    if len(parts) == 1 and len(parts[0].expert_ids) == parts[0].spec.num_experts:
        # One part holds every expert: each token given once, no copies of the rows on the way.
        out = parts[0](layer, attn.tokens, flat_ids, token_index=token_of_row)
    else:
        rows = attn.tokens.index_select(0, token_of_row)
        out = rows.new_empty(rows.shape)
        covered = torch.zeros(t * k, dtype=torch.bool)
        for part in parts:
            idx = (part.owns(flat_ids) & ~covered).nonzero().squeeze(1)
            if idx.numel():
                out[idx] = part(layer, rows[idx], flat_ids[idx])
                covered[idx] = True
        if not bool(covered.all()):
            raise ValueError(f"no expert part holds experts {sorted(set(flat_ids[~covered].tolist()))}")
    return out.view(k, t, -1).transpose(0, 1)


# --- loading ----------------------------------------------------------------------------------------

def load_attention_part(spec: ModelSpec, *, packed: bool = False) -> AttentionPart:
    """An `AttentionPart` with the checkpoint's tensors (only those it holds) or the recipe seed's; `packed`: as
    `AttentionPart`'s."""
    part = AttentionPart(spec, packed=packed)
    if spec.is_checkpoint:
        from mbridge_epoverlap.serving.model.checkpoint import CheckpointReader
        from mbridge_epoverlap.serving.model.hf_layout import attention_sources

        with CheckpointReader(spec) as reader, torch.no_grad():
            for name, source in attention_sources(spec).items():
                part.get_parameter(name).copy_(reader.read(source))
    else:
        _init_attention(part, spec.seed)
    part.prepack()
    return part


def load_expert_part(spec: ModelSpec, expert_ids: Sequence[int], *, packed: bool = False) -> ExpertPart:
    """An `ExpertPart` for `expert_ids`, reading only those experts' tensors (or drawing them from the seed);
    `packed`: as `ExpertPart`'s."""
    part = ExpertPart(spec, expert_ids, packed=packed)
    reader = None
    if spec.is_checkpoint:
        from mbridge_epoverlap.serving.model.checkpoint import CheckpointReader

        reader = CheckpointReader(spec)
    with torch.no_grad():
        for layer in spec.moe_layer_ids:
            experts = part.experts[str(layer)]
            for local, e in enumerate(part.expert_ids):
                weights = None if reader is None else architectures.get(spec.architecture).expert_weights(
                    reader, spec, layer, e)
                if weights is not None:  # an architecture that reads its experts itself (GPT-OSS's fused tensors)
                    experts.w1[local].copy_(weights["w1"])
                    experts.w2[local].copy_(weights["w2"])
                    if part.biases is not None:
                        part.biases[str(layer)].b1[local].copy_(weights["b1"])
                        part.biases[str(layer)].b2[local].copy_(weights["b2"])
                    if part.every_row:
                        part.stored.setdefault(str(layer), []).append(_stored_rows(reader, spec, layer, e))
                elif reader is not None:
                    from mbridge_epoverlap.serving.model.hf_layout import expert_sources

                    up, down = expert_sources(spec, layer, e)
                    experts.w1[local].copy_(reader.read(up))
                    experts.w2[local].copy_(reader.read(down))
                    if str(layer) in part.fp8_scales:
                        part.fp8_scales[str(layer)].fill(local, reader.row_scales(up), reader.row_scales(down))
                    if spec.expert_gate_up_separate and not packed:
                        part.stored.setdefault(str(layer), []).append(_stored_expert(reader, spec, up, down))
                else:
                    key = f"{spec.seed}/layers.{layer}.experts.{e}"
                    experts.w1[local].copy_(seeded_normal(experts.w1.shape[1:], _std(spec.hidden_size), f"{key}.w1"))
                    experts.w2[local].copy_(seeded_normal(experts.w2.shape[1:], _std(spec.expert_ffn), f"{key}.w2"))
    if reader is not None:
        reader.close()
    part.prepack()
    return part


def _stored_rows(reader: Any, spec: ModelSpec, layer: int, expert: int) -> tuple[torch.Tensor, ...]:
    """Expert `expert`'s entry of each fused tensor it is read from (`expert_sources`: [experts, ...] each) as
    `transformers` holds it: in the model dtype, at the address offset of that entry in the file when the file has
    that dtype (else a fresh, aligned conversion)."""
    from mbridge_epoverlap.serving.model.hf_layout import expert_sources

    out = []
    for source in expert_sources(spec, layer, expert):
        name = source.parts[0][0]
        out.append(_as_in_file(reader, spec, name, expert, reader.rows(name, expert, expert + 1)[0]))
    return tuple(out)


def _stored_expert(reader: Any, spec: ModelSpec, up: Any, down: Any) -> tuple[torch.Tensor, ...]:
    """(gate, up, down) of one expert as `transformers` holds them: each [ffn, hidden] in the model dtype, at the
    address offset of its rows in the file when the file has that dtype (else a fresh, aligned conversion)."""
    out = []
    for source, j in ((up, 0), (up, 1), (down, 0)):
        name, span = source.parts[j][0], source.row_ranges()[j]
        rows = reader.get(name) if span is None else reader.rows(name, *span)
        out.append(_as_in_file(reader, spec, name, span[0] if span else 0, rows))
    return tuple(out)


def _as_in_file(reader: Any, spec: ModelSpec, name: str, first_row: int, rows: torch.Tensor) -> torch.Tensor:
    """`rows` of tensor `name` (from row `first_row`) in the model dtype, at the address offset they have in the
    file when the file stores them in that dtype (else a fresh, aligned conversion)."""
    as_stored = rows.dtype == spec.torch_dtype() and not reader.is_fp8(name)
    offset = reader.byte_offset(name, first_row) if as_stored else None
    return _at_file_offset(rows.to(spec.torch_dtype()), offset)


def _std(fan_in: int) -> float:
    """1/sqrt(fan_in): activations keep unit scale, so the random model's logits are far from ties (a
    0.02 init would make every logit nearly equal, and greedy choices would hinge on rounding)."""
    return 1.0 / math.sqrt(fan_in)


def _init_attention(part: AttentionPart, seed: int) -> None:
    with torch.no_grad():
        for name, param in part.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name == "embedding":
                param.copy_(seeded_normal(param.shape, 1.0, f"{seed}/{name}"))
            else:
                param.copy_(seeded_normal(param.shape, _std(param.shape[-1]), f"{seed}/{name}"))


# --- single-process decoding ------------------------------------------------------------------------

class LocalModel:
    """An attention part and expert parts in one process: a whole model step by step."""

    def __init__(self, attention: AttentionPart, experts: Sequence[ExpertPart]) -> None:
        self.attention, self.experts, self.spec = attention, list(experts), attention.spec

    def forward(self, batch: TokenBatch, cache: KVCache) -> torch.Tensor:
        """All layers for the batch -> the last layer's output [T, hidden]."""
        x = self.attention.embed(batch.token_ids)
        for layer in range(self.spec.num_layers):
            attn = self.attention.attention_step(layer, x, batch, cache)
            expert_out = run_experts(self.experts, layer, attn) if attn.expert_ids is not None else None
            x = self.attention.post_step(layer, attn, expert_out)
        return x

    def next_tokens(self, batch: TokenBatch, cache: KVCache) -> dict[int, int]:
        """One step: sequence id -> the greedy token after its last token in the batch."""
        x = self.forward(batch, cache)
        rows, seqs = batch.last_rows()
        return dict(zip(seqs, greedy(self.attention.logits(x[rows])), strict=True))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding: all prompts prefilled in one batch, then one token per sequence per step."""
        check_prompts(self.spec, prompts)
        outputs: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens < 1:
            return outputs
        stop = StopRule(max_new_tokens, self.spec.eos_token_ids)
        cache = KVCache.for_spec(self.spec)
        for seq in range(len(prompts)):
            cache.add(seq)
        batch = TokenBatch.from_chunks([(seq, prompt, 0) for seq, prompt in enumerate(prompts)])
        while len(batch):
            chunks = []
            for seq, token in self.next_tokens(batch, cache).items():
                outputs[seq].append(token)
                if stop.done(outputs[seq]):
                    cache.free(seq)
                else:
                    chunks.append((seq, [token], len(prompts[seq]) + len(outputs[seq]) - 1))
            batch = TokenBatch.from_chunks(chunks)
        return outputs


def check_prompts(spec: ModelSpec, prompts: Sequence[Sequence[int]]) -> None:
    """Every prompt is a non-empty list of token ids below the vocabulary size."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise UsageError(f"prompt {i} is empty; give at least one token id")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < spec.vocab_size]
        if bad:
            raise UsageError(f"prompt {i}: token ids {bad[:5]} are not in [0, {spec.vocab_size}) "
                             f"(the vocabulary of {spec.source})")


def generate_reference(spec: ModelSpec, prompts: list[list[int]], max_new_tokens: int, *,
                       expert_groups: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Single-process greedy decode of `prompts`: the new token ids of each (EOS included when it stops it).

    Args:
        spec: the model.
        prompts: token ids of each prompt.
        max_new_tokens: the most tokens generated per prompt.
        expert_groups: split the experts over several `ExpertPart`s (each id in exactly one group);
            None for one part holding all.
    """
    check_prompts(spec, prompts)
    groups = [list(g) for g in expert_groups] if expert_groups is not None else [list(range(spec.num_experts))]
    placed = sorted(e for g in groups for e in g)
    if placed != list(range(spec.num_experts)):
        raise UsageError(f"expert groups {groups} must hold each of the {spec.num_experts} experts exactly once")
    model = LocalModel(load_attention_part(spec), [load_expert_part(spec, g) for g in groups])
    return model.generate(prompts, max_new_tokens)
