"""The expert weights one expert worker holds, and how they change: start share, restores, moved copies.

Elastic EP adds to it (a lost expert restored from the checkpoint on disk, `ensure`) and replaces it at a
layout epoch (`build` from weights received from other workers plus those held, then `adopt`); `export`
gives the weights another worker asks for. With streamed decode steps the micro-batches still in flight when
an epoch starts were routed by the old placement, so `adopt` keeps the old weights (they still serve those
tokens) until `retire`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mbridge_epoverlap.serving.model.parts import ExpertPart, load_expert_part

_SLACK_BYTES = 1024  # alignment of three tensors and room to spare


def weight_slot_bytes(spec: Any, experts_per_message: int) -> int:
    """M2N slot size for one message of `experts_per_message` experts' weights (every MoE layer)."""
    element = torch.empty(0, dtype=spec.torch_dtype()).element_size()
    per_expert = len(spec.moe_layer_ids) * 3 * spec.expert_ffn * spec.hidden_size * element
    return experts_per_message * (per_expert + 8) + _SLACK_BYTES


class ExpertStore:
    """The expert weights an expert worker holds: its start share plus experts loaded or received later.

    Called like an `ExpertPart` (`store(layer, tokens, expert_ids)`). A loss only adds weights (tokens routed
    by an attention worker that has not yet seen the loss still find their expert); a new layout epoch, which
    every worker enters at the same step boundary, replaces them with the epoch's share (`build`, `adopt`,
    then `retire` once no token routed by the old placement can arrive).
    """

    def __init__(self, spec: Any, expert_ids: Sequence[int]) -> None:
        self.spec = spec
        self.parts = [load_expert_part(spec, expert_ids)] if expert_ids else []
        self.retiring: list[Any] = []  # the previous epoch's parts, kept for tokens it routed (`adopt`)

    @property
    def held(self) -> set[int]:
        """The experts of this worker's share (the retiring weights not counted)."""
        return {e for part in self.parts for e in part.expert_ids}

    def ensure(self, expert_ids: Iterable[int]) -> list[int]:
        """Load the experts of `expert_ids` not held yet (copied from the retiring weights when they are there,
        else from the checkpoint on disk); return them."""
        missing = sorted(set(expert_ids) - self.held)
        if missing:
            old = {e for part in self.retiring for e in part.expert_ids}
            kept = [e for e in missing if e in old]
            if kept:
                w1, w2 = self._export(kept, self.retiring)
                self.parts.append(self._part(kept, w1, w2))
            if len(kept) < len(missing):
                self.parts.append(load_expert_part(self.spec, [e for e in missing if e not in old]))
        return missing

    def export(self, expert_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w1, w2)` of `expert_ids`, stacked `[moe layers, experts, ...]` (one message's worth of weights)."""
        return self._export(expert_ids, self.parts + self.retiring)

    def _export(self, expert_ids: Sequence[int], parts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        w1, w2 = [], []
        for layer in self.spec.moe_layer_ids:
            rows1, rows2 = [], []
            for expert in expert_ids:
                part = next(p for p in parts if expert in p.expert_ids)
                local = int(part.local_index[expert])
                grouped = part.experts[str(layer)]
                rows1.append(grouped.w1[local])
                rows2.append(grouped.w2[local])
            w1.append(torch.stack(rows1))
            w2.append(torch.stack(rows2))
        return torch.stack(w1), torch.stack(w2)

    def build(self, expert_ids: Sequence[int], incoming: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """One part holding `expert_ids`: each from `incoming` (`[moe layers, ...]` w1 and w2, as another worker
        exported them) or from the weights held; nothing held changes."""
        ids = sorted(expert_ids)
        if not ids:
            return None
        local = [e for e in ids if e not in incoming]
        w1_held, w2_held = self.export(local) if local else (None, None)
        w1, w2 = [], []
        for e in ids:
            if e in incoming:
                w1.append(incoming[e][0])
                w2.append(incoming[e][1])
            else:
                w1.append(w1_held[:, local.index(e)])
                w2.append(w2_held[:, local.index(e)])
        return self._part(ids, torch.stack(w1, dim=1), torch.stack(w2, dim=1))

    def adopt(self, part: Any) -> list[int]:
        """Make `part` (from `build`; None: nothing) this worker's share; return the experts dropped from it.

        The weights held before stay, behind the new share, for tokens routed by the previous placement, until
        `retire` (an epoch before the last one's retirement is dropped now: two epochs never overlap here).
        """
        held = self.held
        self.retiring = self.parts
        self.parts = [part] if part is not None else []
        return sorted(held - self.held)

    def retire(self) -> list[int]:
        """Drop the previous epoch's weights (no token routed by it is left); return the experts that went."""
        gone = sorted({e for p in self.retiring for e in p.expert_ids} - self.held)
        self.retiring = []
        return gone

    def _part(self, expert_ids: Sequence[int], w1: torch.Tensor, w2: torch.Tensor) -> Any:
        part = ExpertPart(self.spec, expert_ids)
        order = [list(expert_ids).index(e) for e in part.expert_ids]  # the part keeps its ids sorted
        with torch.no_grad():
            for i, layer in enumerate(self.spec.moe_layer_ids):
                part.experts[str(layer)].w1.copy_(w1[i, order])
                part.experts[str(layer)].w2.copy_(w2[i, order])
        return part

    def __call__(self, layer: int, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        parts = self.parts + self.retiring
        if len(parts) == 1:
            return parts[0](layer, tokens, expert_ids)
        out = tokens.new_empty(tokens.shape)
        left = torch.ones(expert_ids.shape[0], dtype=torch.bool)
        for part in parts:  # each row by the first part that holds its expert (the share before retiring weights)
            mine = part.owns(expert_ids) & left
            rows = mine.nonzero().squeeze(1)
            if rows.numel():
                out[rows] = part(layer, tokens[rows], expert_ids[rows])
                left &= ~mine
        if left.any():
            missing = sorted(set(expert_ids[left].tolist()))
            raise RuntimeError(f"experts {missing} were routed to an expert worker that does not hold them: the "
                               "attention and expert workers disagree on the placement")
        return out
