"""`KVCache`: the keys and values of every layer for each sequence being decoded.

Storage per layer is one [rows, kv_heads, capacity, head_dim] tensor for keys and one for values, a row
per sequence. Appending a decode token is a copy into place (the capacity doubles when a sequence
outgrows it, the rows when more sequences arrive), and a decode batch's history is read for every
sequence at once (`append_decode`), so attention over a batch of decode tokens is a few batched ops
rather than a loop over sequences.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from mbridge_epoverlap.serving.model.spec import ModelSpec

_INITIAL_CAPACITY = 64
_INITIAL_ROWS = 8


class KVCache:
    """Per-sequence key/value storage.

    Args:
        num_layers, num_kv_heads, head_dim: shapes of the model.
        dtype, device: of the stored keys and values.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        shape = (_INITIAL_ROWS, num_kv_heads, _INITIAL_CAPACITY, head_dim)
        self._keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._row: dict[int, int] = {}  # seq_id -> its row
        self._free_rows: list[int] = list(range(_INITIAL_ROWS))  # a heap: the lowest free row is taken first
        self._lengths: dict[int, list[int]] = {}

    @classmethod
    def for_spec(cls, spec: ModelSpec, device: torch.device | None = None) -> KVCache:
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=spec.torch_dtype(), device=device)

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

    def empty_like(self) -> KVCache:
        """A new, empty cache of the same shapes."""
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)

    def free(self, seq_id: int) -> None:
        """Drop a finished sequence's keys and values."""
        if seq_id not in self._row:
            raise KeyError(f"sequence {seq_id} is not in the KV cache")
        heapq.heappush(self._free_rows, self._row.pop(seq_id))
        del self._lengths[seq_id]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row

    def seq_ids(self) -> list[int]:
        return list(self._row)

    def length(self, seq_id: int, layer: int = 0) -> int:
        """Positions cached for `seq_id` in `layer`."""
        return self._lengths[seq_id][layer]

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
                      values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one new token per sequence (keys/values [B, kv_heads, head_dim], token b of `seq_ids[b]` at
        position `starts[b]`) and return every sequence's history at once.

        Returns:
            (keys, values) each [B, kv_heads, longest, head_dim], sequence b valid in its first
            `lengths[b]` positions (the rest is padding), and `lengths` [B] int64.
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
        if rows == list(range(rows[0], rows[0] + len(rows))):  # consecutive rows in batch order: a view
            span = slice(rows[0], rows[0] + len(rows))
            return k_buf[span, :, :longest], v_buf[span, :, :longest], position + 1
        # index_select of the filled positions copies whole rows; advanced indexing is about twice as slow here.
        return (k_buf[:, :, :longest].index_select(0, row_index), v_buf[:, :, :longest].index_select(0, row_index),
                position + 1)

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

    def _resize(self, *, rows: int | None = None, layer: int | None = None, capacity: int | None = None) -> None:
        for index in range(self.num_layers) if layer is None else (layer,):
            for store in (self._keys, self._values):
                old = store[index]
                new = old.new_zeros(rows or old.shape[0], old.shape[1], capacity or old.shape[2], old.shape[3])
                new[:old.shape[0], :, :old.shape[2]] = old
                store[index] = new
