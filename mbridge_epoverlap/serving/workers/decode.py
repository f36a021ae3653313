"""The attention worker's decode loop: an attention side composed with a transport, run through the stage order.

Each worker executes its own role's steps of `serving_orders.ping_pong(m, L)` (the stage table says which role
runs each step: attention runs `attn` and `post`, issues `dispatch` and waits for `combine`; experts wait for
`dispatch`, run `experts` and issue `combine`); a colocated worker runs every step of its order. The handlers
are looked up from the table as the training executor looks up its own (`schedule.program.bind_handlers`):
`attn` and `post` on the `AttentionSide`, the rest on the transport.

Decode steps run back to back without draining the pipeline when the transport allows it (`streams`): the
worker numbers its rounds across steps (round `s * L + l` is layer `l` of decode step `s`,
`serving_orders.ping_pong_round`), so a micro-batch's next token enters layer 0 while the other micro-batches
are still in the last layer of the previous step, exactly as layer l + 1 follows layer l. Each micro-batch has
its own step boundary, just before its layer-0 attention: it retires its finished sequences and admits waiting
ones (continuous batching), up to its share of the batch limit. The transport's step boundary
(`Transport.begin_step`, `end_step`) falls between rounds: before the first round of each step, whose
dispatches all belong to that step. Otherwise every step drains: one order per step, one boundary for all
micro-batches (the colocated baseline, and a transport that does not stream).

Every dispatch says whether its attention worker had work when micro-batch 0 started the step; when none had,
the expert workers answer micro-batch 0's first MoE combine of that step with "stop", and everybody finishes
that step (every micro-batch empty) and leaves; so no worker needs a side channel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.schedule.program import ATTN, Phase, Role, Step, bind_handlers, is_communicating
from mbridge_epoverlap.schedule.serving_orders import ping_pong, ping_pong_round
from mbridge_epoverlap.serving.workers.attention import AttentionSide, MicroBatchHandle, split_micro_batches
from mbridge_epoverlap.serving.workers.protocol import Transport


def role_steps(order: Sequence[Step], role: Role) -> list[Step]:
    """The steps of `order` that a worker of `role` executes, in order."""
    return [step for step in order if step.role is role]


def beat_step(beat: hb.Heartbeat | None, decode_step: int, index: int, step: Step) -> None:
    """Tell the heartbeat which step runs next and whether it computes or communicates."""
    if beat is not None:
        beat.beat(decode_step, index, hb.COMM if is_communicating(step) else hb.COMPUTE)


class AttentionWorker:
    """An attention side and a transport, decoding until every attention worker is out of requests.

    Args:
        side: the attention side (sequences, cache, attention).
        transport: moves the tokens to the experts and back (`protocol.Transport`).
        steps: the steps of the order this worker executes (default: the attention role's steps of
            `ping_pong(m, L)`).
        beat: heartbeat writer (step index, computing or communicating).
        progress: called with a line every few steps (rank 0 only).
    """

    def __init__(self, side: AttentionSide, transport: Transport, *, steps: Sequence[Step] | None = None,
                 beat: hb.Heartbeat | None = None, progress: Callable[[str], None] | None = None) -> None:
        self.side, self.transport = side, transport
        self.streams = transport.streams
        layers = side.spec.num_layers
        self.steps = list(steps) if steps is not None else role_steps(ping_pong(side.m, layers), Role.ATTENTION)
        self.handlers = {**bind_handlers(side, side.stages), **bind_handlers(transport, transport.stages)}
        missing = sorted({(s.stage, s.phase.value) for s in self.steps} - {(n, p.value) for n, p in self.handlers})
        if missing:
            raise ValueError(f"no handler for the steps {missing} of this worker's order")
        self.beat, self.progress = beat, progress

    @property
    def decode_steps(self) -> int:
        return self.side.decode_steps

    def run(self) -> None:
        try:
            if self.streams:
                self._run_stream()
            else:
                self._run_drained()
        finally:
            self.transport.finish()

    def report(self, *, failed: bool = False) -> dict[str, Any]:
        queue = self.side.queue
        report: dict[str, Any] = {"decode_steps": self.side.decode_steps, "streamed": self.streams}
        if self.transport.events is not None:
            report["events"] = self.transport.events
            report["token_times"] = {s.request.id: list(s.token_times) for s in queue.running + queue.done}
        report["stages"] = self.side.timer.summary()
        report["completions"] = queue.completions(failed=failed)
        report["step_log"] = self.side.step_log
        report["expert_load"] = {"layers": self.side.spec.moe_layer_ids, "counts": self.side.expert_load.tolist()}
        return report

    def close(self) -> None:
        self.transport.close()
        if self.side.source is not None:  # online: the last tokens (and `Done`) leave before the process does
            self.side.source.close()

    def _report_progress(self) -> None:
        line = self.side.progress_line() if self.progress is not None else None
        if line is not None:
            self.progress(line)

    def _run_drained(self) -> None:
        """One order per decode step, one step boundary for every micro-batch, until the experts say stop (or,
        colocated, no rank has requests)."""
        side = self.side
        while not side.stop:
            # The step starts at its boundary: admitting, retiring and the step agreement are part of its time.
            started = time.perf_counter()
            side.timer.step_started()
            side.boundary()
            if not self.transport.another_step():
                break
            if self.transport.nothing_to_decode():  # an idle server: no layer to run, the next boundary waits
                beat_step(self.beat, side.decode_steps, 0, self.steps[0])
                side.timer.step_done(record=False)
                continue
            handles = split_micro_batches(side.queue.running, side.m)
            before = side.tokens_running()
            self.transport.begin_step(side.decode_steps)
            for index, step in enumerate(self.steps):
                beat_step(self.beat, side.decode_steps, index, step)
                self.handlers[(step.stage, step.phase)](handles[step.micro_batch], step.layer)
            self.transport.end_step()
            for h in handles:
                for work in h.sends:
                    work.wait(side.timeout_s)
            side.log_step(started, before)
            side.decode_steps += 1
            if side.decode_steps == 1:
                side.timer.mark_steady()
            self._report_progress()
        side.finish()

    def _run_stream(self) -> None:
        """Rounds 0, 1, 2, ... of the ping-pong across decode steps, until the experts say stop; then the
        rest of that step and the tail, so the pipeline drains once, at the end."""
        side = self.side
        layers = side.spec.num_layers
        # A sequence stays in its micro-batch from admission to retirement, so each micro-batch keeps its
        # own KV cache: its sequences hold consecutive rows, which decode attention reads without a copy.
        side.handles = handles = [MicroBatchHandle(i, cache=side.cache if i == 0 else side.cache.empty_like())
                                  for i in range(side.m)]
        handlers = dict(self.handlers)
        attend = handlers[(ATTN.name, Phase.RUN)]

        def refill_then_attend(h: MicroBatchHandle, layer: int) -> None:
            if layer == 0:  # the micro-batch's step boundary
                side.refill(h)
            attend(h, layer)

        handlers[(ATTN.name, Phase.RUN)] = refill_then_attend
        first = role_steps(ping_pong_round(side.m, 0), Role.ATTENTION)
        steady = role_steps(ping_pong_round(side.m, 1), Role.ATTENTION)  # layer 0 here: the previous round's
        end: int | None = None  # the round that only drains (set once the experts said stop)
        mark = (time.perf_counter(), 0)
        side.timer.step_started()
        sent: list[Any] = []
        round_ = 0
        while end is None or round_ <= end:
            if round_ and round_ % layers == 0:
                now = time.perf_counter()
                side.record_step(now - mark[0], side.tokens_generated - mark[1])
                mark = (now, side.tokens_generated)
                side.timer.step_started()
                side.decode_steps = round_ // layers
                if side.decode_steps == 1:
                    side.timer.mark_steady()
                self._report_progress()
                self.transport.end_step()
            if round_ % layers == 0 and (end is None or round_ < end):
                # The step boundary of the transport (a layout epoch starts here): every dispatch of this round
                # and the later ones belongs to the new step, the combines still awaited to the one before.
                self.transport.begin_step(side.decode_steps)
            for index, step in enumerate(first if round_ == 0 else steady):
                virtual = round_ - 1 + step.layer if round_ else step.layer
                if end is not None and virtual >= end:
                    continue  # past the last step: only the tail (waits and posts of the last layer) is left
                beat_step(self.beat, side.decode_steps, index, step)
                handlers[(step.stage, step.phase)](handles[step.micro_batch], virtual % layers)
                if side.stop and end is None:
                    end = (virtual // layers + 1) * layers
            for work in sent:  # the previous round's sends: received by now, nothing waits here
                work.wait(side.timeout_s)
            sent = [work for h in handles for work in h.sends]
            for h in handles:
                h.sends = []
            round_ += 1
        for work in sent:
            work.wait(side.timeout_s)
        side.step_log.append((time.perf_counter() - mark[0], side.tokens_generated - mark[1]))
        side.decode_steps = (end or 0) // layers
        for h in handles:
            for seq in side.queue.retire(h.seqs):
                h.cache.free(seq.slot)
