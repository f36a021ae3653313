"""The attention worker's M2N transport: dispatch to the expert workers that hold each expert (a fixed
placement), combine back.

Each dispatch is one `protocol.Dispatch` per expert worker, with a `StepControl`; each token travels once per
expert worker however many of its k experts live there. The replies (`protocol.Combine`) are scattered back
into [tokens, k, hidden] in the pairs' order.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mbridge_epoverlap.schedule.program import COMBINE, DISPATCH, Phase
from mbridge_epoverlap.serving.workers.attention import AttentionSide, MicroBatchHandle
from mbridge_epoverlap.serving.workers.placement import Placement
from mbridge_epoverlap.serving.workers.protocol import Combine, Dispatch, StepControl, Transport, message_tag


class M2NTransport(Transport):
    """Dispatch and combine over an M2N communicator to the expert workers.

    Args:
        side: the attention side it serves.
        comm: the M2N communicator (peers: the expert workers).
        expert_ranks: rank of each expert worker, by worker index.
        placement: expert id -> expert worker index.
    """

    stages = ((DISPATCH, Phase.ISSUE), (COMBINE, Phase.WAIT))

    def __init__(self, side: AttentionSide, comm: Any, expert_ranks: list[int], placement: Placement) -> None:
        self.side, self.comm, self.expert_ranks = side, comm, expert_ranks
        self.owner = torch.tensor(placement.owner, dtype=torch.int64)

    def close(self) -> None:
        self.comm.close()

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return
        tag = message_tag(layer, h.index, side.m)
        control = StepControl(side.active)
        with side.timer.time(DISPATCH.name, record=not h.empty):
            h.routes = []
            hidden, ids = side.dispatch_rows(h)
            owners = self.owner[ids] if ids.numel() else ids
            for worker, rank in enumerate(self.expert_ranks):
                token, slot = (owners == worker).nonzero(as_tuple=True)
                h.routes.append((token, slot))
                if token.numel() == ids.numel():  # every pair here: every token, in order
                    rows, index = hidden, token
                else:  # `token` ascends (row-major): its runs are the tokens this worker needs
                    unique, index = torch.unique_consecutive(token, return_inverse=True)
                    rows = hidden[unique]
                message = Dispatch(control, rows.contiguous(), ids[token, slot], token_index=index)
                h.sends.append(self.comm.isend(rank, message.encode(), tag))
            h.receives = [self.comm.irecv(rank, tag) for rank in self.expert_ranks]
        h.issued_at = time.perf_counter()

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return
        replies = side.wait_combine(h, lambda: [Combine.decode(work.wait(side.timeout_s)) for work in h.receives])
        side.note_combine(h, layer, replies[0])
        if h.empty:
            return
        tokens, k = h.attn.expert_ids.shape
        if len(h.routes) == 1:  # one expert worker answered every pair, in row-major order: no scatter
            h.expert_out = replies[0].outputs.view(tokens, k, side.spec.hidden_size)
            return
        out = torch.zeros(tokens, k, side.spec.hidden_size, dtype=replies[0].outputs.dtype)
        for (token, slot), reply in zip(h.routes, replies, strict=True):
            out[token, slot] = reply.outputs
        h.expert_out = out
