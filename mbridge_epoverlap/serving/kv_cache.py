"""`KVCache`: the keys and values of every layer for each sequence being decoded.

Storage per (sequence, layer) is a [kv_heads, capacity, head_dim] buffer that doubles when full, so
appending one decode token is a copy into place, not a concatenation of the whole history.
"""

from __future__ import annotations

import torch

from mbridge_epoverlap.serving.spec import ModelSpec

_INITIAL_CAPACITY = 64


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
        # seq_id -> per layer [keys, values] buffers and filled lengths
        self._buffers: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lengths: dict[int, list[int]] = {}

    @classmethod
    def for_spec(cls, spec: ModelSpec, device: torch.device | None = None) -> KVCache:
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype=spec.torch_dtype(), device=device)

    def add(self, seq_id: int) -> None:
        """Start an empty cache for a new sequence."""
        if seq_id in self._buffers:
            raise ValueError(f"sequence {seq_id} is already in the KV cache")
        empty = lambda: torch.empty(self.num_kv_heads, _INITIAL_CAPACITY, self.head_dim,  # noqa: E731
                                    dtype=self.dtype, device=self.device)
        self._buffers[seq_id] = [(empty(), empty()) for _ in range(self.num_layers)]
        self._lengths[seq_id] = [0] * self.num_layers

    def free(self, seq_id: int) -> None:
        """Drop a finished sequence's keys and values."""
        if seq_id not in self._buffers:
            raise KeyError(f"sequence {seq_id} is not in the KV cache")
        del self._buffers[seq_id], self._lengths[seq_id]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._buffers

    def seq_ids(self) -> list[int]:
        return list(self._buffers)

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
        if seq_id not in self._buffers:
            raise KeyError(f"sequence {seq_id} is not in the KV cache (add it first)")
        filled = self._lengths[seq_id][layer]
        if start != filled:
            raise ValueError(f"sequence {seq_id} layer {layer}: tokens start at position {start} but the cache "
                             f"holds {filled} positions")
        end = filled + keys.shape[0]
        k_buf, v_buf = self._buffers[seq_id][layer]
        if end > k_buf.shape[1]:
            capacity = max(end, 2 * k_buf.shape[1])
            k_buf, v_buf = (torch.cat([b[:, :filled], b.new_empty(b.shape[0], capacity - filled, b.shape[2])], 1)
                            for b in (k_buf, v_buf))
            self._buffers[seq_id][layer] = (k_buf, v_buf)
        k_buf[:, filled:end] = keys.transpose(0, 1)
        v_buf[:, filled:end] = values.transpose(0, 1)
        self._lengths[seq_id][layer] = end
        return k_buf[:, :end].transpose(0, 1), v_buf[:, :end].transpose(0, 1)
