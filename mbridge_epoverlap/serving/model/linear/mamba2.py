"""Mamba-2, the state-space token mixer of Nemotron-H, with its state in a `StateCache`.

Per token: one projection gives a gate z (heads x head_dim), x, B, C (`n_groups` x `state_size` each, shared by the
heads of a group) and a time step per head; x, B and C pass a causal depthwise convolution (with a bias) and SiLU.
Each head keeps a [head_dim, state_size] state S: a token decays it by exp(dt A) (A = -exp(A_log) < 0, dt =
softplus(raw + dt_bias)), adds dt x B^T, and reads y = S C + D x. The heads' outputs pass an RMSNorm over groups of
channels, gated by SiLU(z) before the norm, then the output projection.

As for the gated DeltaNet (`linear.delta_net`), a prompt or prompt chunk runs the chunked scan (`chunked_scan`:
within blocks of `chunk_size` tokens an attention-like product, across blocks the states), a decode token the one-step
recurrence (`scan_step`), every decoding sequence at once; both follow `transformers`' torch path, op for op. The
engine's workers (`exact` False) project with oneDNN-packed weights, convolve with multiply-adds and update the
decoding sequences' states in place (`_decode_in_place`), equal to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mbridge_epoverlap.moe.wgrad import Linear
from mbridge_epoverlap.serving.model.batch import Segment, TokenBatch
from mbridge_epoverlap.serving.model.linear.conv import prompt_conv, step_conv
from mbridge_epoverlap.serving.model.linear.state_cache import StateCache, states_of
from mbridge_epoverlap.serving.model.spec import Mamba2, ModelSpec


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> [..., T, T]: entry (i, j) the sum of a over (j, i] for j <= i, -inf above the diagonal."""
    t = a.shape[-1]
    grid = a[..., None].expand(*a.shape, t)
    grid = grid.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(-1), 0)
    sums = grid.cumsum(dim=-2)
    return sums.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(0), float("-inf"))


def _time_step(dt: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.softplus(dt + bias.to(dt.dtype))


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 d: torch.Tensor, dt_bias: torch.Tensor, m: Mamba2, state: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """S sequences of L tokens: x [S, L, heads, head_dim], dt [S, L, heads] (before its bias and softplus), a
    [heads] (A, fp32), b and c [S, L, groups, state_size], d [heads], `state` [S, heads, head_dim, state_size] before
    the first token (None: zeros) -> (y [S, L, heads, head_dim] fp32 with the D skip, the states after the last
    tokens, fp32)."""
    batch, length, heads = x.shape[0], x.shape[1], x.shape[2]
    dt = _time_step(dt, dt_bias).clamp(m.time_step_limit[0], m.time_step_limit[1])
    per_group = heads // b.shape[2]
    x = x.float()
    b = b.float().repeat_interleave(per_group, dim=2, output_size=heads)
    c = c.float().repeat_interleave(per_group, dim=2, output_size=heads)
    pad = (m.chunk_size - length % m.chunk_size) % m.chunk_size
    skip = d[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    a = a.to(x.dtype) * dt.float()
    blocks = lambda t: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)).reshape(  # noqa: E731
        batch, -1, m.chunk_size, *t.shape[2:])
    x, a, b, c = blocks(x), blocks(a), blocks(b), blocks(c)  # [S, blocks, l, heads, ...]
    a = a.permute(0, 3, 1, 2)  # [S, heads, blocks, l]
    a_sums = a.cumsum(dim=-1)
    within = torch.exp(_segment_sums(a))  # [S, heads, blocks, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * within.permute(0, 2, 3, 4, 1)
    y_within = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    to_end = torch.exp(a_sums[..., -1:] - a_sums)  # decay from each token to its block's end
    block_states = torch.einsum("bclhn,bclhp->bchpn", b * to_end.permute(0, 2, 3, 1)[..., None], x)
    start = torch.zeros_like(block_states[:, :1]) if state is None else state[:, None].to(block_states.dtype)
    block_states = torch.cat([start, block_states], dim=1)
    across = torch.exp(_segment_sums(F.pad(a_sums[..., -1], (1, 0)))).transpose(1, 3)  # [S, from, to, heads]
    states = torch.einsum("bzch,bzhpn->bchpn", across, block_states)
    states, final = states[:, :-1], states[:, -1]
    y_across = torch.einsum("bclhn,bchpn->bclhp", c, states) * torch.exp(a_sums).permute(0, 2, 3, 1)[..., None]
    y = (y_within + y_across).reshape(batch, -1, heads, x.shape[-1]) + skip
    return y[:, :length], final


def scan_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              c: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: state [B, heads, head_dim, state_size] fp32, x [B, heads, head_dim], dt
    [B, heads], b and c [B, groups, state_size] -> (y [B, heads, head_dim] in x's dtype, the new state)."""
    batch, heads, head_dim = x.shape
    per_group = heads // b.shape[1]
    dt = _time_step(dt, dt_bias)[..., None]  # [B, heads, 1]
    decay = torch.exp(dt.float()[..., None] * a.float()[:, None, None])  # [B, heads, 1, 1] over the state
    b = b[:, :, None].expand(-1, -1, per_group, -1).reshape(batch, heads, 1, -1)
    c = c[:, :, None].expand(-1, -1, per_group, -1).reshape(batch, heads, -1)
    written = (dt[..., None] * b) * x[..., None]  # [B, heads, head_dim, state]
    state = state * decay + written
    y = torch.bmm(state.to(c.dtype).view(batch * heads, head_dim, -1), c.reshape(batch * heads, -1, 1))
    y = y.view(batch, heads, head_dim)
    y = (y + x * d[:, None]).to(y.dtype)
    return y.to(x.dtype), state


class Mamba2Mixer(torch.nn.Module):
    """One Mamba-2 layer's parameters (uninitialised) and its scan over a `StateCache`.

    Parameters: `in_proj.weight` [inner + conv_dim + heads, hidden] (z, then x, B, C, then the time steps;
    + `in_proj_bias` with `Mamba2.proj_bias`), `conv_weight` [conv_dim, 1, kernel] (+ `conv_bias` [conv_dim]),
    `dt_bias`, `A_log`, `D` [heads], `norm.weight` [inner], `out_proj.weight` [hidden, inner] (+ `out_proj_bias`).
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        if spec.mamba is None:
            raise ValueError(f"{spec.source} has no Mamba-2 layers (spec.mamba is None)")
        m: Mamba2 = spec.mamba
        self.m, self.eps = m, spec.norm_eps
        h = spec.hidden_size

        def vector(size: int, present: bool = True) -> torch.nn.Parameter | None:
            return torch.nn.Parameter(torch.empty(size, dtype=dtype)) if present else None

        self.in_proj = Linear(h, m.inner + m.conv_dim + m.num_heads, dtype=dtype)
        self.in_proj_bias = vector(m.inner + m.conv_dim + m.num_heads, m.proj_bias)
        self.conv_weight = torch.nn.Parameter(torch.empty(m.conv_dim, 1, m.conv_kernel, dtype=dtype))
        self.conv_bias = vector(m.conv_dim, m.conv_bias)
        self.dt_bias, self.A_log, self.D = vector(m.num_heads), vector(m.num_heads), vector(m.num_heads)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.empty(m.inner, dtype=dtype))
        self.out_proj = Linear(m.inner, h, dtype=dtype)
        self.out_proj_bias = vector(h, m.proj_bias)
        self.exact = True  # `transformers`' operations (the reference model); the engine's workers set it False
        # oneDNN-packed copies of the two projections (`AttentionPart(packed=True)` sets them, fp32)
        self.packed_in: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.packed_out: Callable[[torch.Tensor], torch.Tensor] | None = None

    def project_out(self, heads_out: torch.Tensor) -> torch.Tensor:
        if self.packed_out is not None:
            out = self.packed_out(heads_out)
            return out if self.out_proj_bias is None else out + self.out_proj_bias
        return F.linear(heads_out, self.out_proj.weight, self.out_proj_bias)

    def _project_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_in is not None:
            out = self.packed_in(x)
            return out if self.in_proj_bias is None else out + self.in_proj_bias
        return F.linear(x, self.in_proj.weight, self.in_proj_bias)

    def mix(self, layer: int, x: torch.Tensor, batch: TokenBatch, cache: Any, angles: Any) -> torch.Tensor:
        """`layers.Attention.mix` for a Mamba-2 layer: each sequence continues from its state in the KV cache's state
        cache (`states_of`); no rotary angles."""
        return self.project_out(self.attend(layer, x, batch, states_of(cache)))

    def attend(self, layer: int, x: torch.Tensor, batch: TokenBatch, states: StateCache) -> torch.Tensor:
        """The layer's scan for the batch's tokens (x [T, hidden], normalised), each sequence continuing from its
        state in `states` (updated) -> [T, inner] in the model dtype, before the output projection."""
        m = self.m
        z, xbc, dt = self._project_in(x).split([m.inner, m.conv_dim, m.num_heads], dim=-1)
        out = x.new_empty(x.shape[0], m.inner)
        steps, prompts = states.split(batch, layer)
        if steps and not self.exact:
            self._decode_in_place(layer, steps, z, xbc, dt, states, out)
        elif steps:
            self._decode(layer, steps, z, xbc, dt, states, out)
        for seg in prompts:
            self._prefill(layer, seg, z, xbc, dt, states, out)
        return out

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, conv_dim] -> x [n, heads, head_dim], B and C [n, groups, state_size]."""
        m = self.m
        xs, b, c = conv.split([m.inner, m.n_groups * m.state_size, m.n_groups * m.state_size], dim=-1)
        n = conv.shape[0]
        return (xs.reshape(n, m.num_heads, m.head_dim), b.reshape(n, m.n_groups, m.state_size),
                c.reshape(n, m.n_groups, m.state_size))

    def _prefill(self, layer: int, seg: Segment, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                 states: StateCache, out: torch.Tensor) -> None:
        rows = states.rows_of([seg.seq_id])
        started = states.fed(seg.seq_id, layer) > 0
        window, state = states.read(layer, rows)
        conv, window = prompt_conv(window[0] if started else None, xbc[seg.rows].t(), self.conv_weight,
                                   self.conv_bias, exact=self.exact)
        xs, b, c = self._split(conv)
        a = -torch.exp(self.A_log.float())
        y, state = chunked_scan(xs[None], dt[seg.rows][None], a, b[None], c[None], self.D, self.dt_bias, self.m,
                                state if started else None)
        # the chunked scan's output stays fp32 into the norm, as in `transformers`
        out[seg.rows] = self._gated_norm(y.reshape(seg.length, -1), z[seg.rows]).to(out.dtype)
        states.write(layer, [seg.seq_id], rows, window[None], state, [seg.length])

    def _decode(self, layer: int, segs: list[Segment], z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                states: StateCache, out: torch.Tensor) -> None:
        seq_ids = [seg.seq_id for seg in segs]
        rows = states.rows_of(seq_ids)
        batch_rows = torch.tensor([seg.rows.start for seg in segs], dtype=torch.int64)
        windows, state = states.read(layer, rows)
        conv, windows = step_conv(windows, xbc.index_select(0, batch_rows), self.conv_weight, self.conv_bias,
                                  exact=self.exact)
        xs, b, c = self._split(conv)
        a = -torch.exp(self.A_log.float())
        y, state = scan_step(state, xs, dt.index_select(0, batch_rows), a, b, c, self.D, self.dt_bias)
        out[batch_rows] = self._gated_norm(y.reshape(len(segs), -1), z.index_select(0, batch_rows))
        states.write(layer, seq_ids, rows, windows, state, [1] * len(segs))

    def _decode_in_place(self, layer: int, segs: list[Segment], z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor,
                         states: StateCache, out: torch.Tensor) -> None:
        """`_decode` for the engine: the windows and states updated where they lie (a view of the cache's rows, in
        row order), the convolution as multiply-adds, the state decayed in place, the token written with one
        batched rank-1 product (dt x) B^T and read with one product S C: three passes over the states where the
        exact step makes a dozen."""
        m = self.m
        batch_rows = torch.tensor([seg.rows.start for seg in segs], dtype=torch.int64)
        step = states.for_update(layer, [seg.seq_id for seg in segs])
        windows, state = step.windows, step.state
        take = batch_rows.index_select(0, step.order)  # the batch rows in the order of the states
        conv, new_windows = step_conv(windows, xbc.index_select(0, take), self.conv_weight, self.conv_bias,
                                      exact=False)
        windows.copy_(new_windows)
        xs, b, c = self._split(conv)
        n, h, p = xs.shape
        per_group = h // m.n_groups
        time_step = _time_step(dt.index_select(0, take), self.dt_bias).float()  # [n, heads]
        a = -torch.exp(self.A_log.float())
        state.mul_(torch.exp(time_step * a)[..., None, None])
        b = b.float().repeat_interleave(per_group, dim=1)  # [n, heads, state]
        c = c.float().repeat_interleave(per_group, dim=1)
        flat = state.view(n * h, p, m.state_size)
        flat.baddbmm_((time_step[..., None] * xs.float()).reshape(n * h, p, 1), b.reshape(n * h, 1, -1))
        y = torch.bmm(flat, c.reshape(n * h, -1, 1)).view(n, h, p) + xs.float() * self.D.float()[:, None]
        out[take] = self._gated_norm(y.to(xs.dtype).reshape(n, -1), z.index_select(0, take))
        step.done()

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y times SiLU(z) in fp32, then an RMSNorm over each group of inner / n_groups channels; the weight applied
        in y's dtype."""
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        groups = h.view(h.shape[0], self.m.n_groups, -1)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.weight * groups.view(h.shape).to(dtype)
