"""`TokenBatch`: the tokens of one model step, from several sequences, flat.

Each token carries its sequence id and its position in that sequence. A sequence contributes one run of
consecutive positions: a whole prompt, a chunk of one, or a single decode token, so prefill chunks and
decode tokens of different sequences mix in one batch (continuous batching).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Segment:
    """The rows of one sequence in a batch: `rows` of the flat batch, positions `start`..`start+len-1`."""

    seq_id: int
    rows: slice
    start: int

    @property
    def length(self) -> int:
        return self.rows.stop - self.rows.start


class AttentionGroups(NamedTuple):
    """How a batch's segments attend: the decode tokens (one per sequence) as one batch, the rest one at a time.

    Attributes:
        decode: the single-token segments attended as one batch (empty unless there are at least two).
        alone: the segments attended on their own: prompts (several tokens), and a lone decode token.
        decode_rows: [len(decode)] int64 batch rows of the decode tokens.
        decode_seq_ids, decode_starts: their sequence ids and positions.
    """

    decode: tuple[Segment, ...]
    alone: tuple[Segment, ...]
    decode_rows: torch.Tensor
    decode_seq_ids: list[int]
    decode_starts: list[int]


class PromptGroup(NamedTuple):
    """The segments of several tokens (prompts or prompt chunks) that start at one position and have one length:
    what one batched attention call takes.

    Attributes:
        start, length: the position of their first token and their token count.
        segments: the segments, in batch order.
        rows: [len(segments) * length] int64 batch rows, segment by segment.
    """

    start: int
    length: int
    segments: tuple[Segment, ...]
    rows: torch.Tensor


@dataclass(frozen=True)
class TokenBatch:
    """A flat batch of tokens.

    Attributes:
        token_ids: [T] int64 token ids.
        seq_ids: [T] int64 sequence id of each token.
        positions: [T] int64 position of each token in its sequence.
        segments: one `Segment` per sequence, in batch order (derived; each sequence's tokens must be
            adjacent rows with consecutive positions).
    """

    token_ids: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    segments: tuple[Segment, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.token_ids.shape[0]
        for name in ("token_ids", "seq_ids", "positions"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n or t.dtype != torch.int64:
                raise ValueError(f"TokenBatch.{name} must be a 1-D int64 tensor of {n} entries, got "
                                 f"{t.dtype} {list(t.shape)}")
        object.__setattr__(self, "segments", _segments(self.seq_ids.tolist(), self.positions.tolist()))

    @classmethod
    def from_chunks(cls, chunks: Sequence[tuple[int, Sequence[int], int]]) -> TokenBatch:
        """A batch from (sequence id, token ids, position of the first token) chunks, one per sequence."""
        ids: list[int] = []
        seqs: list[int] = []
        positions: list[int] = []
        for seq_id, tokens, start in chunks:
            ids.extend(int(t) for t in tokens)
            seqs.extend([seq_id] * len(tokens))
            positions.extend(range(start, start + len(tokens)))
        as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return cls(as_long(ids), as_long(seqs), as_long(positions))

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @cached_property
    def attention_groups(self) -> AttentionGroups:
        """The split every layer's attention uses, computed once per batch (the batch is the same in every layer)."""
        decode = tuple(seg for seg in self.segments if seg.length == 1)
        if len(decode) < 2:
            decode = ()
        alone = tuple(seg for seg in self.segments if seg.length > 1) if decode else self.segments
        return AttentionGroups(decode, alone, torch.tensor([seg.rows.start for seg in decode], dtype=torch.int64),
                               [seg.seq_id for seg in decode], [seg.start for seg in decode])

    @cached_property
    def prompt_groups(self) -> tuple[PromptGroup, ...]:
        """The segments of several tokens grouped by (start, length), in order of first appearance; computed once
        per batch, as `attention_groups` is."""
        shapes: dict[tuple[int, int], list[Segment]] = {}
        for seg in self.segments:
            if seg.length > 1:
                shapes.setdefault((seg.start, seg.length), []).append(seg)
        return tuple(
            PromptGroup(start, length, tuple(segs),
                        torch.tensor([r for seg in segs for r in range(seg.rows.start, seg.rows.stop)],
                                     dtype=torch.int64))
            for (start, length), segs in shapes.items())

    def last_rows(self) -> tuple[torch.Tensor, list[int]]:
        """(rows of each sequence's last token in this batch, their sequence ids), in batch order."""
        rows = [s.rows.stop - 1 for s in self.segments]
        return torch.tensor(rows, dtype=torch.int64), [s.seq_id for s in self.segments]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token_ids, seq_ids, positions): what travels between processes; `TokenBatch(*t)` rebuilds it."""
        return self.token_ids, self.seq_ids, self.positions


def _segments(seq_ids: list[int], positions: list[int]) -> tuple[Segment, ...]:
    out: list[Segment] = []
    seen: set[int] = set()
    start = 0
    for i in range(1, len(seq_ids) + 1):
        if i < len(seq_ids) and seq_ids[i] == seq_ids[start]:
            if positions[i] != positions[i - 1] + 1:
                raise ValueError(f"sequence {seq_ids[i]}: positions {positions[i - 1]} then {positions[i]} in one "
                                 "batch; a sequence's tokens must have consecutive positions")
            continue
        seq = seq_ids[start]
        if seq in seen:
            raise ValueError(f"sequence {seq} appears in two separate runs of one batch; put its tokens together")
        if positions[start] < 0:
            raise ValueError(f"sequence {seq}: negative position {positions[start]}")
        seen.add(seq)
        out.append(Segment(seq_id=seq, rows=slice(start, i), start=positions[start]))
        start = i
    return tuple(out)
