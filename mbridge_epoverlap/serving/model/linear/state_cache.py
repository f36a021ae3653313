"""`StateCache`: what a hybrid model's state layers (gated DeltaNet, Mamba-2) keep of each sequence.

A state layer keeps no keys or values. Per sequence and per such layer it keeps two tensors of a fixed size,
whatever the sequence's length: the last `conv_kernel` inputs of its causal convolution (the model dtype) and its
recurrent state (fp32, as `transformers` keeps it): one [key_head_dim, value_head_dim] matrix per value head of a
DeltaNet layer, one [head_dim, state_size] matrix per head of a Mamba-2 layer. A row per sequence, taken when the
sequence is added and given back when it is freed; the rows grow by doubling as the KV cache's do.

The attention side's `KVCache` owns one (`KVCache.states`) when the spec has state layers, so a sequence is added
to and freed from both at once, and a micro-batch's `empty_like` cache gets its own.
"""

from __future__ import annotations

import heapq
from typing import Any, NamedTuple

import torch

from mbridge_epoverlap.serving.model.batch import Segment, TokenBatch
from mbridge_epoverlap.serving.model.spec import ModelSpec

_INITIAL_ROWS = 8


class StateCache:
    """Per-sequence convolution windows and recurrent states of the gated DeltaNet layers of `spec`."""

    def __init__(self, spec: ModelSpec, *, device: torch.device | None = None) -> None:
        if not spec.state_layer_ids:
            raise ValueError(f"{spec.source} has no state layers (linear attention, Mamba-2): it needs no state cache")
        self.spec, self.device = spec, device
        self.layers = spec.state_layer_ids
        self.dtype = spec.torch_dtype()
        self._conv = {layer: torch.zeros(_INITIAL_ROWS, *state_shapes(spec, layer)[0], dtype=self.dtype, device=device)
                      for layer in self.layers}
        self._state = {layer: torch.zeros(_INITIAL_ROWS, *state_shapes(spec, layer)[1], dtype=torch.float32,
                                          device=device) for layer in self.layers}
        self._row: dict[int, int] = {}
        self._free_rows: list[int] = list(range(_INITIAL_ROWS))
        # tokens each sequence has fed through each linear layer: 0 means no state yet (a prompt starts from zeros)
        self._fed: dict[int, dict[int, int]] = {}

    def empty_like(self) -> StateCache:
        return StateCache(self.spec, device=self.device)

    def add(self, seq_id: int) -> None:
        if seq_id in self._row:
            raise ValueError(f"sequence {seq_id} is already in the state cache")
        if not self._free_rows:
            rows = next(iter(self._conv.values())).shape[0]
            for store in (self._conv, self._state):
                for layer, tensor in store.items():
                    store[layer] = torch.cat([tensor, torch.zeros_like(tensor)])
            self._free_rows = list(range(rows, 2 * rows))
        row = heapq.heappop(self._free_rows)
        for layer in self.layers:  # a reused row starts from zeros, as a new sequence's state does
            self._conv[layer][row].zero_()
            self._state[layer][row].zero_()
        self._row[seq_id] = row
        self._fed[seq_id] = dict.fromkeys(self.layers, 0)

    def free(self, seq_id: int) -> None:
        """Give the sequence's row back. The sequence in the highest row moves into it (its windows and states
        copied, every layer), so the live rows stay 0..n-1 and a decode batch updates its states in place, as a
        view of the buffers (`span`), instead of gathering and scattering copies at every layer of every step."""
        if seq_id not in self._row:
            raise KeyError(f"sequence {seq_id} is not in the state cache")
        row = self._row.pop(seq_id)
        del self._fed[seq_id]
        last = max(self._row.values(), default=-1)
        if last > row:
            mover = next(seq for seq, r in self._row.items() if r == last)
            for store in (self._conv, self._state):
                for tensor in store.values():
                    tensor[row] = tensor[last]
            self._row[mover] = row
            row = last
        heapq.heappush(self._free_rows, row)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row

    def fed(self, seq_id: int, layer: int) -> int:
        """Tokens of `seq_id` layer `layer` has consumed (0: its state is still the zero state)."""
        return self._fed[seq_id][layer]

    def rows_of(self, seq_ids: list[int]) -> torch.Tensor:
        return torch.tensor([self._row[s] for s in seq_ids], dtype=torch.int64)

    def span(self, layer: int, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Views of the windows and states of `seq_ids` when their rows are one contiguous range (as `free` keeps
        the live rows), and for each view row the position of its sequence in `seq_ids`; None otherwise."""
        rows = [self._row[s] for s in seq_ids]
        low = min(rows)
        if max(rows) - low + 1 != len(rows):
            return None
        order = torch.empty(len(rows), dtype=torch.int64)
        order[torch.tensor(rows) - low] = torch.arange(len(rows))
        end = low + len(rows)
        return self._conv[layer][low:end], self._state[layer][low:end], order

    def split(self, batch: TokenBatch, layer: int) -> tuple[list[Segment], list[Segment]]:
        """(decode steps, prompts) of `batch` in `layer`, as `transformers` tells them apart: a single token of a
        sequence that has a state takes one step of the recurrence; a prompt, a prompt chunk or a sequence's first
        token runs the chunked form from its state (zeros for a new sequence)."""
        steps, prompts = [], []
        for seg in batch.segments:
            (steps if seg.length == 1 and self.fed(seg.seq_id, layer) else prompts).append(seg)
        return steps, prompts

    def advance(self, seq_ids: list[int], layer: int, tokens: int = 1) -> None:
        """Count `tokens` more fed through `layer` for each of `seq_ids` (their states were updated in place)."""
        for seq_id in seq_ids:
            self._fed[seq_id][layer] += tokens

    def for_update(self, layer: int, seq_ids: list[int]) -> StepStates:
        """The windows and states of `seq_ids` to update in place for one decode token each: views of the buffers
        where their rows are one range (`span`), else copies that `done` writes back."""
        span = self.span(layer, seq_ids)
        if span is not None:
            windows, state, order = span
            return StepStates(self, layer, seq_ids, windows, state, order, None)
        rows = self.rows_of(seq_ids)
        windows, state = self.read(layer, rows)
        return StepStates(self, layer, seq_ids, windows, state, torch.arange(len(seq_ids)), rows)


    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the (conv window [n, conv_dim, kernel], recurrent state [n, heads, dk, dv]) of `rows`."""
        return self._conv[layer].index_select(0, rows), self._state[layer].index_select(0, rows)

    def write(self, layer: int, seq_ids: list[int], rows: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
              tokens: list[int]) -> None:
        """Store the new windows and states of `rows` (the sequences `seq_ids`, each having fed `tokens` more)."""
        self._conv[layer].index_copy_(0, rows, conv.to(self.dtype))
        self._state[layer].index_copy_(0, rows, state.to(torch.float32))
        for seq_id, n in zip(seq_ids, tokens, strict=True):
            self._fed[seq_id][layer] += n


class StepStates(NamedTuple):
    """A decode step's windows [n, conv, kernel] and states of `seq_ids` in `layer`, entry i holding the sequence at
    position `order[i]` of `seq_ids`; `rows`: where copies go back (None: they are views, updated in place)."""

    cache: StateCache
    layer: int
    seq_ids: list[int]
    windows: torch.Tensor
    state: torch.Tensor
    order: torch.Tensor
    rows: torch.Tensor | None

    def done(self) -> None:
        """The step's windows and states are updated: write back the copies, count the token."""
        if self.rows is not None:
            self.cache.write(self.layer, [self.seq_ids[i] for i in self.order.tolist()], self.rows, self.windows,
                             self.state, [1] * len(self.seq_ids))
            return
        self.cache.advance(self.seq_ids, self.layer)


def state_shapes(spec: ModelSpec, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the convolution window's shape, the recurrent state's shape) of one sequence in state layer `layer`."""
    if spec.is_linear(layer) and spec.linear_attention is not None:
        la = spec.linear_attention
        return (la.conv_dim, la.conv_kernel), (la.num_value_heads, la.key_head_dim, la.value_head_dim)
    if spec.is_mamba(layer) and spec.mamba is not None:
        m = spec.mamba
        return (m.conv_dim, m.conv_kernel), (m.num_heads, m.head_dim, m.state_size)
    raise ValueError(f"layer {layer} of {spec.source} keeps no state")


def state_bytes_per_sequence(spec: ModelSpec) -> int:
    """Bytes one sequence's states take over all state layers (0 for a model without them): its convolution windows
    in the model dtype and its fp32 recurrent states, whatever its length."""
    size = torch.finfo(spec.torch_dtype()).bits // 8
    total = 0
    for layer in spec.state_layer_ids:
        conv, state = state_shapes(spec, layer)
        total += conv[0] * conv[1] * size + state[0] * state[1] * state[2] * 4
    return total


def states_of(cache: Any) -> StateCache:
    """The state cache a KV cache holds for a model with state layers (`KVCache.states`); TypeError where it holds
    none (a cache made for another spec)."""
    states = getattr(cache, "states", None)
    if states is None:
        raise TypeError("a model with DeltaNet or Mamba-2 layers needs a KVCache with a state cache "
                        "(KVCache.for_spec makes one)")
    return states
