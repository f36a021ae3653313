"""The colocated layout: every process runs attention over its own sequences and its share of the experts.

Same process count as a disaggregated run, the `sequential` or `two_batch_overlap` order, and every
step of it on one worker (the stage table's two roles merged): an attention side composed with the
`AllToAllTransport`, which runs the steps between attention and post as an EP all-to-all over the plan's M2N
backend (shared memory on one host). Each process streams only its share of the expert weights per step, so
on a CPU whose decode is bound by that stream N processes split it N ways. With one process
(`--colocated 1`) this is the single-process engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mbridge_epoverlap.comm.alltoall import CommContext
from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.schedule.program import ATTN, COMBINE, DISPATCH, EXPERTS, POST, Phase
from mbridge_epoverlap.schedule.serving_orders import sequential, two_batch_overlap
from mbridge_epoverlap.serving.workers.attention import AttentionSide, MicroBatchHandle
from mbridge_epoverlap.serving.workers.decode import AttentionWorker
from mbridge_epoverlap.serving.workers.placement import Placement
from mbridge_epoverlap.serving.workers.protocol import Combine, Dispatch, StepControl, Transport, message_tag
from mbridge_epoverlap.serving.workers.requests import RequestQueue

ORDERS = {"sequential": sequential, "two_batch_overlap": two_batch_overlap}


def colocated_worker(spec: Any, part: Any, cache: Any, queue: RequestQueue, experts: Any, placement: Placement,
                     order: str, micro_batches: int, group: Any, ctx: CommContext, beat: hb.Heartbeat | None = None,
                     progress: Any = None, comm: Any = None) -> AttentionWorker:
    """Attention over its own sequences plus the experts the placement gives its rank.

    Args:
        spec, part, cache, queue: as for `AttentionSide`.
        experts: this rank's `ExpertPart`.
        placement: expert id -> rank.
        order: "sequential" or "two_batch_overlap".
        micro_batches: micro-batches per step.
        group: the process group of the ranks (None: one process).
        ctx: timeout of the step agreement.
        comm: this rank's M2N communicator to the other ranks (None: one process).
    """
    side = AttentionSide(spec, part, cache, queue, micro_batches, ctx.timeout_s,
                         compute_stages=frozenset({ATTN.name, POST.name, DISPATCH.name, EXPERTS.name}))
    return AttentionWorker(side, AllToAllTransport(side, experts, placement, group, ctx, comm),
                           steps=ORDERS[order](micro_batches, spec.num_layers), beat=beat, progress=progress)


class AllToAllTransport(Transport):
    """Dispatch, the rank's experts and combine, as an EP all-to-all among the colocated ranks over M2N.

    Each token travels once to each other rank holding any of its k experts (with the pairs' `token_index`,
    as the M2N transport to expert workers sends it), the pairs of this rank's own experts never leave the
    process, each rank runs its own and the others' pairs in one expert pass and answers every dispatch
    with the outputs of its pairs in their order. Over shared
    memory a message is one copy into the peer's slot: the gloo all-to-all this replaced cost 6-7 ms a layer
    at 64 decoding sequences (counts, rows and ids as three collectives on a communication thread), more than
    the attention of its half of the batch.

    Args:
        side: the attention side it serves.
        experts: this rank's `ExpertPart`.
        placement: expert id -> rank.
        group: the process group of the ranks (None: one process); it gives this rank's number.
        ctx: timeout of the step agreement.
        comm: this rank's M2N communicator to every other rank (None: one process).
    """

    stages = ((DISPATCH, Phase.ISSUE), (DISPATCH, Phase.WAIT), (EXPERTS, Phase.RUN), (COMBINE, Phase.ISSUE),
              (COMBINE, Phase.WAIT))
    streams = False  # SGLang's two-batch overlap: each forward pass is its own batch, steps do not overlap

    def __init__(self, side: AttentionSide, experts: Any, placement: Placement, group: Any, ctx: CommContext,
                 comm: Any = None) -> None:
        if (group is None) != (comm is None):
            raise ValueError("colocated ranks need both a process group and an M2N communicator (or neither)")
        self.side, self.experts, self.group, self.ctx, self.comm = side, experts, group, ctx, comm
        self.rank = 0 if group is None else group.rank()
        self.world = placement.workers
        self.owner = torch.tensor(placement.owner, dtype=torch.int64)
        self._flight: dict[int, dict[str, Any]] = {}
        self._idle = False  # no rank had a sequence at the last step agreement

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()

    def another_step(self) -> bool:
        """Whether any rank has work: running sequences, or (online) it still serves (every rank leaves
        together). It also settles `nothing_to_decode`: no rank has a sequence.

        Each rank's flags go to every other rank over the M2N channel of the step's dispatches: one copy into
        the peer's slot. The gloo all-reduce it replaced took 3.6-4.9 ms a step online (median, 2 ranks sharing
        2 cores with the HTTP front end and a client), ~8 % of a 64-sequence decode step.
        """
        flags = torch.tensor([int(self.side.active), int(bool(self.side.queue.running))], dtype=torch.int64)
        if self.comm is not None:
            tag = 2 * message_tag(self.side.spec.num_layers, 0, self.side.m)  # after every tag of the layers
            sends = [self.comm.isend(rank, [flags.clone()], tag) for rank in self._peers()]
            answers = [self.comm.irecv(rank, tag) for rank in self._peers()]
            for work in answers:
                flags = torch.maximum(flags, work.wait(self.side.timeout_s)[0])
            for work in sends:
                work.wait(self.side.timeout_s)
        self._idle = not bool(flags[1])
        return bool(flags[0])

    def nothing_to_decode(self) -> bool:
        return self._idle

    def _peers(self) -> list[int]:
        return [rank for rank in range(self.world) if rank != self.rank]

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return
        with side.timer.time(DISPATCH.name, record=not h.empty):
            hidden, ids = side.dispatch_rows(h)
            flight: dict[str, Any] = {"hidden": hidden}
            self._flight[h.index] = flight
            if self.comm is None:  # one process holds every expert: no exchange, no copies of the rows
                flight["local"] = (ids.reshape(-1), torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1]))
                h.issued_at = time.perf_counter()
                return
            tag = 2 * message_tag(layer, h.index, side.m)
            owners = self.owner[ids] if ids.numel() else ids
            h.routes = [(owners == rank).nonzero(as_tuple=True) for rank in range(self.world)]
            control = StepControl(True)
            for rank in self._peers():
                token, slot = h.routes[rank]
                # `token` ascends (row-major pairs): its runs are the tokens that rank needs, each sent once.
                unique, index = torch.unique_consecutive(token, return_inverse=True)
                message = Dispatch(control, hidden[unique].contiguous(), ids[token, slot], token_index=index)
                h.sends.append(self.comm.isend(rank, message.encode(), tag))
            token, slot = h.routes[self.rank]
            flight["local"] = (ids[token, slot], token)
            flight["local_pairs"] = int(token.numel())
            flight["dispatches"] = {rank: self.comm.irecv(rank, tag) for rank in self._peers()}
            flight["replies"] = {rank: self.comm.irecv(rank, tag + 1) for rank in self._peers()}
        h.issued_at = time.perf_counter()

    def _dispatch_wait(self, h: MicroBatchHandle, layer: int) -> None:
        """Nothing: the other ranks' tokens are awaited in the expert stage, which runs them with its own."""

    def _experts(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return
        flight = self._flight[h.index]
        ids, index = flight.pop("local")
        hidden, works = flight["hidden"], flight.pop("dispatches", {})
        if works:
            # The other ranks' pairs and this rank's own in one expert pass: in decode each expert's weights are
            # streamed from memory once per pass (that stream, not the arithmetic, is the decode expert time),
            # and each row's result does not depend on the other rows of its expert's GEMM.
            with side.timer.time("dispatch_wait"):
                messages = {rank: Dispatch.decode(work.wait(side.timeout_s)) for rank, work in works.items()}
            tokens, all_ids, all_index, offset = [hidden], [ids], [index], hidden.shape[0]
            for message in messages.values():
                tokens.append(message.tokens)
                all_ids.append(message.expert_ids)
                all_index.append(message.token_index + offset)
                offset += message.tokens.shape[0]
            hidden, ids, index = torch.cat(tokens), torch.cat(all_ids), torch.cat(all_index)
        with side.timer.time(EXPERTS.name, record=ids.numel() > 0):
            out = (self.experts(layer, hidden, ids, token_index=index) if ids.numel()
                   else hidden.new_zeros(0, side.spec.hidden_size))
        if not works:
            flight["local_out"] = out
            return
        sizes = [flight["local_pairs"]] + [message.pairs for message in messages.values()]
        parts = out.split(sizes)
        flight["local_out"] = parts[0]
        tag = 2 * message_tag(layer, h.index, side.m) + 1
        for rank, part in zip(messages, parts[1:], strict=True):
            h.sends.append(self.comm.isend(rank, Combine(False, part).encode(), tag))

    def _combine_issue(self, h: MicroBatchHandle, layer: int) -> None:
        """Nothing: each rank's outputs left in the expert stage as soon as they were computed."""

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return

        def wait() -> dict[int, torch.Tensor]:
            works = self._flight[h.index].get("replies", {})
            return {rank: Combine.decode(work.wait(side.timeout_s)).outputs for rank, work in works.items()}

        replies = side.wait_combine(h, wait)
        flight = self._flight.pop(h.index)
        if h.empty:
            return
        local = flight["local_out"]
        tokens, k = h.attn.expert_ids.shape
        if not replies:  # one process: every pair in row-major (token, slot) order already
            h.expert_out = local.view(tokens, k, side.spec.hidden_size)
            return
        out = torch.empty(tokens, k, side.spec.hidden_size, dtype=local.dtype)
        for rank, (token, slot) in enumerate(h.routes):
            out[token, slot] = local if rank == self.rank else replies[rank]
        h.expert_out = out


def colocated_placement(num_experts: int, processes: int) -> Placement:
    """Each process holds an equal contiguous share of the experts."""
    return Placement.balanced(num_experts, processes)
