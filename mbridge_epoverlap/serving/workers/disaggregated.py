"""Attention and expert workers of disaggregated decode: the third executor of the stage program.

Each worker executes its own role's steps of `serving_orders.ping_pong(m, L)` (the stage table says
which role runs each step: attention runs `attn` and `post`, issues `dispatch` and waits for
`combine`; experts wait for `dispatch`, run `experts` and issue `combine`). The handlers are looked up
from the table exactly as the training executor looks up its own, and a decode micro-batch's state
travels between the steps in a `MicroBatchHandle`.

Decode steps run back to back without draining the pipeline (`streams`): a worker numbers its rounds
across steps (round `s * L + l` is layer `l` of decode step `s`, `serving_orders.ping_pong_round`), so a
micro-batch's next token enters layer 0 while the other micro-batches are still in the last layer of
the previous step, exactly as layer l + 1 follows layer l. Each micro-batch has its own step boundary,
just before its layer-0 attention: it retires its finished sequences and admits waiting ones
(continuous batching), up to its share of the batch limit. A worker class with `streams = False`
drains the pipeline at the end of every step instead: one `ping_pong(m, L)` per step, one boundary for
all micro-batches (for changes that need every micro-batch at one boundary).

Every dispatch carries a one-element control tensor: whether the sending attention worker had any
work left when micro-batch 0 started the step. When no attention worker had any, the expert workers
answer micro-batch 0's first MoE combine of that step with "stop", and everybody finishes that step
(every micro-batch empty) and leaves; so no worker needs a side channel.

Messages (M2N): dispatch attention -> expert `[control int64[1], tokens [u, h], token_index int64[n],
expert_ids int64[n]]` for the n (token, slot) pairs routed to that expert worker, in row-major (token, k)
order: each token travels once per expert worker however many of its k experts live there (as DeepEP's
dispatch does), and pair i reads row `token_index[i]` of `tokens`. A message of three tensors
`[control, rows [n, h], expert_ids]` (one row per pair, as the elastic workers send) is read too.
Combine expert -> attention `[control int64[1], outputs [n, h]]` in the pairs' order. Gate weights stay on the
attention worker: `post_step` sums the k outputs in a fixed order, so the result is bitwise the
single-process one whatever the placement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.schedule.program import ATTN, DISPATCH, EXPERTS, FORWARD_STAGES, POST, Phase, Role, Step
from mbridge_epoverlap.schedule.serving_orders import ping_pong, ping_pong_round
from mbridge_epoverlap.serving.workers.placement import Placement
from mbridge_epoverlap.serving.workers.requests import RequestQueue, RunningSequence, micro_batch_limit
from mbridge_epoverlap.serving.workers.stage_timer import StageTimer

ACTIVE, IDLE = 1, 0
CONTINUE, STOP = 1, 0


def role_handlers(worker: object, role: Role) -> dict[tuple[str, Phase], Callable[[Any, int], None]]:
    """`(stage, phase) -> method` for every forward step the stage table gives `role`.

    The method of a RUN step is `_<stage>`, of a COMM step `_<stage>_<phase>` (as in the training
    executor); a worker missing one fails here, at start-up.
    """
    handlers = {}
    for stage in FORWARD_STAGES:
        for phase in stage.phases:
            if Step(0, 0, stage.name, phase).role is role:
                name = f"_{stage.name}" if phase is Phase.RUN else f"_{stage.name}_{phase.value}"
                handlers[(stage.name, phase)] = getattr(worker, name)
    return handlers


def role_steps(order: Sequence[Step], role: Role) -> list[Step]:
    """The steps of `order` that a worker of `role` executes, in order."""
    return [step for step in order if step.role is role]


def message_tag(layer: int, micro_batch: int, micro_batches: int) -> int:
    """The M2N tag of one (layer, micro-batch) transfer; unique within a decode step."""
    return layer * micro_batches + micro_batch


@dataclass
class MicroBatchHandle:
    """A decode micro-batch's state as it travels through the layer program on an attention worker."""

    index: int
    seqs: list[RunningSequence] = field(default_factory=list)
    batch: Any = None  # TokenBatch
    x: torch.Tensor | None = None  # hidden states entering the next attention
    last_rows: list[int] = field(default_factory=list)  # row of each sequence's last token
    attn: Any = None  # AttnOut of the current layer
    routes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per expert worker: (token, slot)
    receives: list[Any] = field(default_factory=list)  # combine Works, one per expert worker
    sends: list[Any] = field(default_factory=list)
    expert_out: torch.Tensor | None = None
    issued_at: float = 0.0  # when the current layer's dispatch was issued
    cache: Any = None  # its own KVCache when sequences stay in this micro-batch (streamed steps)

    @property
    def empty(self) -> bool:
        return not self.seqs


def split_micro_batches(seqs: Sequence[RunningSequence], micro_batches: int) -> list[MicroBatchHandle]:
    """Deal the running sequences into `micro_batches` handles, balanced by token count."""
    handles = [MicroBatchHandle(i) for i in range(micro_batches)]
    loads = [0] * micro_batches
    for seq in seqs:
        tokens = seq.length if not seq.prefilled else 1
        target = loads.index(min(loads))
        handles[target].seqs.append(seq)
        loads[target] += tokens
    return handles


class AttentionWorker:
    """Owns a set of sequences, their KV cache, attention, router and gating.

    `streams`: decode steps follow each other without draining the pipeline (see the module docstring).

    Args:
        spec: the model spec.
        part: this worker's `AttentionPart` (loaded weights).
        cache: its `KVCache`.
        queue: its requests (continuous batching).
        comm: the M2N communicator (peers: the expert workers).
        expert_ranks: rank of each expert worker, by worker index.
        placement: expert id -> expert worker index.
        micro_batches: m, micro-batches in flight.
        timeout_s: limit of every wait.
        beat: heartbeat writer (step index, computing or communicating).
        progress: called with a line every few steps (rank 0 only).
    """

    def __init__(self, spec: Any, part: Any, cache: Any, queue: RequestQueue, comm: Any, expert_ranks: list[int],
                 placement: Placement, micro_batches: int, timeout_s: float, beat: hb.Heartbeat | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        from mbridge_epoverlap.serving.model.parts import TokenBatch
        from mbridge_epoverlap.serving.model.sampling import greedy

        self.spec, self.part, self.cache, self.queue, self.comm = spec, part, cache, queue, comm
        self.expert_ranks, self.m, self.timeout_s = expert_ranks, micro_batches, timeout_s
        self.owner = torch.tensor(placement.owner, dtype=torch.int64)
        self.steps = role_steps(ping_pong(micro_batches, spec.num_layers), Role.ATTENTION)
        self.handlers = role_handlers(self, Role.ATTENTION)
        self.first_moe = spec.moe_layer_ids[0]
        self.timer = StageTimer(frozenset({ATTN.name, POST.name, DISPATCH.name}))
        self.beat, self.progress = beat, progress
        self.TokenBatch = TokenBatch
        self.greedy = greedy
        self.decode_steps = 0
        self.stop = False
        self.active = False
        self.tokens_generated = 0
        self.step_log: list[tuple[float, int]] = []  # (seconds, tokens generated) of each decode step
        self._handles: list[MicroBatchHandle] = []

    def _log_step(self, started: float, tokens_before: int) -> None:
        tokens = sum(len(s.output_ids) for s in self.queue.running) - tokens_before
        self.step_log.append((time.perf_counter() - started, tokens))

    def _tokens_running(self) -> int:
        return sum(len(s.output_ids) for s in self.queue.running)

    streams = True

    def run(self) -> None:
        """Decode until every attention worker is out of requests."""
        if self.streams:
            self._run_stream()
            return
        while not self.stop:
            admitted, retired = self.queue.step_boundary()
            for seq in retired:
                self.cache.free(seq.slot)
            for seq in admitted:
                self.cache.add(seq.slot)
            self.active = bool(self.queue.running)
            handles = split_micro_batches(self.queue.running, self.m)
            started, before = time.perf_counter(), self._tokens_running()
            self._run_steps(handles)
            for h in handles:
                for work in h.sends:
                    work.wait(self.timeout_s)
            self._log_step(started, before)
            self.decode_steps += 1
            if self.decode_steps == 1:
                self.timer.mark_steady()
            self._report_progress()
        for seq in self.queue.running:
            if seq.finished:
                self.cache.free(seq.slot)
        self.queue.step_boundary()

    def _run_stream(self) -> None:
        """Rounds 0, 1, 2, ... of the ping-pong across decode steps, until the experts say stop; then the
        rest of that step and the tail, so the pipeline drains once, at the end."""
        layers = self.spec.num_layers
        # A sequence stays in its micro-batch from admission to retirement, so each micro-batch keeps its
        # own KV cache: its sequences hold consecutive rows, which decode attention reads without a copy.
        self._handles = handles = [MicroBatchHandle(i, cache=self.cache if i == 0 else self.cache.empty_like())
                                   for i in range(self.m)]
        first = role_steps(ping_pong_round(self.m, 0), Role.ATTENTION)
        steady = role_steps(ping_pong_round(self.m, 1), Role.ATTENTION)  # layer 0 here: the previous round's
        end: int | None = None  # the round that only drains (set once the experts said stop)
        mark = (time.perf_counter(), 0)
        sent: list[Any] = []
        round_ = 0
        while end is None or round_ <= end:
            if round_ and round_ % layers == 0:
                now = time.perf_counter()
                self.step_log.append((now - mark[0], self.tokens_generated - mark[1]))
                mark = (now, self.tokens_generated)
                self.decode_steps = round_ // layers
                if self.decode_steps == 1:
                    self.timer.mark_steady()
                self._report_progress()
            for index, step in enumerate(first if round_ == 0 else steady):
                virtual = round_ - 1 + step.layer if round_ else step.layer
                if end is not None and virtual >= end:
                    continue  # past the last step: only the tail (waits and posts of the last layer) is left
                if self.beat is not None:
                    self.beat.beat(self.decode_steps, index, hb.COMPUTE if step.phase is Phase.RUN else hb.COMM)
                self.handlers[(step.stage, step.phase)](handles[step.micro_batch], virtual % layers)
                if self.stop and end is None:
                    end = (virtual // layers + 1) * layers
            for work in sent:  # the previous round's sends: received by now, nothing waits here
                work.wait(self.timeout_s)
            sent = [work for h in handles for work in h.sends]
            for h in handles:
                h.sends = []
            round_ += 1
        for work in sent:
            work.wait(self.timeout_s)
        self.step_log.append((time.perf_counter() - mark[0], self.tokens_generated - mark[1]))
        self.decode_steps = (end or 0) // layers
        for h in handles:
            for seq in self.queue.retire(h.seqs):
                h.cache.free(seq.slot)

    def _report_progress(self) -> None:
        if self.progress is not None and self.decode_steps % 16 == 0:
            done = len(self.queue.done) + sum(s.finished for s in self.queue.running)
            self.progress(f"decode step {self.decode_steps}: {len(self.queue.running)} running, "
                          f"{len(self.queue.waiting)} waiting, {done} done")

    def _refill(self, h: MicroBatchHandle) -> None:
        """Micro-batch `h`'s step boundary: retire its finished sequences, admit its share of the waiting ones.

        The share is what is waiting spread over this and the later micro-batches of the round (so a first
        batch of requests is dealt evenly), capped by this micro-batch's part of the batch limit.
        """
        for seq in self.queue.retire(h.seqs):
            h.cache.free(seq.slot)
        h.seqs = [seq for seq in h.seqs if not seq.finished]
        limit = micro_batch_limit(self.queue.max_batch, self.m, h.index)
        share = -(-len(self.queue.waiting) // (self.m - h.index))
        for seq in self.queue.admit(min(share, limit - len(h.seqs))):
            h.cache.add(seq.slot)
            h.seqs.append(seq)
        if h.index == 0:  # the control every dispatch of this step carries (read by the experts at micro-batch 0)
            self.active = bool(self.queue.waiting) or any(not s.finished for g in self._handles for s in g.seqs)

    # --- the attention role's steps ----------------------------------------------------------------
    def _attn(self, h: MicroBatchHandle, layer: int) -> None:
        if self.streams and layer == 0:
            self._refill(h)
        if h.empty:
            return
        with self.timer.time(ATTN.name):
            if layer == 0:
                self._build_batch(h)
            h.attn = self.part.attention_step(layer, h.x, h.batch, h.cache or self.cache)

    def _build_batch(self, h: MicroBatchHandle) -> None:
        """The micro-batch's tokens: a new sequence's whole prompt (prefill), else its last token."""
        chunks = []
        for seq in h.seqs:
            if seq.prefilled:  # one new token, at the end of what the cache holds
                chunks.append((seq.slot, seq.output_ids[-1:], seq.length - 1))
            else:
                chunks.append((seq.slot, list(seq.request.prompt_ids) + seq.output_ids, 0))
        h.batch = self.TokenBatch.from_chunks(chunks)
        h.last_rows = h.batch.last_rows()[0].tolist()
        h.x = self.part.embed(h.batch.token_ids)

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        tag = message_tag(layer, h.index, self.m)
        control = torch.tensor([ACTIVE if self.active else IDLE], dtype=torch.int64)
        with self.timer.time(DISPATCH.name, record=not h.empty):
            h.routes = []
            hidden, ids, owners = self._dispatch_rows(h)
            for worker, rank in enumerate(self.expert_ranks):
                token, slot = (owners == worker).nonzero(as_tuple=True)
                h.routes.append((token, slot))
                if token.numel() == ids.numel():  # every pair here: every token, in order
                    rows, index = hidden, token
                else:  # `token` ascends (row-major): its runs are the tokens this worker needs
                    unique, index = torch.unique_consecutive(token, return_inverse=True)
                    rows = hidden[unique]
                h.sends.append(self.comm.isend(rank, [control, rows.contiguous(), index, ids[token, slot]], tag))
            h.receives = [self.comm.irecv(rank, tag) for rank in self.expert_ranks]
        h.issued_at = time.perf_counter()

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        with self.timer.time("combine_wait", record=not h.empty):
            replies = [work.wait(self.timeout_s) for work in h.receives]
        if not h.empty:
            self.timer.record("round_trip", time.perf_counter() - h.issued_at)
        h.receives = []
        if layer == self.first_moe and h.index == 0 and int(replies[0][0][0]) == STOP:
            self.stop = True
        if h.empty:
            return
        tokens, k = h.attn.expert_ids.shape
        if len(h.routes) == 1:  # one expert worker answered every pair, in row-major order: no scatter
            h.expert_out = replies[0][1].view(tokens, k, self.spec.hidden_size)
            return
        out = torch.zeros(tokens, k, self.spec.hidden_size, dtype=replies[0][1].dtype)
        for (token, slot), reply in zip(h.routes, replies, strict=True):
            out[token, slot] = reply[1]
        h.expert_out = out

    def _post(self, h: MicroBatchHandle, layer: int) -> None:
        if h.empty:
            return
        with self.timer.time(POST.name):
            expert_out = h.expert_out if self.spec.is_moe(layer) else None
            h.x = self.part.post_step(layer, h.attn, expert_out)
            h.attn, h.expert_out = None, None
            if layer == self.spec.num_layers - 1:
                for seq, token in zip(h.seqs, self.greedy(self.part.logits(h.x[h.last_rows])), strict=True):
                    self.queue.append_token(seq, int(token))
                self.tokens_generated += len(h.seqs)

    def _dispatch_rows(self, h: MicroBatchHandle) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [T, hidden], expert ids [T, k], owning worker of each id) of a micro-batch to dispatch; an
        empty micro-batch still takes part in the exchange, with zero rows."""
        if h.empty:
            hidden = torch.zeros(0, self.spec.hidden_size, dtype=self.spec.torch_dtype())
            ids = torch.zeros(0, self.spec.top_k, dtype=torch.int64)
        else:
            hidden, ids = h.attn.tokens, h.attn.expert_ids
        return hidden, ids, self.owner[ids] if ids.numel() else ids

    def _run_steps(self, handles: list[MicroBatchHandle]) -> None:
        """One decode step: this worker's steps of the order, in order, each reported to the heartbeat."""
        for index, step in enumerate(self.steps):
            if self.beat is not None:
                self.beat.beat(self.decode_steps, index, hb.COMPUTE if step.phase is Phase.RUN else hb.COMM)
            self.handlers[(step.stage, step.phase)](handles[step.micro_batch], step.layer)


class ExpertWorker:
    """Owns a subset of the routed experts (by the placement table) and serves every attention worker.

    Args:
        spec: the model spec.
        part: this worker's `ExpertPart`.
        comm: the M2N communicator (peers: the attention workers).
        attention_ranks: rank of each attention worker.
        micro_batches: m.
        timeout_s: limit of every wait.
        beat: heartbeat writer.
    """

    def __init__(self, spec: Any, part: Any, comm: Any, attention_ranks: list[int], micro_batches: int,
                 timeout_s: float, beat: hb.Heartbeat | None = None) -> None:
        self.spec, self.part, self.comm = spec, part, comm
        self.attention_ranks, self.m, self.timeout_s = attention_ranks, micro_batches, timeout_s
        self.steps = role_steps(ping_pong(micro_batches, spec.num_layers), Role.EXPERT)
        self.handlers = role_handlers(self, Role.EXPERT)
        self.first_moe = spec.moe_layer_ids[0]
        self.timer = StageTimer(frozenset({EXPERTS.name}))
        self.beat = beat
        self.decode_steps = 0
        self.stop = False
        self._received: dict[int, list[list[torch.Tensor]]] = {}
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._sends: list[Any] = []
        self.tokens_served = 0

    streams = True  # as the attention workers: both sides must run the same rounds

    def run(self) -> None:
        if self.streams:
            self._run_stream()
            return
        while not self.stop:
            for index, step in enumerate(self.steps):
                if self.beat is not None:
                    self.beat.beat(self.decode_steps, index, hb.COMPUTE if step.phase is Phase.RUN else hb.COMM)
                self.handlers[(step.stage, step.phase)](step.micro_batch, step.layer)
            for work in self._sends:
                work.wait(self.timeout_s)
            self._sends = []
            self.decode_steps += 1

    def _run_stream(self) -> None:
        """The expert side of the rounds the attention workers run (see `AttentionWorker._run_stream`)."""
        layers = self.spec.num_layers
        steps = role_steps(ping_pong_round(self.m, 0), Role.EXPERT)  # an expert round touches only its layer
        end: int | None = None
        sent: list[Any] = []
        round_ = 0
        while end is None or round_ < end:
            self.decode_steps = round_ // layers
            if round_ == layers:
                self.timer.mark_steady()
            for index, step in enumerate(steps):
                if self.beat is not None:
                    self.beat.beat(self.decode_steps, index, hb.COMPUTE if step.phase is Phase.RUN else hb.COMM)
                self.handlers[(step.stage, step.phase)](step.micro_batch, round_ % layers)
                if self.stop and end is None:
                    end = (round_ // layers + 1) * layers
            for work in sent:
                work.wait(self.timeout_s)
            sent, self._sends = self._sends, []
            round_ += 1
        for work in sent:
            work.wait(self.timeout_s)
        self.decode_steps = round_ // layers

    def _dispatch_wait(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        tag = message_tag(layer, mb, self.m)
        with self.timer.time("dispatch_wait"):
            works = [self.comm.irecv(rank, tag) for rank in self.attention_ranks]
            self._received[mb] = [work.wait(self.timeout_s) for work in works]
        if layer == self.first_moe and mb == 0:
            self.stop = all(int(msg[0][0]) == IDLE for msg in self._received[mb])

    def _experts(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        messages = self._received.pop(mb)
        counts = [msg[-1].shape[0] for msg in messages]  # expert ids come last in both message forms
        total = sum(counts)
        if total == 0:
            self._outputs[mb] = [msg[1][:0] for msg in messages]
            return
        with self.timer.time(EXPERTS.name):
            tokens = torch.cat([msg[1] for msg in messages])
            ids = torch.cat([msg[-1] for msg in messages])
            if all(len(msg) == 4 for msg in messages):
                offsets = [0]
                for msg in messages[:-1]:
                    offsets.append(offsets[-1] + msg[1].shape[0])
                index = torch.cat([msg[2] + offset for msg, offset in zip(messages, offsets, strict=True)])
                out = self.part(layer, tokens, ids, token_index=index)
            else:
                out = self.part(layer, tokens, ids)
        self.tokens_served += total
        self._outputs[mb] = list(out.split(counts))

    def _combine_issue(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        tag = message_tag(layer, mb, self.m)
        control = torch.tensor([STOP if self.stop else CONTINUE], dtype=torch.int64)
        for rank, out in zip(self.attention_ranks, self._outputs.pop(mb), strict=True):
            self._sends.append(self.comm.isend(rank, [control, out.contiguous()], tag))
