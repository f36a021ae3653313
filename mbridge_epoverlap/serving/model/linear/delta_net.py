"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5-MoE, with its state in a `StateCache`.

Per token: q, k (`num_key_heads` x `key_head_dim`), v and an output gate z (`num_value_heads` x `value_head_dim`)
from one projection, a write strength beta = sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias) (log
space) per value head from another; q, k and v pass a causal depthwise convolution with SiLU. Each value head keeps
a [key_head_dim, value_head_dim] state S; a token decays it by exp(g), writes beta * (v - S^T k) along k (the
delta rule: only what S does not already predict) and reads q (L2-normalised like k, scaled by 1/sqrt(dk)) from
the result. The heads' outputs pass an RMSNorm gated by SiLU(z), then the output projection.

Two forms compute the same recurrence, as `transformers`' torch path does (the reference this module follows op
for op, in the same order): a prompt (or a chunk of one, or a one-token prompt) goes through the chunked form
(`chunked_delta_rule`: blocks of 64 tokens, within a block a triangular solve, across blocks the state), a decode
token through the one-step recurrence (`delta_rule_step`), every decoding sequence of a batch at once.

The engine's workers (`exact` False) run the same arithmetic arranged for speed, rounded differently in the last
bits as their packed GEMMs are: the depthwise convolution as K multiply-adds in fp32 (`linear.conv`), and
the decode step reading each state once (q and k against it in one product), then decaying and updating it in
place with one batched rank-1 product, on a view of the state cache's rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.wgrad import Linear
from mbridge_epoverlap.serving.model.batch import Segment, TokenBatch
from mbridge_epoverlap.serving.model.linear.conv import prompt_conv, step_conv
from mbridge_epoverlap.serving.model.linear.state_cache import StateCache, states_of
from mbridge_epoverlap.serving.model.spec import GatedDeltaNet, ModelSpec

CHUNK = 64  # the chunked form's block, `transformers`' and FLA's default
L2_EPS = 1e-6


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x scaled to unit L2 norm over its last dimension (with `L2_EPS` under the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """[B, L, heads, ...] inputs -> fp32 [B, heads, L, ...], the key heads repeated to the value heads."""
    repeat = v.shape[2] // k.shape[2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    return tuple(t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                 for t in (q, k, v, beta, g))


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor | None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over L tokens in blocks of `chunk`.

    Args:
        q, k: [B, L, key heads, dk]; v: [B, L, value heads, dv]; g, beta: [B, L, value heads].
        state: [B, value heads, dk, dv] the state before the first token (None: zeros).

    Returns:
        (outputs [B, L, value heads, dv] in v's dtype, the state after the last token, fp32).
    """
    dtype, length = v.dtype, v.shape[1]
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    q, k = _unit(q), _unit(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    blocks = lambda t: t.reshape(t.shape[0], t.shape[1], -1, chunk, t.shape[-1])  # noqa: E731
    q, k, k_beta, v_beta = blocks(q), blocks(k), blocks(k_beta), blocks(v_beta)
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)
    decay = g.cumsum(dim=3)  # log of the decay from a block's start to each of its tokens
    later = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    # between[i, j]: the decay from token j to token i of a block (0 where j is after i)
    between = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * between
    within = (q @ k.transpose(-1, -2)) * between
    decayed_k_beta = k_beta * decay.exp().unsqueeze(-1)
    # the block's delta-rule writes solved at once (a unit lower-triangular system): the values each token writes
    # before the state's prediction is removed, and the keys through which the state before the block is read
    writes = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = (torch.zeros(v.shape[0], v.shape[1], k.shape[-1], v.shape[-1], dtype=writes.dtype) if state is None
         else state.to(writes))
    out = torch.zeros_like(writes)
    q = q * decay.exp().unsqueeze(-1)
    k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    block_decay = decay[..., -1].exp()[..., None, None]
    for i in range(writes.shape[2]):
        correction = writes[:, :, i] - reads[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + within[:, :, i] @ correction
        s = s * block_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ correction
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, 1, key heads, dk], v [B, 1, value heads, dv], g and beta
    [B, 1, value heads], state [B, value heads, dk, dv] -> (outputs [B, 1, value heads, dv], the new state)."""
    dtype = v.dtype
    q, k, v, beta, g = _heads_first(q, k, v, g, beta)
    q, k = _unit(q), _unit(k)
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v)
    q, k, v, beta, g = q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], g[:, :, 0]
    s = s * g.exp()[..., None, None]
    predicted = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(dim=-2)
    return out.unsqueeze(2).transpose(1, 2).contiguous().to(dtype), s


class GatedDeltaNetAttention(torch.nn.Module):
    """One gated DeltaNet layer's parameters (uninitialised) and its attention over a `StateCache`.

    Parameters: `in_proj_qkvz.weight` [2 * key_dim + 2 * value_dim, hidden] (`GatedDeltaNet.grouped`: per key head
    its q, its k, then the v and z of the value heads it serves; else all q, all k, all v, all z), `in_proj_ba.weight`
    [2 * value heads, hidden] (grouped: per key head b, then a, of its value heads; else all b, all a),
    `conv_weight` [conv_dim, 1, kernel], `dt_bias` and `A_log` [value heads], `norm.weight` [value_head_dim],
    `out_proj.weight` [hidden, value_dim].
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        if spec.linear_attention is None:
            raise ValueError(f"{spec.source} has no linear attention (spec.linear_attention is None)")
        la: GatedDeltaNet = spec.linear_attention
        self.la, self.eps = la, spec.norm_eps
        h = spec.hidden_size
        self.in_proj_qkvz = Linear(h, 2 * la.key_dim + 2 * la.value_dim, dtype=dtype)
        self.in_proj_ba = Linear(h, 2 * la.num_value_heads, dtype=dtype)
        self.conv_weight = torch.nn.Parameter(torch.empty(la.conv_dim, 1, la.conv_kernel, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.empty(la.num_value_heads, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(la.num_value_heads, dtype=dtype))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.empty(la.value_head_dim, dtype=dtype))
        self.out_proj = Linear(la.value_dim, h, dtype=dtype)
        # `transformers`' operations in its order (the reference model); the engine's workers set it False
        self.exact = True

    def project_out(self, heads_out: torch.Tensor) -> torch.Tensor:
        return F.linear(heads_out, self.out_proj.weight)

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> (q, k, v side by side [T, conv_dim], z [T, value heads, dv], b, a [T, value heads])."""
        la, t = self.la, x.shape[0]
        if not la.grouped:  # Qwen3.5: q, k, v | z | b | a, each its own GEMM as the checkpoint's projections are
            qkv_w, z_w = self.in_proj_qkvz.weight.split([la.conv_dim, la.value_dim])
            b_w, a_w = self.in_proj_ba.weight.chunk(2)
            z = F.linear(x, z_w).view(t, la.num_value_heads, la.value_head_dim)
            return F.linear(x, qkv_w), z, F.linear(x, b_w), F.linear(x, a_w)
        per_key = la.num_value_heads // la.num_key_heads
        qkvz = F.linear(x, self.in_proj_qkvz.weight).view(t, la.num_key_heads, -1)
        ba = F.linear(x, self.in_proj_ba.weight).view(t, la.num_key_heads, -1)
        q, k, v, z = qkvz.split([la.key_head_dim, la.key_head_dim, per_key * la.value_head_dim,
                                 per_key * la.value_head_dim], dim=2)
        b, a = ba.split([per_key, per_key], dim=2)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return (mixed, z.reshape(t, la.num_value_heads, la.value_head_dim), b.reshape(t, -1), a.reshape(t, -1))

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., L, conv_dim] -> q, k [..., L, key heads, dk], v [..., L, value heads, dv]."""
        la = self.la
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        lead = mixed.shape[:-1]
        keys = (*lead, la.num_key_heads, la.key_head_dim)
        return q.reshape(keys), k.reshape(keys), v.reshape(*lead, la.num_value_heads, la.value_head_dim)

    def mix(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: Any, angles: Any) -> torch.Tensor:
        """`layers.Attention.mix` for a DeltaNet layer: each sequence continues from its state in the KV cache's state
        cache (`states_of`); no rotary angles."""
        return self.project_out(self.attend(layer, x, batch, states_of(cache)))

    def attend(self, layer: int, x: torch.Tensor, batch: TokenBatch, states: StateCache) -> torch.Tensor:
        """The layer's linear attention for the batch's tokens (x [T, hidden], normalised), each sequence continuing
        from its state in `states` (updated) -> [T, value_dim], before the output projection."""
        mixed, z, b, a = self._inputs(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        heads = mixed.new_empty(x.shape[0], self.la.num_value_heads, self.la.value_head_dim)
        steps, prompts = states.split(batch, layer)
        if steps and not self.exact:
            self._decode_in_place(layer, steps, mixed, g, beta, states, heads)
        elif steps:
            self._decode(layer, steps, mixed, g, beta, states, heads)
        for seg in prompts:
            self._prefill(layer, seg, mixed, g, beta, states, heads)
        return self._gated_norm(heads, z).reshape(x.shape[0], -1)

    def _prefill(self, layer: int, seg: Segment, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: StateCache, heads: torch.Tensor) -> None:
        rows = states.rows_of([seg.seq_id])
        started = states.fed(seg.seq_id, layer) > 0
        window, state = states.read(layer, rows)
        conv_out, window = prompt_conv(window[0] if started else None, mixed[seg.rows].t(), self.conv_weight, None,
                                       exact=self.exact)
        q, k, v = self._split_heads(conv_out[None])
        out, state = chunked_delta_rule(q, k, v, g[seg.rows][None], beta[seg.rows][None],
                                        state if started else None)
        heads[seg.rows] = out[0]
        states.write(layer, [seg.seq_id], rows, window[None], state, [seg.length])

    def _decode(self, layer: int, segs: list[Segment], mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                states: StateCache, heads: torch.Tensor) -> None:
        """One token of each of `segs`' sequences, together: the convolution over each window and the token, then
        one step of the recurrence."""
        seq_ids = [seg.seq_id for seg in segs]
        rows = states.rows_of(seq_ids)
        batch_rows = torch.tensor([seg.rows.start for seg in segs], dtype=torch.int64)
        windows, state = states.read(layer, rows)
        conv, windows = step_conv(windows, mixed.index_select(0, batch_rows), self.conv_weight, None, exact=True)
        q, k, v = self._split_heads(conv[:, None])
        out, state = delta_rule_step(q, k, v, g.index_select(0, batch_rows)[:, None],
                                     beta.index_select(0, batch_rows)[:, None], state)
        heads[batch_rows] = out[:, 0]
        states.write(layer, seq_ids, rows, windows, state, [1] * len(segs))

    def _decode_in_place(self, layer: int, segs: list[Segment], mixed: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, states: StateCache, heads: torch.Tensor) -> None:
        """`_decode` for the engine: the sequences' windows and states updated where they lie (a view of the cache's
        rows, taken in row order), the convolution as multiply-adds and the state read once.

        With S the state, e = exp(g), the token's delta d = beta (v - e S^T k) and the new state e S + k d^T, the
        output q^T (e S + k d^T) is e q^T S + (q . k) d: both reads of S come from one product [q; k]^T S."""
        la = self.la
        batch_rows = torch.tensor([seg.rows.start for seg in segs], dtype=torch.int64)
        step = states.for_update(layer, [seg.seq_id for seg in segs])
        windows, state = step.windows, step.state
        take = batch_rows.index_select(0, step.order)  # the batch rows in the order of the states
        conv, new_windows = step_conv(windows, mixed.index_select(0, take), self.conv_weight, None, exact=False)
        windows.copy_(new_windows)
        q, k, v = self._split_heads(conv)
        q, k, v, b, decay = _heads_first(q[:, None], k[:, None], v[:, None], g.index_select(0, take)[:, None],
                                         beta.index_select(0, take)[:, None])
        q, k, v, b, decay = _unit(q)[:, :, 0], _unit(k)[:, :, 0], v[:, :, 0], b[:, :, 0], decay[:, :, 0]
        q = q / (q.shape[-1] ** 0.5)
        n, h = q.shape[0], q.shape[1]
        read = torch.matmul(torch.stack([q, k], dim=2), state)  # [n, heads, 2, dv]: q^T S and k^T S
        e = decay.exp().unsqueeze(-1)
        delta = (v - e * read[:, :, 1]) * b.unsqueeze(-1)
        out = e * read[:, :, 0] + (q * k).sum(-1, keepdim=True) * delta
        state.mul_(e.unsqueeze(-1))
        state.view(n * h, la.key_head_dim, la.value_head_dim).baddbmm_(k.reshape(n * h, -1, 1),
                                                                      delta.reshape(n * h, 1, -1))
        heads[take] = out.to(heads.dtype)
        step.done()

    def _gated_norm(self, heads: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output (the weight applied in the model dtype), times SiLU(z) in fp32."""
        dtype = heads.dtype
        h = heads.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)
