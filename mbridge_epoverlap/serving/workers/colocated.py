"""The colocated baseline: every process runs attention and its share of the experts, EP all-to-all over gloo.

Same process count as a disaggregated run, the `sequential` or `two_batch_overlap` order, and every
step of it on one worker (the stage table's two roles merged). The all-to-alls run on the training
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
from mbridge_epoverlap.schedule.program import ATTN, DISPATCH, EXPERTS, POST, Role
from mbridge_epoverlap.schedule.serving_orders import sequential, two_batch_overlap
from mbridge_epoverlap.serving.workers.disaggregated import (
    AttentionWorker,
    MicroBatchHandle,
    role_handlers,
    split_micro_batches,
)
from mbridge_epoverlap.serving.workers.placement import Placement
from mbridge_epoverlap.serving.workers.requests import RequestQueue

ORDERS = {"sequential": lambda m, layers: sequential(m, layers),
          "two_batch_overlap": lambda m, layers: two_batch_overlap(layers, m)}


class ColocatedWorker(AttentionWorker):
    """Attention over its own sequences plus the experts the placement gives its rank.

    Args:
        spec, part, cache, queue: as for `AttentionWorker`.
        experts: this rank's `ExpertPart`.
        placement: expert id -> rank.
        order: "sequential" or "two_batch_overlap".
        micro_batches: micro-batches per step.
        group: the process group of the ranks (None: one process).
        ctx: timeout and communication thread.
    """

    def __init__(self, spec: Any, part: Any, cache: Any, queue: RequestQueue, experts: Any, placement: Placement,
                 order: str, micro_batches: int, group: Any, ctx: CommContext, beat: hb.Heartbeat | None = None,
                 progress: Any = None) -> None:
        super().__init__(spec, part, cache, queue, None, [], placement, micro_batches, ctx.timeout_s, beat, progress)
        self.experts, self.group, self.ctx = experts, group, ctx
        self.world = placement.workers
        self.steps = ORDERS[order](micro_batches, spec.num_layers)
        self.handlers = {**role_handlers(self, Role.ATTENTION), **role_handlers(self, Role.EXPERT)}
        self.timer.compute = frozenset({ATTN.name, POST.name, DISPATCH.name, EXPERTS.name})
        self._flight: dict[int, dict[str, Any]] = {}

    streams = False  # SGLang's two-batch overlap: each forward pass is its own batch, steps do not overlap

    def run(self) -> None:
        while True:
            admitted, retired = self.queue.step_boundary()
            for seq in retired:
                self.cache.free(seq.slot)
            for seq in admitted:
                self.cache.add(seq.slot)
            busy = torch.tensor([len(self.queue.running)], dtype=torch.int64)
            all_reduce(busy, self.group, self.ctx, what="the colocated step agreement")
            if int(busy[0]) == 0:
                break
            handles = split_micro_batches(self.queue.running, self.m)
            started, before = time.perf_counter(), self._tokens_running()
            self._run_steps(handles)
            self._log_step(started, before)
            self.decode_steps += 1
            if self.decode_steps == 1:
                self.timer.mark_steady()
            if self.progress is not None and self.decode_steps % 16 == 0:
                self.progress(f"decode step {self.decode_steps}: {len(self.queue.running)} running, "
                              f"{len(self.queue.waiting)} waiting, {len(self.queue.done)} done")
        self.queue.step_boundary()

    # --- the attention side, as on an attention worker, with the all-to-all in place of M2N ---------
    def _submit(self, job: Any, what: str) -> Any:
        """Run a collective job on the communication thread (in issue order: every rank issues alike)."""
        if self.ctx.thread is None:
            return job()
        return _Flight(self.ctx.submit(job), self.ctx.timeout_s, what)

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        with self.timer.time(DISPATCH.name, record=not h.empty):
            hidden, ids, owners = self._dispatch_rows(h)
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
        if not self.spec.is_moe(layer):
            return
        with self.timer.time("dispatch_wait"):
            flight = self._flight[h.index]
            result = flight.pop(DISPATCH.name)
            flight["rows"], flight["ids"], flight["recv"] = result.wait() if isinstance(result, _Flight) else result

    def _experts(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        flight = self._flight[h.index]
        rows, ids = flight["rows"], flight["ids"]
        if rows.shape[0]:
            with self.timer.time(EXPERTS.name):
                flight["out"] = self.experts(layer, rows, ids)
        else:
            flight["out"] = rows

    def _combine_issue(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        flight = self._flight[h.index]
        out, recv, send, group, ctx = flight["out"].contiguous(), flight["recv"], flight["send"], self.group, self.ctx

        def job() -> torch.Tensor:
            return out if group is None else all_to_all_blocking(out, recv, send, group, ctx, "combine")

        flight["back"] = self._submit(job, "combine")

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        with self.timer.time("combine_wait", record=not h.empty):
            flight = self._flight.pop(h.index)
            back = flight["back"].wait() if isinstance(flight["back"], _Flight) else flight["back"]
        if not h.empty:
            self.timer.record("round_trip", time.perf_counter() - h.issued_at)
        if h.empty:
            return
        tokens, k = h.attn.expert_ids.shape
        out = torch.zeros(tokens, k, self.spec.hidden_size, dtype=back.dtype)
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
