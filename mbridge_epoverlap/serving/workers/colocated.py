"""The colocated baseline: every process runs attention and its share of the experts, EP all-to-all over gloo.

Same process count as a disaggregated run, the `sequential` or `two_batch_overlap` order, and every
step of it on one worker (the stage table's two roles merged): an attention side composed with the
`AllToAllTransport`, which runs the steps between attention and post. The all-to-alls run on the training
runtime's communication thread (`comm.alltoall`), so with two micro-batches one computes while the
other's tokens travel. With one process (`--colocated 1`) this is the single-process engine.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from mbridge_epoverlap.comm.alltoall import CommContext, all_reduce, all_to_all_blocking, exchange_counts
from mbridge_epoverlap.comm.errors import CommError
from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.schedule.program import ATTN, COMBINE, DISPATCH, EXPERTS, POST, Phase
from mbridge_epoverlap.schedule.serving_orders import sequential, two_batch_overlap
from mbridge_epoverlap.serving.workers.attention import AttentionSide, MicroBatchHandle
from mbridge_epoverlap.serving.workers.decode import AttentionWorker
from mbridge_epoverlap.serving.workers.placement import Placement
from mbridge_epoverlap.serving.workers.protocol import Transport
from mbridge_epoverlap.serving.workers.requests import RequestQueue

ORDERS = {"sequential": sequential, "two_batch_overlap": two_batch_overlap}


def colocated_worker(spec: Any, part: Any, cache: Any, queue: RequestQueue, experts: Any, placement: Placement,
                     order: str, micro_batches: int, group: Any, ctx: CommContext, beat: hb.Heartbeat | None = None,
                     progress: Any = None) -> AttentionWorker:
    """Attention over its own sequences plus the experts the placement gives its rank.

    Args:
        spec, part, cache, queue: as for `AttentionSide`.
        experts: this rank's `ExpertPart`.
        placement: expert id -> rank.
        order: "sequential" or "two_batch_overlap".
        micro_batches: micro-batches per step.
        group: the process group of the ranks (None: one process).
        ctx: timeout and communication thread.
    """
    side = AttentionSide(spec, part, cache, queue, micro_batches, ctx.timeout_s,
                         compute_stages=frozenset({ATTN.name, POST.name, DISPATCH.name, EXPERTS.name}))
    return AttentionWorker(side, AllToAllTransport(side, experts, placement, group, ctx),
                           steps=ORDERS[order](micro_batches, spec.num_layers), beat=beat, progress=progress)


class AllToAllTransport(Transport):
    """Dispatch, the rank's experts and combine, as EP all-to-alls among the colocated ranks.

    Args:
        side: the attention side it serves.
        experts: this rank's `ExpertPart`.
        placement: expert id -> rank.
        group: the process group of the ranks (None: one process).
        ctx: timeout and communication thread.
    """

    stages = ((DISPATCH, Phase.ISSUE), (DISPATCH, Phase.WAIT), (EXPERTS, Phase.RUN), (COMBINE, Phase.ISSUE),
              (COMBINE, Phase.WAIT))
    streams = False  # SGLang's two-batch overlap: each forward pass is its own batch, steps do not overlap

    def __init__(self, side: AttentionSide, experts: Any, placement: Placement, group: Any, ctx: CommContext) -> None:
        self.side, self.experts, self.group, self.ctx = side, experts, group, ctx
        self.world = placement.workers
        self.owner = torch.tensor(placement.owner, dtype=torch.int64)
        self._flight: dict[int, dict[str, Any]] = {}

    def another_step(self) -> bool:
        """Whether any rank has running sequences (every rank leaves together)."""
        busy = torch.tensor([len(self.side.queue.running)], dtype=torch.int64)
        all_reduce(busy, self.group, self.ctx, what="the colocated step agreement")
        return int(busy[0]) != 0

    def _submit(self, job: Any, what: str) -> Any:
        """Run a collective job on the communication thread (in issue order: every rank issues alike)."""
        if self.ctx.thread is None:
            return job()
        return _Flight(self.ctx.submit(job), self.ctx.timeout_s, what)

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return
        with side.timer.time(DISPATCH.name, record=not h.empty):
            hidden, ids = side.dispatch_rows(h)
            if self.group is None:  # one process holds every expert: no exchange, no copies of the rows
                self._flight[h.index] = {"local": (hidden, ids)}
                h.issued_at = time.perf_counter()
                return
            owners = self.owner[ids] if ids.numel() else ids
            h.routes = [(owners == rank).nonzero(as_tuple=True) for rank in range(self.world)]
            send = [int(token.numel()) for token, _ in h.routes]
            rows = torch.cat([hidden[token] for token, _ in h.routes]).contiguous()
            expert_ids = torch.cat([ids[token, slot] for token, slot in h.routes]).contiguous()
            group, ctx = self.group, self.ctx

            def job() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
                # Counts first (the split sizes), then the rows and their expert ids, all on one thread.
                recv = exchange_counts(torch.tensor(send, dtype=torch.int64).reshape(-1, 1), group, ctx)
                recv_counts = recv.reshape(-1).tolist()
                if group is None:
                    return rows, expert_ids, recv_counts
                return (all_to_all_blocking(rows, send, recv_counts, group, ctx, "dispatch"),
                        all_to_all_blocking(expert_ids, send, recv_counts, group, ctx, "dispatch (expert ids)"),
                        recv_counts)

            self._flight[h.index] = {"send": send, DISPATCH.name: self._submit(job, DISPATCH.name)}
        h.issued_at = time.perf_counter()

    def _dispatch_wait(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.side.spec.is_moe(layer):
            return
        with self.side.timer.time("dispatch_wait"):
            flight = self._flight[h.index]
            if "local" in flight:
                return
            result = flight.pop(DISPATCH.name)
            flight["rows"], flight["ids"], flight["recv"] = result.wait() if isinstance(result, _Flight) else result

    def _experts(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.side.spec.is_moe(layer):
            return
        flight = self._flight[h.index]
        if "local" in flight:
            # Every (token, slot) pair in row-major order, each token given once (`token_index`).
            hidden, ids = flight.pop("local")
            if ids.numel():
                with self.side.timer.time(EXPERTS.name):
                    index = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1])
                    flight["local_out"] = self.experts(layer, hidden, ids.reshape(-1), token_index=index)
            return
        rows, ids = flight["rows"], flight["ids"]
        if rows.shape[0]:
            with self.side.timer.time(EXPERTS.name):
                flight["out"] = self.experts(layer, rows, ids)
        else:
            flight["out"] = rows

    def _combine_issue(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.side.spec.is_moe(layer):
            return
        flight = self._flight[h.index]
        if "rows" not in flight:  # one process: nothing travels back
            return
        out, recv, send, group, ctx = flight["out"].contiguous(), flight["recv"], flight["send"], self.group, self.ctx

        def job() -> torch.Tensor:
            return out if group is None else all_to_all_blocking(out, recv, send, group, ctx, "combine")

        flight["back"] = self._submit(job, "combine")

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        side = self.side
        if not side.spec.is_moe(layer):
            return

        def wait() -> tuple[dict[str, Any], torch.Tensor | None]:
            flight = self._flight.pop(h.index)
            if "back" not in flight:  # one process: the experts' output is here already (or nothing ran)
                return flight, flight.get("local_out")
            return flight, flight["back"].wait() if isinstance(flight["back"], _Flight) else flight["back"]

        flight, back = side.wait_combine(h, wait)
        if h.empty or back is None:
            return
        if "local_out" in flight:  # row-major (token, slot) order already
            h.expert_out = back.view(*h.attn.expert_ids.shape, side.spec.hidden_size)
            return
        tokens, k = h.attn.expert_ids.shape
        out = torch.zeros(tokens, k, side.spec.hidden_size, dtype=back.dtype)
        for (token, slot), part in zip(h.routes, back.split(flight["send"]), strict=True):
            out[token, slot] = part
        h.expert_out = out


class _Flight:
    """A collective job on the communication thread; `wait` bounds the wait (the job bounds the collective)."""

    def __init__(self, future: Future[Any], timeout_s: float, what: str) -> None:
        self.future, self.timeout_s, self.what = future, timeout_s, what

    def wait(self) -> Any:
        try:
            return self.future.result(timeout=3 * self.timeout_s + 5.0)
        except FutureTimeout:
            raise CommError(f"{self.what} did not complete within {3 * self.timeout_s + 5.0:g} s") from None


def colocated_placement(num_experts: int, processes: int) -> Placement:
    """Each process holds an equal contiguous share of the experts."""
    return Placement.balanced(num_experts, processes)
