"""`KVCache`: the keys and values of every layer for each sequence being decoded, and the attention over them.

Storage per layer is one [rows, kv_heads, capacity, head_dim] tensor for keys and one for values, a row
per sequence. Appending a decode token is a copy into place (the capacity doubles when a sequence
outgrows it, the rows when more sequences arrive), and a decode batch's history is read for every
sequence at once (`append_decode`), so attention over a batch of decode tokens is a few batched ops
rather than a loop over sequences.

Decode attention is this module's: `KVCache.attend` stores a layer's new keys and values and attends the
batch's queries to each sequence's history, the decode tokens together (`decode_attention`) and a
prompt or a lone decode token on its own (`cached_attention`). The attention module projects in and out
(`serving.model.layers.Attention.mix`) and calls `attend` between the two; every kind of mixer has that `mix`
(latent attention over `LatentKVCache`, the state layers over `KVCache.states`), which `AttentionPart` calls alike.

Two decode attentions: `decode_attention` (the default, and the reference model's) is bit for bit each
sequence's own attention, so it runs one product per sequence; the engine's workers build their caches with
`exact_decode=False` and run `padded_decode_attention`, the whole batch padded to its longest history in two
batched products, 3-4x faster at 32 sequences and rounded differently in the last bits (as the packed expert
GEMMs are). The same caches attend the prompts (and prompt chunks) of one length at one position together, in one
`scaled_dot_product_attention` call (`prompt_attention`), where the exact one runs each prompt's eager products.
`MBRIDGE_EPOVERLAP_EXACT_ATTENTION=1` gives the workers the exact ones.

A multi-head latent attention model (DeepSeek-V3) gets a `LatentKVCache` (`KVCache.for_spec` picks it): per token
and layer its normalised latent and rotated rotary key, nothing per head, attended exactly
(`exact_latent_attention`: per-head keys and values rebuilt, `transformers`' products) or, in the workers' decode
batches, with the up-projections absorbed (`absorbed_decode_attention`; MBRIDGE_EPOVERLAP_MLA_ABSORB=0 or
MBRIDGE_EPOVERLAP_EXACT_ATTENTION=1: exact). Its projections are `layers.MultiLatentAttention`'s.

Every attention here takes GPT-OSS's attention sinks (`sinks`: a logit per head that joins the softmax and is
dropped after it), a sliding window and Llama 4's attention chunks (`chunk`: a query sees only the keys of its own
chunk of positions).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from mbridge_epoverlap.serving.model.batch import AttentionGroups, PromptGroup, TokenBatch
from mbridge_epoverlap.serving.model.compressed.state import CompressedCache, pooled_bytes_per_token
from mbridge_epoverlap.serving.model.latent.indexer import IndexQueries, exact_selection, padded_selection
from mbridge_epoverlap.serving.model.linear.state_cache import StateCache
from mbridge_epoverlap.serving.model.spec import LatentAttention, ModelSpec

_INITIAL_CAPACITY = 64
EXACT_ATTENTION_ENV = "MBRIDGE_EPOVERLAP_EXACT_ATTENTION"
_INITIAL_ROWS = 8


def exact_attention_asked() -> bool:
    """Whether MBRIDGE_EPOVERLAP_EXACT_ATTENTION=1 asks the engine's workers for the reference model's attention
    arithmetic (the KV caches' exact decode, the state layers' `transformers` operations)."""
    return os.environ.get(EXACT_ATTENTION_ENV, "0") == "1"


class KVCache:
    """Per-sequence key/value storage.

    Args:
        num_layers, num_kv_heads, head_dim: shapes of the model.
        dtype, device: of the stored keys and values.
        exact_decode: decode tokens and prompts attend bit for bit as each sequence alone (`decode_attention`,
            `cached_attention`); False: the decode tokens as one padded batch (`padded_decode_attention`) and the
            prompts of one length at one position together (`prompt_attention`): the engine's workers.
    """

    memory_role: ClassVar[str] = "kv_cache"  # what `memory.resident_bytes` counts its tensors as

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, exact_decode: bool = True) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device, self.exact_decode = dtype, device, exact_decode
        shape = (_INITIAL_ROWS, num_kv_heads, _INITIAL_CAPACITY, head_dim)
        self._keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._row: dict[int, int] = {}  # seq_id -> its row
        self._free_rows: list[int] = list(range(_INITIAL_ROWS))  # a heap: the lowest free row is taken first
        self._lengths: dict[int, list[int]] = {}
        # A hybrid model's DeltaNet or Mamba-2 states (`linear.state_cache.StateCache`), added and freed with the
        # sequences here; its layers' key and value buffers stay at their first small size, never written.
        self.states: StateCache | None = None
        # DeepSeek-V4's windows and pooled entries (`compressed.state.CompressedCache`), added and freed likewise
        self.compressed: CompressedCache | None = None

    @classmethod
    def for_spec(cls, spec: ModelSpec, device: torch.device | None = None, *, exact_decode: bool = True) -> KVCache:
        if spec.mla is not None:  # DeepSeek-V3: a cache of latents, not of per-head keys and values
            return LatentKVCache.for_spec(spec, device, exact_decode=exact_decode)
        cache = cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=spec.torch_dtype(), device=device,
                    exact_decode=exact_decode)
        if spec.state_layer_ids:
            cache.states = StateCache(spec, device=device)
        if spec.compressed is not None:
            cache.compressed = CompressedCache(spec)
        return cache

    @classmethod
    def for_engine(cls, spec: ModelSpec) -> KVCache:
        """A cache for an engine worker: padded batched decode attention, unless
        MBRIDGE_EPOVERLAP_EXACT_ATTENTION=1 asks for the exact one."""
        if spec.mla is not None:
            return LatentKVCache.for_engine(spec)
        return cls.for_spec(spec, exact_decode=exact_attention_asked())

    def add(self, seq_id: int) -> None:
        """Start an empty cache for a new sequence."""
        if seq_id in self._row:
            raise ValueError(f"sequence {seq_id} is already in the KV cache")
        if not self._free_rows:
            rows = self._keys[0].shape[0]
            self._resize(rows=2 * rows)
            self._free_rows = list(range(rows, 2 * rows))
        # Lowest row first: sequences admitted together get consecutive rows, which `append_decode` reads as
        # a view instead of a copy.
        self._row[seq_id] = heapq.heappop(self._free_rows)
        self._lengths[seq_id] = [0] * self.num_layers
        if self.states is not None:
            self.states.add(seq_id)
        if self.compressed is not None:
            self.compressed.add(seq_id)

    def empty_like(self) -> KVCache:
        """A new, empty cache of the same shapes."""
        cache = KVCache(self.num_layers, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device,
                        exact_decode=self.exact_decode)
        cache.states = None if self.states is None else self.states.empty_like()
        cache.compressed = None if self.compressed is None else self.compressed.empty_like()
        return cache

    def free(self, seq_id: int) -> None:
        """Drop a finished sequence's keys and values.

        The sequence in the highest row moves into the freed row (its cached positions copied, every layer), so
        the live rows stay 0..n-1 and a decode batch of all of them reads its history as one view of the
        buffers (`append_decode`) instead of gathering a copy at every layer of every step: a move copies one
        sequence once, the gather copied every sequence twice a layer (8 MB a step at 13 sequences of 130 tokens
        in a 4-layer Mixtral online, 1.8 ms of a 33 ms step, AMD EPYC, one thread).
        """
        if seq_id not in self._row:
            raise KeyError(f"sequence {seq_id} is not in the KV cache")
        row = self._row.pop(seq_id)
        del self._lengths[seq_id]
        if self.states is not None:
            self.states.free(seq_id)
        if self.compressed is not None:
            self.compressed.free(seq_id)
        last = max(self._row.values(), default=-1)
        if last > row:
            mover = next(seq for seq, r in self._row.items() if r == last)
            for layer, filled in enumerate(self._lengths[mover]):
                for store in self._stores():
                    store[layer][row, :, :filled] = store[layer][last, :, :filled]
            self._row[mover] = row
            row = last
        heapq.heappush(self._free_rows, row)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row

    def seq_ids(self) -> list[int]:
        return list(self._row)

    def length(self, seq_id: int, layer: int = 0) -> int:
        """Positions cached for `seq_id` in `layer`."""
        return self._lengths[seq_id][layer]

    def rows(self, seq_id: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of positions start..end-1 of `seq_id`, per layer (keys, values) each [kv_heads, end - start,
        head_dim] (a latent cache: latents and rotary keys): what `PrefixCache` keeps of a prompt's block."""
        row = self._row[seq_id]
        if end > min(self._lengths[seq_id]):
            raise ValueError(f"sequence {seq_id} holds {min(self._lengths[seq_id])} positions, not {end}")
        return [(self._keys[layer][row, :, start:end].clone(), self._values[layer][row, :, start:end].clone())
                for layer in range(self.num_layers)]

    def load(self, seq_id: int, blocks: Sequence[list[tuple[torch.Tensor, torch.Tensor]]]) -> int:
        """Fill an empty sequence's first positions with `blocks` (each as `rows` gave it), in order; return the
        positions filled. Its next tokens then attend to them as to its own."""
        row = self._row[seq_id]
        if any(self._lengths[seq_id]):
            raise ValueError(f"sequence {seq_id} is not empty: a prefix goes first")
        end = sum(block[0][0].shape[1] for block in blocks)
        for layer in range(self.num_layers):
            self._fit(layer, end)
            start = 0
            for block in blocks:
                keys, values = block[layer]
                size = keys.shape[1]
                self._keys[layer][row, :, start:start + size] = keys
                self._values[layer][row, :, start:start + size] = values
                start += size
            self._lengths[seq_id][layer] = end
        return end

    def append(self, layer: int, seq_id: int, start: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [n, kv_heads, head_dim] at positions start..start+n-1 of `layer`.

        Returns:
            All keys and values of the sequence so far, each [positions, kv_heads, head_dim].

        Raises:
            KeyError: unknown sequence. ValueError: `start` is not the next free position.
        """
        row = self._check(layer, seq_id, start)
        end = start + keys.shape[0]
        self._fit(layer, end)
        k_buf, v_buf = self._keys[layer], self._values[layer]
        k_buf[row, :, start:end] = keys.transpose(0, 1)
        v_buf[row, :, start:end] = values.transpose(0, 1)
        self._lengths[seq_id][layer] = end
        return k_buf[row, :, :end].transpose(0, 1), v_buf[row, :, :end].transpose(0, 1)

    def append_decode(self, layer: int, seq_ids: Sequence[int], starts: Sequence[int], keys: torch.Tensor,
                      values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store one new token per sequence (keys/values [B, kv_heads, head_dim], token b of `seq_ids[b]` at
        position `starts[b]`) and return every sequence's history at once.

        Returns:
            (keys, values) each [B, kv_heads, longest, head_dim], entry i valid in its first `lengths[i]`
            positions (the rest is padding), `lengths` [B] int64, and `order`: None when entry i is batch
            sequence i, else the batch position of each entry (the rows of a whole batch are a contiguous range
            of the buffers in another order: read in place, in row order, rather than copied into batch order).
        """
        rows = [self._check(layer, seq_id, start) for seq_id, start in zip(seq_ids, starts, strict=True)]
        longest = max(starts) + 1
        self._fit(layer, longest)
        row_index = torch.tensor(rows, dtype=torch.int64)
        position = torch.tensor(starts, dtype=torch.int64)
        k_buf, v_buf = self._keys[layer], self._values[layer]
        k_buf[row_index, :, position] = keys
        v_buf[row_index, :, position] = values
        for seq_id, start in zip(seq_ids, starts, strict=True):
            self._lengths[seq_id][layer] = start + 1
        order = None
        low = min(rows)
        if _is_range(rows) and rows != list(range(low, low + len(rows))):  # a view of the rows, in row order
            order = torch.empty(len(rows), dtype=torch.int64)
            order[row_index - low] = torch.arange(len(rows))
            position = position[order]
        return _history(k_buf, rows, longest), _history(v_buf, rows, longest), position + 1, order

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: TokenBatch, *,
               sliding_window: int | None = None, sinks: torch.Tensor | None = None,
               chunk: int | None = None) -> torch.Tensor:
        """Store the batch's keys and values for `layer` and attend each token's query to its sequence so far.

        Decode tokens (one per sequence) attend as one batch; a prompt (several tokens), or a lone decode
        token, on its own (`TokenBatch.attention_groups`).

        Args:
            layer: 0-based layer index.
            q: [T, heads, head_dim] queries (rotated), rows in batch order.
            k, v: [T, kv_heads, head_dim] the tokens' keys (rotated) and values.
            batch: the tokens' sequence ids and positions; each sequence's tokens start at its cached length.
            sliding_window: a key is visible when q_pos - k_pos < sliding_window (None: all earlier keys).
            sinks: [heads] per-head logits that join each softmax (`cached_attention`), or None.
            chunk: a key is visible when its position and the query's are in one chunk of `chunk` positions
                (Llama 4's chunked attention; None: no chunks).

        Returns:
            [T, heads * head_dim].
        """
        heads = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
        groups = batch.attention_groups
        if groups.decode:
            rows = groups.decode_rows
            keys, values, lengths, order = self.append_decode(layer, groups.decode_seq_ids, groups.decode_starts,
                                                              k[rows], v[rows])
            attention = decode_attention if self.exact_decode else padded_decode_attention
            rows = _in_order(rows, order)
            heads[rows] = attention(q[rows], keys, values, lengths, sliding_window=sliding_window, sinks=sinks,
                                    chunk=chunk)
        alone = groups.alone
        if not self.exact_decode and sliding_window is None and sinks is None:
            self._attend_prompts(layer, q, k, v, batch.prompt_groups, heads, chunk)
            alone = tuple(seg for seg in alone if seg.length == 1)  # a lone decode token
        for seg in alone:
            keys, values = self.append(layer, seg.seq_id, seg.start, k[seg.rows], v[seg.rows])
            heads[seg.rows] = cached_attention(q[seg.rows], keys, values, batch.positions[seg.rows],
                                               sliding_window=sliding_window, sinks=sinks, chunk=chunk)
        return heads

    def _attend_prompts(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        groups: Sequence[PromptGroup], heads: torch.Tensor, chunk: int | None = None) -> None:
        """Store the keys and values of each group's prompts and attend them in one `prompt_attention` call a group,
        into `heads` (`chunk`: as `attend`'s).

        A burst's prompts are mostly of one length: 32 prompts of 64 tokens of the 57M Mixtral (8 heads in 4
        groups) take one call a layer instead of 32 rounds of eager products (a repeated copy of the keys, the
        scores, a mask, a softmax, a product): 6.2 against 8.3 ms a layer alone, one thread, AMD EPYC.
        """
        kv_groups, d = k.shape[1], k.shape[2]
        for start, n, segs, rows in groups:
            end, count = start + n, len(segs)
            row_index = torch.tensor([self._check(layer, seg.seq_id, start) for seg in segs], dtype=torch.int64)
            self._fit(layer, end)
            keys = k[rows].view(count, n, kv_groups, d).transpose(1, 2)  # [prompts, groups, n, d]
            values = v[rows].view(count, n, kv_groups, d).transpose(1, 2)
            k_buf, v_buf = self._keys[layer], self._values[layer]
            k_buf[row_index, :, start:end] = keys
            v_buf[row_index, :, start:end] = values
            for seg in segs:
                self._lengths[seg.seq_id][layer] = end
            if start:  # chunks after the first: the history from the cache
                keys, values = k_buf[row_index, :, :end], v_buf[row_index, :, :end]
            queries = q[rows].view(count, n, q.shape[1], d).transpose(1, 2)
            heads[rows] = prompt_attention(queries, keys, values, start, chunk).transpose(1, 2).reshape(count * n, -1)

    def _check(self, layer: int, seq_id: int, start: int) -> int:
        if seq_id not in self._row:
            raise KeyError(f"sequence {seq_id} is not in the KV cache (add it first)")
        filled = self._lengths[seq_id][layer]
        if start != filled:
            raise ValueError(f"sequence {seq_id} layer {layer}: tokens start at position {start} but the cache "
                             f"holds {filled} positions")
        return self._row[seq_id]

    def _fit(self, layer: int, end: int) -> None:
        """Room for `end` positions in `layer` (the capacity at least doubles, so growing is amortised)."""
        capacity = self._keys[layer].shape[2]
        if end > capacity:
            self._resize(layer=layer, capacity=max(end, 2 * capacity))

    def _stores(self) -> tuple[list[torch.Tensor], ...]:
        """The per-layer buffers of [rows, heads, capacity, width] that grow, and move with a sequence, together."""
        return self._keys, self._values

    def _resize(self, *, rows: int | None = None, layer: int | None = None, capacity: int | None = None) -> None:
        for index in range(self.num_layers) if layer is None else (layer,):
            for store in self._stores():
                old = store[index]
                new = old.new_zeros(rows or old.shape[0], old.shape[1], capacity or old.shape[2], old.shape[3])
                new[:old.shape[0], :, :old.shape[2]] = old
                store[index] = new


def _is_range(rows: Sequence[int]) -> bool:
    """Whether the cache rows are one contiguous range (`KVCache.free` keeps the live rows so)."""
    return max(rows) - min(rows) + 1 == len(rows)


def _history(buffer: torch.Tensor, rows: Sequence[int], longest: int) -> torch.Tensor:
    """The first `longest` positions of the cache rows `rows` of a [rows, heads, capacity, width] buffer: a view in
    row order where the rows are a range (`append_decode` says that order), else a copy in `rows`' order.
    index_select of the filled positions copies whole rows; advanced indexing is about twice as slow here."""
    if _is_range(rows):
        return buffer[min(rows):min(rows) + len(rows), :, :longest]
    return buffer[:, :, :longest].index_select(0, torch.tensor(rows, dtype=torch.int64))


def _in_order(rows: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """The batch rows of a decode group in the order `append_decode` returned their histories."""
    return rows if order is None else rows[order]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, *,
                     sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                     chunk: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new queries to all its keys so far.

    Eager arithmetic in the order Hugging Face's eager attention uses (scores = q k^T * scale, masked
    entries excluded, fp32 softmax, weights @ v), so a decode step reproduces its logits. With a sliding window
    the keys no query can see are left out (a decode token reads its last `sliding_window` keys, as
    `transformers`' sliding-window cache holds them). With `sinks` (GPT-OSS) each head's sink logit is appended
    to its scores, the row's maximum subtracted, a softmax taken in the scores' dtype and the sink's column
    dropped, as `transformers`' GPT-OSS eager attention does. With a `chunk` (Llama 4) a query sees the keys of its
    own chunk of positions; the keys read are those a sliding window of `chunk` reads, masked to the chunk, as
    `transformers`' chunked cache holds them (its last `chunk` keys at a decode token), so the softmax runs over
    the same row.

    Args:
        q: [n, heads, head_dim] queries (rotated) of the tokens at `q_positions`.
        k, v: [m, groups, head_dim] keys (rotated) and values at positions 0..m-1 (the cache, new tokens
            included).
        q_positions: [n] int64 positions of the queries (each < m).
        sliding_window: a key is visible when q_pos - k_pos < sliding_window (None: all earlier keys).
        sinks: [heads] per-head logits that join the softmax (None: none).
        chunk: a key is visible when floor(k_pos / chunk) == floor(q_pos / chunk) (None: no chunks).

    Returns:
        [n, heads * head_dim].
    """
    n, heads, d = q.shape
    groups = k.shape[1]
    rep = heads // groups
    first = 0
    reach = min((w for w in (sliding_window, chunk) if w is not None), default=None)
    if reach is not None:
        first = max(0, int(q_positions.min()) - reach + 1)
        k, v = k[first:], v[first:]
    keys, values = _repeat_groups(k, rep), _repeat_groups(v, rep)
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * (d ** -0.5)
    k_positions = torch.arange(first, first + k.shape[0], device=q.device)
    hidden = k_positions[None, :] > q_positions[:, None]
    if sliding_window is not None:
        hidden |= q_positions[:, None] - k_positions[None, :] >= sliding_window
    if chunk is not None:
        hidden |= q_positions[:, None] // chunk != k_positions[None, :] // chunk
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        weights = _softmax_with_sinks(scores, sinks.reshape(heads, 1, 1).expand(heads, n, 1)).to(q.dtype)
    out = torch.matmul(weights, values)  # [heads, n, d]
    return out.transpose(0, 1).reshape(n, heads * d)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                     chunk: int | None = None) -> torch.Tensor:
    """Causal attention of several sequences' queries at positions start..start+n-1 to their keys at 0..start+n-1:
    `cached_attention`'s result for each (the scaled scores, the later keys masked, a softmax, the product with the
    values) in one `scaled_dot_product_attention` call, rounded differently in the last bits.

    Args:
        q: [B, heads, n, head_dim] queries (rotated). k, v: [B, groups, start + n, head_dim] keys (rotated) and
            values; a query head h reads group h // (heads // groups).
        start: the position of the first query.
        chunk: a key is visible only in the query's chunk of `chunk` positions (None: no chunks).

    Returns:
        [B, heads, n, head_dim].
    """
    n, m = q.shape[2], k.shape[2]
    mask = None
    if start or chunk is not None:
        k_positions = torch.arange(m, device=q.device)[None, :]
        q_positions = torch.arange(start, start + n, device=q.device)[:, None]
        mask = k_positions <= q_positions
        if chunk is not None:
            mask &= k_positions // chunk == q_positions // chunk
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *,
                     sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                     chunk: int | None = None) -> torch.Tensor:
    """Attention of one new query per sequence to its cached keys: each sequence through `cached_attention` on its
    own, so each gets exactly the products (shapes, strides, kernels) it gets alone and that `transformers`' eager
    attention gives it, on every CPU.

    Batching the sequences into shared products is not exact on every CPU: which kernel a GEMM runs depends on
    its shapes and on the ISA (MKL's AVX-512 kernels on Intel, its AVX2 ones on AMD), so two sequences of one
    length in one batched product, or a row of weights padded with zeros to the longest history, rounded some
    results differently from the sequence alone on some kinds and not on others. `padded_decode_attention` is the
    fast batched form the engine runs, equal to this to rounding.

    Args:
        q: [B, heads, head_dim] the queries (rotated), sequence b's at position `lengths[b] - 1`.
        k, v: [B, groups, longest, head_dim] keys (rotated) and values, sequence b's in its first
            `lengths[b]` positions.
        lengths: [B] int64 keys per sequence, the new token's included.
        sliding_window: a key is visible when q_pos - k_pos < sliding_window (None: all earlier keys).
        sinks: [heads] per-head logits that join the softmax (None: none).
        chunk: a key is visible only in the query's chunk of `chunk` positions (None: no chunks).

    Returns:
        [B, heads * head_dim].
    """
    b, heads, d = q.shape
    out = q.new_empty(b, heads * d)
    for i, n in enumerate(lengths.tolist()):
        out[i] = cached_attention(q[i:i + 1], k[i, :, :n].transpose(0, 1), v[i, :, :n].transpose(0, 1),
                                  torch.tensor([n - 1]), sliding_window=sliding_window, sinks=sinks, chunk=chunk)[0]
    return out


def padded_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *,
                            sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                            chunk: int | None = None) -> torch.Tensor:
    """`decode_attention`'s result as one padded batch: every sequence's scores against the longest history in
    one product (the `rep` query heads of a key group as the rows of one GEMM, the keys read in place), the
    padding masked to -inf before an fp32 softmax, and one product with the values.

    The same arithmetic in another order: the scores of a sequence come from a GEMM of another shape than its
    own, so they differ from `decode_attention`'s in the last bits (1e-7 relative in fp32, measured).

    Args and returns: as `decode_attention`.
    """
    b, heads, d = q.shape
    groups, longest = k.shape[1], k.shape[2]
    rep = heads // groups
    # The keys as the left operand (keys x queries^T, then a transposed view): each small GEMM then reads its
    # [longest, d] keys row by row, where queries x keys^T read them transposed. 64 sequences of ~110 tokens,
    # 4 groups of 2 heads, caches out of the CPU's caches: 0.63 against 1.09 ms a layer (AMD EPYC, one thread).
    scores = torch.matmul(k, q.reshape(b, groups, rep, d).transpose(2, 3)).transpose(2, 3)  # [b, groups, rep, longest]
    k_positions = torch.arange(longest, device=q.device)
    hidden = k_positions[None, :] >= lengths[:, None]
    if sliding_window is not None:
        hidden |= (lengths[:, None] - 1) - k_positions[None, :] >= sliding_window
    if chunk is not None:
        hidden |= (lengths[:, None] - 1) // chunk != k_positions[None, :] // chunk
    scores = scores.mul_(d ** -0.5).masked_fill_(hidden[:, None, None, :], float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        weights = _softmax_with_sinks(scores, sinks.reshape(1, groups, rep, 1).expand(b, groups, rep, 1)).to(q.dtype)
    return torch.matmul(weights, v).reshape(b, heads * d)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over each row of `scores` with its sink logit (`sinks`, the scores' shape but one column) as one
    more entry, that entry's probability dropped: transformers' GPT-OSS order (cat, minus the row maximum, a
    softmax in the scores' dtype, slice), so bf16 rounds where it does there. A view of the probabilities."""
    combined = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def _repeat_groups(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[m, groups, d] -> contiguous [groups * rep, m, d]: query head h reads group h // rep (as repeat_kv)."""
    groups, m, d = t.shape[1], t.shape[0], t.shape[2]
    t = t.transpose(0, 1)
    if rep == 1:
        return t.contiguous()
    return t[:, None].expand(groups, rep, m, d).reshape(groups * rep, m, d)


# --- multi-head latent attention (DeepSeek-V3; its projections are `layers.MultiLatentAttention`'s) ------------

def exact_latent_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                           q_positions: torch.Tensor, kv_b: torch.Tensor, mla: LatentAttention,
                           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence's new queries to all its latents so far, as `transformers`' DeepseekV3
    eager attention computes it: every head's keys and values rebuilt from the latents (`kv_b_proj` over all of
    them, keys assembled in a fresh [1, heads, m, qk] tensor), queries [1, heads, n, qk] contiguous, the scaled
    scores, masked entries excluded, an fp32 softmax, weights @ values (a strided view, as there).

    Args:
        q_nope [n, heads, nope], q_rope [n, heads, rope]: the queries (rotary part rotated).
        latent [m, kv_lora_rank], k_rope [m, rope]: the sequence's latents and rotated keys, positions 0..m-1.
        q_positions: [n] int64 positions of the queries (each < m).
        kv_b: [heads * (nope + v), kv_lora_rank] the layer's `kv_b_proj` weight; mla: the layer's sizes and scale.
        allowed: [n, m] bool, the tokens each query may attend to (DeepSeek Sparse Attention's selection; the
            others are masked as `transformers` masks them), or None: every earlier token.

    Returns:
        [n, heads * v].
    """
    n, heads = q_nope.shape[:2]
    m = latent.shape[0]
    nope, rope, v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    kv = F.linear(latent[None, None], kv_b).view(1, m, heads, nope + v_dim).transpose(1, 2)
    k_nope, values = torch.split(kv, [nope, v_dim], dim=-1)
    keys = kv.new_empty(1, heads, m, nope + rope)
    keys[..., :nope].copy_(k_nope)
    keys[..., nope:].copy_(k_rope[None, None].expand(1, heads, m, rope))
    query = torch.cat((q_nope.transpose(0, 1)[None], q_rope.transpose(0, 1)[None]), dim=-1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * mla.softmax_scale
    hidden = torch.arange(m)[None, :] > q_positions[:, None]
    if allowed is not None:
        hidden |= ~allowed
    scores = scores.masked_fill(hidden[None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, values)  # [1, heads, n, v]
    return out.transpose(1, 2).reshape(n, heads * v_dim)


def absorbed_decode_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                              lengths: torch.Tensor, kv_b: torch.Tensor, mla: LatentAttention, *,
                              usable: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per sequence attending to its cached latents with the up-projections absorbed, the batch
    padded to its longest history.

    score(h, s) = (q_nope[h] W_uk[h]) . latent[s] + q_rope[h] . k_rope[s], and
    out[h] = (the softmax-weighted latents) W_uv[h]^T.
    Per step this reads each latent once and multiplies heads x kv_lora_rank per cached token, instead of building
    heads x (nope + v) keys and values per cached token.

    Args:
        q_nope [B, heads, nope], q_rope [B, heads, rope]: the queries, sequence b's at position lengths[b] - 1.
        latent [B, longest, kv_lora_rank], k_rope [B, longest, rope]: sequence b's in its first lengths[b] positions.
        lengths: [B] int64.
        kv_b: the layer's `kv_b_proj` weight; mla: its sizes and scale.
        usable: [B, longest] bool, the rows each query reads (the latents DeepSeek Sparse Attention selected,
            gathered), in place of `lengths`.

    Returns:
        [B, heads * v].
    """
    b, heads = q_nope.shape[:2]
    longest = latent.shape[1]
    nope, v_dim = mla.qk_nope_head_dim, mla.v_head_dim
    per_head = kv_b.view(heads, nope + v_dim, mla.kv_lora_rank)  # W_uk [heads, nope, rank], then W_uv [heads, v, rank]
    q_latent = torch.matmul(q_nope.transpose(0, 1), per_head[:, :nope]).transpose(0, 1)  # [B, heads, rank]
    scores = torch.matmul(q_latent, latent.transpose(1, 2)) + torch.matmul(q_rope, k_rope.transpose(1, 2))
    padding = torch.arange(longest)[None, :] >= lengths[:, None] if usable is None else ~usable
    scores = scores.mul_(mla.softmax_scale).masked_fill_(padding[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
    context = torch.matmul(weights, latent)  # [B, heads, rank]
    out = torch.matmul(context.transpose(0, 1), per_head[:, nope:].transpose(1, 2))  # [heads, B, v]
    return out.transpose(0, 1).reshape(b, heads * v_dim)


class LatentKVCache(KVCache):
    """The KV cache of an MLA model: per layer and sequence the normalised latents [positions, kv_lora_rank] and
    the rotated keys [positions, rope], nothing per head, and for DeepSeek Sparse Attention the indexer's keys
    [positions, index_head_dim] (in its indexed layers; a layer that shares the selection before it keeps none). The
    bookkeeping (rows, lengths, growth) is `KVCache`'s, with the latents where it keeps keys and the rotary keys where
    it keeps values (one "head" each).

    Args:
        num_layers, kv_lora_rank, rope_dim: the model's sizes.
        dtype, device: of the stored tensors.
        exact_decode: decode tokens attend through `exact_latent_attention`, each sequence alone (the reference
            model's); False: through `absorbed_decode_attention` unless `absorb` is False.
        absorb: with `exact_decode` False, the workers' absorbed decode (MBRIDGE_EPOVERLAP_MLA_ABSORB, default 1).
        index_widths: per layer the indexer key width (0: no indexer keys); None: no sparse attention.
    """

    def __init__(self, num_layers: int, kv_lora_rank: int, rope_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, exact_decode: bool = True, absorb: bool = True,
                 index_widths: Sequence[int] | None = None) -> None:
        super().__init__(num_layers, 1, kv_lora_rank, dtype=dtype, device=device, exact_decode=exact_decode)
        self.rope_dim, self.absorb = rope_dim, absorb
        self._values = [v.new_zeros(v.shape[0], 1, v.shape[2], rope_dim) for v in self._values]
        self.index_widths = tuple(index_widths) if index_widths is not None else None
        self._index_keys = [v.new_zeros(v.shape[0], 1, v.shape[2], width)
                            for v, width in zip(self._values, self.index_widths or (), strict=False)]
        # The last indexed layer's choice, for the layers that share it (GLM-5): per sequence the [n, m] tokens its
        # queries attend to (None: all), and the decode batch's (positions, usable) of the absorbed decode.
        self._chosen: dict[int, torch.Tensor | None] = {}
        # kept only where a layer reads them: a long prompt's [n, m] choice is not small
        self._shares = any(width == 0 for width in self.index_widths or ())
        self._chosen_decode: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_spec(cls, spec: ModelSpec, device: torch.device | None = None, *, exact_decode: bool = True,
                 absorb: bool = True) -> LatentKVCache:
        if spec.mla is None:
            raise ValueError(f"{spec.source} has no latent attention; use KVCache")
        return cls(spec.num_layers, spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, dtype=spec.torch_dtype(),
                   device=device, exact_decode=exact_decode, absorb=absorb, index_widths=index_key_widths(spec))

    @classmethod
    def for_engine(cls, spec: ModelSpec) -> LatentKVCache:
        """An engine worker's cache: absorbed decode, unless MBRIDGE_EPOVERLAP_MLA_ABSORB=0 or
        MBRIDGE_EPOVERLAP_EXACT_ATTENTION=1 asks for the exact one."""
        return cls.for_spec(spec, exact_decode=exact_attention_asked(),
                            absorb=os.environ.get("MBRIDGE_EPOVERLAP_MLA_ABSORB", "1") != "0")

    def empty_like(self) -> LatentKVCache:
        return LatentKVCache(self.num_layers, self.head_dim, self.rope_dim, dtype=self.dtype, device=self.device,
                             exact_decode=self.exact_decode, absorb=self.absorb, index_widths=self.index_widths)

    def _stores(self) -> tuple[list[torch.Tensor], ...]:
        return (self._keys, self._values, self._index_keys) if self._index_keys else (self._keys, self._values)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._chosen.pop(seq_id, None)

    def bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers."""
        index = sum(self.index_widths or ())
        return (self.num_layers * (self.head_dim + self.rope_dim) + index) * (torch.finfo(self.dtype).bits // 8)

    def rows(self, seq_id: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As `KVCache.rows`; with sparse attention each layer's indexer keys follow its rotary keys in the second
        tensor ([1, n, rope + index width])."""
        out = super().rows(seq_id, start, end)
        if not self._index_keys:
            return out
        row = self._row[seq_id]
        return [(latent, torch.cat([rope, self._index_keys[layer][row, :, start:end]], dim=-1))
                for layer, (latent, rope) in enumerate(out)]

    def load(self, seq_id: int, blocks: Sequence[list[tuple[torch.Tensor, torch.Tensor]]]) -> int:
        if not self._index_keys:
            return super().load(seq_id, blocks)
        split = [[(latent, both[..., :self.rope_dim]) for latent, both in block] for block in blocks]
        end = super().load(seq_id, split)
        row, start = self._row[seq_id], 0
        for block in blocks:
            size = block[0][0].shape[1]
            for layer, (_, both) in enumerate(block):
                self._index_keys[layer][row, :, start:start + size] = both[..., self.rope_dim:]
            start += size
        return end

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: TokenBatch, *,
               sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        raise TypeError("an MLA model's cache holds latents; attend through "
                        "`layers.MultiLatentAttention.attend`")

    def attend_latent(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                      k_rope: torch.Tensor, batch: TokenBatch, kv_b: torch.Tensor, mla: LatentAttention, *,
                      index: IndexQueries | None = None) -> torch.Tensor:
        """Store the batch's latents and rotated keys for `layer` and attend each token's query to its sequence so
        far: decode tokens as one batch (absorbed, or each exactly), a prompt or a lone decode token exactly.

        Args:
            q_nope [T, heads, nope], q_rope [T, heads, rope] (rotated): the queries, rows in batch order.
            latent [T, kv_lora_rank] (normalised), k_rope [T, rope] (rotated): the tokens' cache entries.
            kv_b: [heads * (nope + v), kv_lora_rank] the layer's `kv_b_proj` weight; mla: its sizes and scale.
            index: DeepSeek Sparse Attention's indexer projections (their keys are cached too), or the word to
                reuse the last indexed layer's choice; None: dense attention.

        Returns:
            [T, heads * v].
        """
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1] * mla.v_head_dim)
        groups = batch.attention_groups
        if groups.decode:
            rows = groups.decode_rows
            lat, rope, lengths, order = self.append_decode(layer, groups.decode_seq_ids, groups.decode_starts,
                                                           latent[rows][:, None], k_rope[rows][:, None])
            rows = _in_order(rows, order)
            if self.exact_decode or not self.absorb:
                allowed = self._decode_choices(layer, groups, rows, order, index)
                out[rows] = _each_exactly(q_nope[rows], q_rope[rows], lat, rope, lengths.tolist(), kv_b, mla, allowed)
            else:
                usable, keys = None, None
                if index is not None and not index.shared:
                    keys = self._new_index_keys(layer, groups, index)
                if index is not None and lat.shape[2] > index.topk:  # a history longer than the selection
                    positions, usable = self._padded_choice(layer, rows, lengths, index, keys)
                    pick = torch.arange(lat.shape[0])[:, None]
                    lat, rope = lat[pick, 0, positions][:, None], rope[pick, 0, positions][:, None]
                out[rows] = absorbed_decode_attention(q_nope[rows], q_rope[rows], lat[:, 0], rope[:, 0], lengths, kv_b,
                                                      mla, usable=usable)
        for seg in groups.alone:
            lat, rope = self.append(layer, seg.seq_id, seg.start, latent[seg.rows][:, None], k_rope[seg.rows][:, None])
            allowed = None
            if index is not None:
                allowed = self._prompt_choice(layer, seg.seq_id, seg.start, seg.rows, batch.positions[seg.rows], index)
            out[seg.rows] = exact_latent_attention(q_nope[seg.rows], q_rope[seg.rows], lat[:, 0], rope[:, 0],
                                                   batch.positions[seg.rows], kv_b, mla, allowed)
        return out

    # --- DeepSeek Sparse Attention: the indexer's keys and choices -------------------------------------------------

    def _prompt_choice(self, layer: int, seq_id: int, start: int, rows: slice, q_positions: torch.Tensor,
                       index: IndexQueries) -> torch.Tensor | None:
        """Store a prompt's (or lone token's) indexer keys and choose what its queries attend to, exactly."""
        if index.shared:
            return self._chosen.get(seq_id)
        assert index.q is not None and index.weights is not None and index.keys is not None
        row = self._row[seq_id]
        end = start + q_positions.shape[0]
        buffer = self._index_keys[layer]
        buffer[row, 0, start:end] = index.keys[rows]
        chosen = exact_selection(index.q[rows], index.weights[rows], buffer[row, 0, :end], q_positions, index.topk,
                                 self.dtype)
        if self._shares:
            self._chosen[seq_id] = chosen
        return chosen

    def _new_index_keys(self, layer: int, groups: AttentionGroups, index: IndexQueries) -> torch.Tensor:
        """Store the decode tokens' indexer keys; every sequence's indexer keys [B, longest, width], arranged as
        `append_decode` arranged the latents (a view of the rows in row order where they are a range)."""
        assert index.keys is not None
        seq_ids, starts = groups.decode_seq_ids, groups.decode_starts
        cache_rows = [self._row[s] for s in seq_ids]
        buffer = self._index_keys[layer]
        buffer[torch.tensor(cache_rows), 0, torch.tensor(starts)] = index.keys[groups.decode_rows]
        return _history(buffer, cache_rows, max(starts) + 1)[:, 0]

    def _decode_choices(self, layer: int, groups: AttentionGroups, rows: torch.Tensor, order: torch.Tensor | None,
                        index: IndexQueries | None) -> list[torch.Tensor | None] | None:
        """Each decode token's exact choice ([1, m] bool, None: all), in `rows`' order (the batch rows as
        `append_decode` arranged the histories); None without sparse attention."""
        if index is None:
            return None
        seq_ids = groups.decode_seq_ids
        ids = [seq_ids[i] for i in (order.tolist() if order is not None else range(len(seq_ids)))]
        if index.shared:
            return [self._chosen.get(s) for s in ids]
        assert index.q is not None and index.weights is not None
        keys = self._new_index_keys(layer, groups, index)
        choices: list[torch.Tensor | None] = []
        for i, seq_id in enumerate(ids):
            n = self._lengths[seq_id][layer]
            choice = exact_selection(index.q[rows[i:i + 1]], index.weights[rows[i:i + 1]], keys[i, :n],
                                     torch.tensor([n - 1]), index.topk, self.dtype)
            if self._shares:
                self._chosen[seq_id] = choice
            choices.append(choice)
        return choices

    def _padded_choice(self, layer: int, rows: torch.Tensor, lengths: torch.Tensor, index: IndexQueries,
                       keys: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode batch's chosen positions and which are real tokens (`padded_selection` over `keys`, the
        histories of indexer keys), in `rows`' order; a shared layer's: the last indexed layer's."""
        if index.shared:
            if self._chosen_decode is None:
                raise RuntimeError(f"layer {layer} shares a selection no indexed layer made in this step")
            return self._chosen_decode
        assert index.q is not None and index.weights is not None and keys is not None
        self._chosen_decode = padded_selection(index.q[rows], index.weights[rows], keys, lengths, index.topk)
        return self._chosen_decode


def _each_exactly(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  lengths: Sequence[int], kv_b: torch.Tensor, mla: LatentAttention,
                  allowed: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """`exact_latent_attention` for each decode token alone (latent [B, 1, longest, rank], k_rope likewise; `allowed`:
    each token's sparse-attention choice)."""
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1] * mla.v_head_dim)
    for i, n in enumerate(lengths):
        out[i] = exact_latent_attention(q_nope[i:i + 1], q_rope[i:i + 1], latent[i, 0, :n], k_rope[i, 0, :n],
                                        torch.tensor([n - 1]), kv_b, mla, None if allowed is None else allowed[i])[0]
    return out


def index_key_widths(spec: ModelSpec) -> tuple[int, ...] | None:
    """Per layer the width of the indexer keys the cache holds (0 where a layer shares the selection before it);
    None for a model without DeepSeek Sparse Attention."""
    if spec.mla is None or spec.mla.indexer is None:
        return None
    ix = spec.mla.indexer
    return tuple(0 if layer in ix.shared_layers else ix.head_dim for layer in range(spec.num_layers))


def kv_cache_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes the KV cache holds per token over all layers: the latent and the rotary key of an MLA model, the
    keys and values of every KV head otherwise; DeepSeek-V4's pooled entries (its sliding windows are bounded per
    sequence: `compressed.state.window_bytes_per_sequence`)."""
    if spec.compressed is not None:
        return pooled_bytes_per_token(spec)
    size = torch.finfo(spec.torch_dtype()).bits // 8
    if spec.mla is not None:
        per_layer = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    else:
        per_layer = 2 * spec.num_kv_heads * spec.head_dim
    return (len(spec.attention_layer_ids) * per_layer + sum(index_key_widths(spec) or ())) * size
