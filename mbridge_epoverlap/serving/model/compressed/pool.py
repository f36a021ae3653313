"""`Pool`: a DeepSeek-V4 compressor, every `rate` tokens of a sequence pooled into one entry.

Each token projects a value and a gate (`kv_proj`, `gate_proj`); a full window of `rate` tokens becomes the
softmax-over-tokens (of gate + `position_bias`) weighted sum of its values, normalised (`kv_norm`) and turned by
the compress rope at the window's first position. With `overlap` (compressed sparse attention and its indexer) the
projections are twice as wide: the second half of a window's tokens joins its own entry, the first half the next
window's, so an entry spans 2 * rate tokens with stride `rate`. Tokens of an unfinished window wait in the
sequence's `PoolState` until it fills, so prompts fed in chunks and decode tokens pool as one pass would.
"""

from __future__ import annotations

import torch

from mbridge_epoverlap.serving.model.compressed.rope import angles, fp32_norm, turn
from mbridge_epoverlap.serving.model.compressed.state import PoolState


class Pool(torch.nn.Module):
    """The compressor of one layer (or of its indexer): entries of `head_dim` from windows of `rate` tokens."""

    def __init__(self, hidden: int, head_dim: int, rate: int, *, overlap: bool, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = torch.nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.gate_proj = torch.nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.position_bias = torch.nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_norm = fp32_norm(head_dim, eps)

    def extend(self, kv: torch.Tensor, gate: torch.Tensor, state: PoolState, freqs: torch.Tensor,
               scale: float = 1.0) -> torch.Tensor:
        """Feed one sequence's next tokens (kv, gate [1, n, width]: their projections) and return every entry
        pooled so far, [1, count, head_dim]; `freqs`, `scale`: the compress rope's inverse frequencies and the
        factor of its cos and sin."""
        first = state.count * self.rate
        if state.buffer_kv is not None and state.buffer_kv.shape[1]:
            kv = torch.cat([state.buffer_kv, kv], dim=1)
            gate = torch.cat([state.buffer_gate, gate], dim=1)
        usable = (kv.shape[1] // self.rate) * self.rate
        # copies: a view would keep the whole step's projections alive until the window fills
        state.buffer_kv, state.buffer_gate = kv[:, usable:].clone(), gate[:, usable:].clone()
        kv, gate = kv[:, :usable], gate[:, :usable]
        if usable:
            windows = usable // self.rate
            kv = kv.view(1, windows, self.rate, -1)
            gate = gate.view(1, windows, self.rate, -1) + self.position_bias
            if self.overlap:
                kv, gate = self._overlapped(kv, gate, state)
            pooled = self.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
            positions = (torch.arange(windows) * self.rate + first).unsqueeze(0)
            cos, sin = angles(positions, freqs, pooled.dtype, scale)
            new = turn(pooled.unsqueeze(1), cos, sin).squeeze(1)
        else:
            new = kv.new_zeros((1, 0, self.head_dim))
        if state.entries is None:
            state.entries = new
        elif new.shape[1]:
            state.entries = torch.cat([state.entries, new], dim=1)
        state.count += new.shape[1]
        return state.entries

    def _overlapped(self, kv: torch.Tensor, gate: torch.Tensor, state: PoolState
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, windows, 2 * rate, head_dim] values and gates: per window the previous window's first halves (the
        state's for the first window; zero values and -inf gates before any), then its own second halves."""
        windows, rate, d = kv.shape[1], self.rate, self.head_dim
        wide_kv = kv.new_zeros((1, windows, 2 * rate, d))
        wide_gate = gate.new_full((1, windows, 2 * rate, d), float("-inf"))
        wide_kv[:, :, rate:] = kv[..., d:]
        wide_gate[:, :, rate:] = gate[..., d:]
        if windows > 1:
            wide_kv[:, 1:, :rate] = kv[:, :-1, :, :d]
            wide_gate[:, 1:, :rate] = gate[:, :-1, :, :d]
        prior_kv, prior_gate = state.overlap_kv, state.overlap_gate
        state.overlap_kv, state.overlap_gate = kv[:, -1, :, :d].clone(), gate[:, -1, :, :d].clone()
        if prior_kv is not None:
            wide_kv[:, 0, :rate] = prior_kv.to(wide_kv.dtype)
            wide_gate[:, 0, :rate] = prior_gate.to(wide_gate.dtype)
        return wide_kv, wide_gate
