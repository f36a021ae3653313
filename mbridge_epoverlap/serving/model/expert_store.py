"""The expert weights one expert worker holds, and how they change: start share, restores, moved copies.

Elastic EP adds to it (a lost expert restored from the checkpoint on disk, `ensure`) and replaces it at a
layout epoch (`build` from weights received from other workers plus those held, then `adopt`); `export`
gives the weights another worker asks for. With streamed decode steps the micro-batches still in flight when
an epoch starts were routed by the old placement, so `adopt` keeps the old weights (they still serve those
tokens) until `retire`.

Every part is packed as the non-elastic expert workers' are (`ExpertPart(packed=True)`: oneDNN-packed copies
where this torch has them), so elastic EP computes as they do. Packing a weight costs far more than copying it
(a [192, 256] fp32 expert matrix: 0.6-2 ms against 0.01-0.2 ms for its copy, AMD EPYC, AVX2, one thread, loaded
machine), so an epoch packs only what it gains: the new share is one part (one grouped call per layer, as a
non-elastic worker makes; two parts of one expert each took 1.7-2.2x one part of both), whose experts already held
share the packed weights of the part that held them (the same tensors) and only received or restored experts are
packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mbridge_epoverlap.serving.model.parts import ExpertPart, load_expert_part

_SLACK_BYTES = 1024  # alignment of three tensors and room to spare


def weight_slot_bytes(spec: Any, experts_per_message: int) -> int:
    """M2N slot size for one message of `experts_per_message` experts' weights (every MoE layer), their biases
    included where the model has them (GPT-OSS)."""
    element = torch.empty(0, dtype=spec.torch_dtype()).element_size()
    per_layer = (spec.expert_w1_rows + spec.expert_ffn) * spec.hidden_size  # w1 (gate and up, or up), w2
    if spec.expert_bias:
        per_layer += 2 * spec.expert_ffn + spec.hidden_size
    per_expert = len(spec.moe_layer_ids) * per_layer * element
    return experts_per_message * (per_expert + 8) + 2 * _SLACK_BYTES


class ExpertStore:
    """The expert weights an expert worker holds: its start share plus experts loaded or received later.

    Called like an `ExpertPart` (`store(layer, tokens, expert_ids)`). A loss only adds weights (tokens routed
    by an attention worker that has not yet seen the loss still find their expert); a new layout epoch, which
    every worker enters at the same step boundary, replaces them with the epoch's share (`build`, `adopt`,
    then `retire` once no token routed by the old placement can arrive).
    """

    def __init__(self, spec: Any, expert_ids: Sequence[int]) -> None:
        self.spec = spec
        self.parts = [load_expert_part(spec, expert_ids, packed=True)] if expert_ids else []
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
                self.parts.append(self._part(kept, *self._export(kept, self.retiring), sources=self.retiring))
            if len(kept) < len(missing):
                self.parts.append(load_expert_part(self.spec, [e for e in missing if e not in old], packed=True))
        return missing

    def export(self, expert_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """`(w1, w2)` of `expert_ids`, stacked `[moe layers, experts, ...]` (one message's worth of weights), and
        `(b1, b2)` after them where the experts have biases (GPT-OSS)."""
        return self._export(expert_ids, self.parts + self.retiring)

    def _export(self, expert_ids: Sequence[int], parts: Sequence[Any]) -> tuple[torch.Tensor, ...]:
        tensors: list[list[torch.Tensor]] = [[] for _ in range(4 if self.spec.expert_bias else 2)]
        for layer in self.spec.moe_layer_ids:
            rows: list[list[torch.Tensor]] = [[] for _ in tensors]
            for expert in expert_ids:
                part = next(p for p in parts if expert in p.expert_ids)
                local = int(part.local_index[expert])
                grouped = part.experts[str(layer)]
                rows[0].append(grouped.w1[local])
                rows[1].append(grouped.w2[local])
                if part.biases is not None:
                    rows[2].append(part.biases[str(layer)].b1[local])
                    rows[3].append(part.biases[str(layer)].b2[local])
            for out, stacked in zip(tensors, rows, strict=True):
                out.append(torch.stack(stacked))
        return tuple(torch.stack(t) for t in tensors)

    def build(self, expert_ids: Sequence[int], incoming: dict[int, tuple[torch.Tensor, ...]]) -> Any:
        """One packed part holding `expert_ids`: each from `incoming` (`[moe layers, ...]` w1 and w2, and the
        biases where the experts have them, as another worker exported them) or from the weights held, whose
        packed copies it shares instead of packing them again (the part held already where one holds exactly
        `expert_ids` and none of them is received); nothing held changes."""
        ids = sorted(expert_ids)
        if not ids:
            return None
        same = next((p for p in self.parts if list(p.expert_ids) == ids and not set(ids) & set(incoming)), None)
        if same is not None:  # one part already holds exactly the new share (a survivor at a rejoin): kept as it is
            return same
        local = [e for e in ids if e not in incoming]
        held = self.export(local) if local else ()
        columns: list[list[torch.Tensor]] = [[] for _ in range(4 if self.spec.expert_bias else 2)]
        for e in ids:
            tensors = incoming[e] if e in incoming else tuple(t[:, local.index(e)] for t in held)
            for column, t in zip(columns, tensors, strict=True):
                column.append(t)
        return self._part(ids, *(torch.stack(c, dim=1) for c in columns), sources=self.parts + self.retiring)

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

    def _part(self, expert_ids: Sequence[int], w1: torch.Tensor, w2: torch.Tensor, *biases: torch.Tensor,
              sources: Sequence[Any] = ()) -> Any:
        """A packed part of `expert_ids` from `[moe layers, experts, ...]` weights (and `b1`, `b2` where the experts
        have biases); an expert some part of `sources` holds keeps that part's packed weights."""
        part = ExpertPart(self.spec, expert_ids, packed=True)
        order = [list(expert_ids).index(e) for e in part.expert_ids]  # the part keeps its ids sorted
        with torch.no_grad():
            for i, layer in enumerate(self.spec.moe_layer_ids):
                part.experts[str(layer)].w1.copy_(w1[i, order])
                part.experts[str(layer)].w2.copy_(w2[i, order])
                if part.biases is not None:
                    part.biases[str(layer)].b1.copy_(biases[0][i, order])
                    part.biases[str(layer)].b2.copy_(biases[1][i, order])
        for layer, packed in part.packed_layers.items():  # packed now, not in the first step that routes to it
            reuse = {}
            for local, expert in enumerate(part.expert_ids):
                holder = next((p for p in sources if expert in p.expert_ids and layer in p.packed_layers), None)
                if holder is not None:
                    reuse[local] = holder.packed_layers[layer].packed_of(int(holder.local_index[expert]))
            packed.refresh(reuse)
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
