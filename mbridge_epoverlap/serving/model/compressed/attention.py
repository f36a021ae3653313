"""`CompressedAttention`: one DeepSeek-V4 attention layer.

Queries through a bottleneck (`q_a_proj`, a weighted norm, `q_b_proj`, then a weightless norm per head); one key
that is also the value (`kv_proj`, `kv_norm`); the trailing `rope_dim` of each turned by the layer's rope (the
plain one on sliding layers, the compress one where entries are pooled). Each query sees the keys of its last
`sliding_window` positions and, on a pooling layer, the pooled entries of windows that ended at or before it (all
of them on heavily compressed attention; those the lightning indexer chose, at most `index_topk`, on compressed
sparse attention). Each head has a sink logit in its softmax. The output's rotary part turns back by its own
position, then goes through `o_groups` grouped projections to `o_lora_rank` each and `o_b_proj`.

Each sequence attends alone, in the shapes `transformers`' eager attention gives it, for its logits bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mbridge_epoverlap.serving.model.batch import TokenBatch
from mbridge_epoverlap.serving.model.compressed.pool import Pool
from mbridge_epoverlap.serving.model.compressed.rope import angles, fp32_norm, inv_freq, turn, unit_rms
from mbridge_epoverlap.serving.model.compressed.state import CompressedCache, LayerState, PoolState
from mbridge_epoverlap.serving.model.spec import ModelSpec


class Indexer(Pool):
    """The lightning indexer of a compressed sparse attention layer: its own overlapping pool of keys, and per query
    `heads` small queries (from the query bottleneck) and weights (from the input) that score the pooled keys."""

    def __init__(self, spec: ModelSpec, rate: int, dtype: torch.dtype) -> None:
        c = spec.compressed
        assert c is not None
        super().__init__(spec.hidden_size, c.index_head_dim, rate, overlap=True, eps=spec.norm_eps, dtype=dtype)
        self.heads, self.topk = c.index_heads, c.index_topk
        self.q_b_proj = torch.nn.Linear(c.q_lora_rank, c.index_heads * c.index_head_dim, bias=False, dtype=dtype)
        self.weights_proj = torch.nn.Linear(spec.hidden_size, c.index_heads, bias=False, dtype=dtype)

    def choose(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
        """[1, 1, S, count] 0 / -inf: which pooled keys (keys [1, count, head_dim]) each of a sequence's queries (q
        [1, S, heads, head_dim] turned, weights [1, S, heads] fp32, at `positions` [S]) attends to: the best
        `topk` by sum_h w_h relu(q_h . k) / sqrt(head_dim) among the windows ended at or before it."""
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores) * self.head_dim ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        count, k = keys.shape[1], min(self.topk, keys.shape[1])
        if count:
            ready = ((positions + 1) // self.rate).unsqueeze(0).unsqueeze(-1)
            scores = scores.masked_fill(torch.arange(count).view(1, 1, -1) >= ready, float("-inf"))
            top = scores.topk(k, dim=-1).indices
            top = torch.where(top >= ready, torch.full_like(top, -1), top)
        else:
            top = scores.topk(k, dim=-1).indices
        safe = torch.where(top >= 0, top, torch.full_like(top, count))
        bias = keys.new_full((1, 1, positions.numel(), count + 1), float("-inf"))
        return bias.scatter_(-1, safe.unsqueeze(1), 0.0)[..., :count]


class CompressedAttention(torch.nn.Module):
    """Layer `layer`'s attention of a DeepSeek-V4 spec; parameters uninitialised until loaded."""

    def __init__(self, spec: ModelSpec, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = spec.compressed
        assert c is not None
        h, heads, d = spec.hidden_size, spec.num_heads, spec.head_dim
        self.layer, self.heads, self.head_dim, self.eps = layer, heads, d, spec.norm_eps
        self.window, self.groups = c.sliding_window, c.o_groups
        self.q_a_proj = torch.nn.Linear(h, c.q_lora_rank, bias=False, dtype=dtype)
        self.q_a_norm = fp32_norm(c.q_lora_rank, spec.norm_eps)
        self.q_b_proj = torch.nn.Linear(c.q_lora_rank, heads * d, bias=False, dtype=dtype)
        self.kv_proj = torch.nn.Linear(h, d, bias=False, dtype=dtype)
        self.kv_norm = fp32_norm(d, spec.norm_eps)
        self.o_a_proj = torch.nn.Parameter(torch.empty(c.o_groups * c.o_lora_rank, heads * d // c.o_groups,
                                                       dtype=dtype))
        self.o_b_proj = torch.nn.Linear(c.o_groups * c.o_lora_rank, h, bias=False, dtype=dtype)
        self.sinks = torch.nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        rate = c.layer_rates[layer]
        self.compressor = Pool(h, d, rate, overlap=c.indexed[layer], eps=spec.norm_eps,
                               dtype=dtype) if rate else None
        self.indexer = Indexer(spec, rate, dtype) if rate and c.indexed[layer] else None
        compress, self.compress_scale = inv_freq(c.compress_rope_theta, c.rope_dim, c.compress_rope_scaling)
        main, main_scale = inv_freq(c.rope_theta, c.rope_dim, c.rope_scaling)
        self.register_buffer("compress_freqs", compress, persistent=False)
        self.register_buffer("freqs", compress if rate else main, persistent=False)
        self.scale = self.compress_scale if rate else main_scale

    def forward(self, x: torch.Tensor, batch: TokenBatch, cache: CompressedCache) -> torch.Tensor:
        """x [T, hidden] the normalised input of the batch's tokens -> [T, hidden]; each sequence's window and
        pools in `cache` move on by its tokens."""
        cos, sin = angles(batch.positions, self.freqs, x.dtype, self.scale)
        q_low = self.q_a_norm(self.q_a_proj(x))
        q_all, kv_all = self.q_b_proj(q_low), self.kv_norm(self.kv_proj(x))
        pooled = None if self.compressor is None else (self.compressor.kv_proj(x), self.compressor.gate_proj(x))
        index = None
        if self.indexer is not None:
            index = (self.indexer.kv_proj(x), self.indexer.gate_proj(x), self.indexer.q_b_proj(q_low),
                     self.indexer.weights_proj(x).float() * self.indexer.heads ** -0.5)
        out = x.new_empty(x.shape[0], self.heads, self.head_dim)
        for seg in batch.segments:
            r, n = seg.rows, seg.length
            state = cache.layer(seg.seq_id, self.layer)
            c, s = cos[r].unsqueeze(0), sin[r].unsqueeze(0)
            q = turn(unit_rms(q_all[r].view(1, n, self.heads, self.head_dim).transpose(1, 2), self.eps), c, s)
            kv = turn(kv_all[r].view(1, n, 1, self.head_dim).transpose(1, 2), c, s)
            keys, mask = self._window(kv, state, batch.positions[r])
            if self.compressor is not None and pooled is not None:
                entries = self.compressor.extend(pooled[0][r].unsqueeze(0), pooled[1][r].unsqueeze(0),
                                                 state.pools.setdefault("compressor", PoolState()),
                                                 self.compress_freqs, self.compress_scale)
                bias = self._pool_bias(entries, state, batch.positions[r], index, r, c, s)
                keys = torch.cat([keys, entries.unsqueeze(1)], dim=2)
                mask = torch.cat([mask, bias.to(mask.dtype)], dim=-1)
            heads = self._attend(q, keys, mask)
            out[r] = turn(heads.transpose(1, 2), c, -s).transpose(1, 2)[0]
        return self._project_out(out)

    def _window(self, kv: torch.Tensor, state: LayerState, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [1, 1, L, head_dim]: the window's kept keys then the new ones, [1, 1, S, L] 0 / -inf: each query
        sees the keys of its last `window` positions); the state keeps the last window - 1 keys."""
        keys = kv if state.window is None else torch.cat([state.window, kv], dim=-2)
        state.window = keys[:, :, -self.window + 1:, :].clone()  # its own memory, not the prompt's keys
        first = int(positions[0]) - (keys.shape[2] - kv.shape[2])
        back = positions.unsqueeze(1) - torch.arange(first, first + keys.shape[2]).unsqueeze(0)
        mask = torch.zeros(back.shape, dtype=kv.dtype)
        mask = mask.masked_fill((back < 0) | (back >= self.window), float("-inf"))
        return keys, mask.view(1, 1, *back.shape)

    def _pool_bias(self, entries: torch.Tensor, state: LayerState, positions: torch.Tensor,
                   index: tuple[torch.Tensor, ...] | None, r: slice, c: torch.Tensor, s: torch.Tensor
                   ) -> torch.Tensor:
        """[1, 1, S, count] 0 / -inf over the pooled entries: the indexer's choice, or every window ended at or
        before each query."""
        count, n = entries.shape[1], positions.numel()
        if self.indexer is not None and index is not None:
            keys = self.indexer.extend(index[0][r].unsqueeze(0), index[1][r].unsqueeze(0),
                                       state.pools.setdefault("indexer", PoolState()), self.compress_freqs,
                                       self.compress_scale)
            ix = self.indexer
            q = turn(index[2][r].view(1, n, ix.heads, ix.head_dim).transpose(1, 2), c, s).transpose(1, 2)
            return ix.choose(q, index[3][r].unsqueeze(0), keys, positions)
        bias = entries.new_zeros((1, 1, n, count))
        if n == 1 or count == 0:
            return bias
        assert self.compressor is not None
        ready = ((positions + 1) // self.compressor.rate).view(1, 1, n, 1)
        return bias.masked_fill(torch.arange(count).view(1, 1, 1, -1) >= ready, float("-inf"))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eager attention of q [1, heads, S, head_dim] over keys = values [1, 1, L, head_dim] with the mask and
        each head's sink -> [1, S, heads, head_dim]."""
        n, length = q.shape[2], keys.shape[2]
        keys = keys[:, :, None].expand(1, 1, self.heads, length, self.head_dim).reshape(1, self.heads, length, -1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.head_dim ** -0.5
        scores = scores + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(1, -1, n, -1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys).transpose(1, 2).contiguous()

    def _project_out(self, heads: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim] -> [T, hidden]: each group of heads to its `o_lora_rank` block, then `o_b_proj`."""
        t, g = heads.shape[0], self.groups
        grouped = heads.reshape(1, t, g, -1)
        width = grouped.shape[-1]
        w = self.o_a_proj.view(g, -1, width).transpose(1, 2)
        low = torch.bmm(grouped.reshape(-1, g, width).transpose(0, 1), w).transpose(0, 1)
        return self.o_b_proj(low.reshape(1, t, g, -1).flatten(2))[0]
