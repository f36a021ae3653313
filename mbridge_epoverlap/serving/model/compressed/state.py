"""`CompressedCache`: what DeepSeek-V4 keeps of each sequence, per layer, beside the KV cache.

Per layer: the sliding window's last `sliding_window - 1` keys (one shared key = value head), and per pool (the
compressor, and the lightning indexer's on compressed sparse attention layers) the tokens projected since the last
full window, the previous window's first half (overlapping windows only) and every entry pooled so far. The
window is bounded; the pooled entries grow by one every `rate` tokens. All of it is what `transformers`'
`DeepseekV4HCACache` / `DeepseekV4CSACache` keep, so a decode step continues exactly where a prompt left off.

The attention side's `KVCache` owns one (`KVCache.compressed`): a sequence is added to and freed from both at once,
and a micro-batch's `empty_like` cache gets its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mbridge_epoverlap.serving.model.spec import ModelSpec


@dataclass
class PoolState:
    """One pool of one sequence: `buffer_kv` / `buffer_gate` [1, n < rate, width] the projected tokens of the
    unfinished window; `overlap_kv` / `overlap_gate` [1, rate, width / 2] the last full window's first half (None
    before the first, or without overlap); `entries` [1, count, head_dim] the pooled entries."""

    buffer_kv: torch.Tensor | None = None
    buffer_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    count: int = 0


@dataclass
class LayerState:
    """One layer of one sequence: `window` [1, 1, n, head_dim] the last keys (n < sliding_window), and its pools by
    name ("compressor", "indexer")."""

    window: torch.Tensor | None = None
    pools: dict[str, PoolState] = field(default_factory=dict)


class CompressedCache:
    """Each sequence's `LayerState` of every layer of a DeepSeek-V4 spec."""

    def __init__(self, spec: ModelSpec) -> None:
        if spec.compressed is None:
            raise ValueError(f"{spec.source} has no compressed attention: it needs no compressed cache")
        self.spec = spec
        self._seqs: dict[int, list[LayerState]] = {}

    def empty_like(self) -> CompressedCache:
        return CompressedCache(self.spec)

    def add(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the compressed cache")
        self._seqs[seq_id] = [LayerState() for _ in range(self.spec.num_layers)]

    def free(self, seq_id: int) -> None:
        if seq_id not in self._seqs:
            raise KeyError(f"sequence {seq_id} is not in the compressed cache")
        del self._seqs[seq_id]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def layer(self, seq_id: int, layer: int) -> LayerState:
        """The state of `seq_id` in `layer` (the sequence must have been added)."""
        try:
            return self._seqs[seq_id][layer]
        except KeyError:
            raise KeyError(f"sequence {seq_id} is not in the compressed cache") from None


def pooled_bytes_per_token(spec: ModelSpec) -> int:
    """Bytes a token adds to a sequence's pooled entries over all layers, rounded up: each pooling layer's entry of
    `head_dim` (and its indexer's key of `index_head_dim`) per `rate` tokens, in the model dtype. The sliding
    window's keys are bounded per sequence (`window_bytes_per_sequence`), so they cost a long context nothing more."""
    c = spec.compressed
    if c is None:
        raise ValueError(f"{spec.source} has no compressed attention")
    size = torch.finfo(spec.torch_dtype()).bits // 8
    widths = [(spec.head_dim + (c.index_head_dim if c.indexed[i] else 0), rate)
              for i, rate in enumerate(c.layer_rates) if rate]
    return math.ceil(sum(width * size / rate for width, rate in widths))


def window_bytes_per_sequence(spec: ModelSpec) -> int:
    """Bytes one sequence's sliding windows take at most, all layers: `sliding_window - 1` keys of `head_dim`."""
    c = spec.compressed
    if c is None:
        raise ValueError(f"{spec.source} has no compressed attention")
    return spec.num_layers * (c.sliding_window - 1) * spec.head_dim * (torch.finfo(spec.torch_dtype()).bits // 8)

