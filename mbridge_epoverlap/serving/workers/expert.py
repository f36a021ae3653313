"""The expert worker of disaggregated decode: holds a subset of the routed experts and serves every attention
worker over M2N.

It executes the expert role's steps of the order (wait for `dispatch`, run `experts`, issue `combine`), in the
same rounds as the attention workers (streamed or drained, `decode`), reading `protocol.Dispatch` messages and
answering with `protocol.Combine`. When no attention worker had work at the start of a step (every dispatch's
control is idle), it answers that step's first combine with stop and leaves after the step.
"""

from __future__ import annotations

from typing import Any

import torch

from mbridge_epoverlap.launch import heartbeat as hb
from mbridge_epoverlap.schedule.program import EXPERTS, Role, bind_handlers, role_phases
from mbridge_epoverlap.schedule.serving_orders import ping_pong, ping_pong_round
from mbridge_epoverlap.serving.workers.decode import beat_step, role_steps
from mbridge_epoverlap.serving.workers.protocol import Combine, Dispatch, message_tag
from mbridge_epoverlap.serving.workers.stage_timer import StageTimer


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

    streams = True  # as the attention workers: both sides must run the same rounds
    events: list[dict[str, Any]] | None = None  # what happened (elastic workers record it)

    def __init__(self, spec: Any, part: Any, comm: Any, attention_ranks: list[int], micro_batches: int,
                 timeout_s: float, beat: hb.Heartbeat | None = None) -> None:
        self.spec, self.part, self.comm = spec, part, comm
        self.attention_ranks, self.m, self.timeout_s = attention_ranks, micro_batches, timeout_s
        self.steps = role_steps(ping_pong(micro_batches, spec.num_layers), Role.EXPERT)
        self.handlers = bind_handlers(self, role_phases(Role.EXPERT))
        self.first_moe = spec.moe_layer_ids[0]
        self.timer = StageTimer(frozenset({EXPERTS.name}))
        self.beat = beat
        self.decode_steps = 0
        self.stop = False
        self._received: dict[int, list[Dispatch]] = {}
        self._outputs: dict[int, list[torch.Tensor]] = {}
        self._sends: list[Any] = []
        self.tokens_served = 0
        # (token, choice) pairs this worker computed for each expert, `[MoE layers, experts]` (resends included).
        self._moe_index = {layer: i for i, layer in enumerate(spec.moe_layer_ids)}
        self.expert_load = torch.zeros(len(self._moe_index), spec.num_experts, dtype=torch.int64)

    def run(self) -> None:
        if self.streams:
            self._run_stream()
            return
        while not self.stop:
            for index, step in enumerate(self.steps):
                beat_step(self.beat, self.decode_steps, index, step)
                self.handlers[(step.stage, step.phase)](step.micro_batch, step.layer)
            for work in self._sends:
                work.wait(self.timeout_s)
            self._sends = []
            self.decode_steps += 1

    def report(self, *, failed: bool = False) -> dict[str, Any]:
        report: dict[str, Any] = {"decode_steps": self.decode_steps}
        if self.events is not None:
            report["events"] = self.events
        report["stages"] = self.timer.summary()
        report["expert_load"] = {"layers": self.spec.moe_layer_ids, "counts": self.expert_load.tolist()}
        return report

    def count(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Note the pairs of `layer` this worker computed (one expert id each)."""
        self.expert_load[self._moe_index[layer]] += torch.bincount(expert_ids.reshape(-1),
                                                                   minlength=self.spec.num_experts)

    def close(self) -> None:
        self.comm.close()

    def _run_stream(self) -> None:
        """The expert side of the rounds the attention workers run (see `decode.AttentionWorker._run_stream`)."""
        layers = self.spec.num_layers
        steps = role_steps(ping_pong_round(self.m, 0), Role.EXPERT)  # an expert round touches only its layer
        end: int | None = None
        sent: list[Any] = []
        round_ = self.decode_steps * layers  # a replacement joins at a later step
        while end is None or round_ < end:
            self.decode_steps = round_ // layers
            if round_ == layers:
                self.timer.mark_steady()
            for index, step in enumerate(steps):
                beat_step(self.beat, self.decode_steps, index, step)
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

    def _receive(self, mb: int, layer: int) -> list[Dispatch]:
        """The dispatches of (layer, micro-batch) from every attention worker (subclasses wait otherwise)."""
        works = [self.comm.irecv(rank, message_tag(layer, mb, self.m)) for rank in self.attention_ranks]
        return [Dispatch.decode(work.wait(self.timeout_s)) for work in works]

    def _dispatch_wait(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        with self.timer.time("dispatch_wait"):
            self._received[mb] = self._receive(mb, layer)
        if layer == self.first_moe and mb == 0:
            self.stop = all(not msg.control.active for msg in self._received[mb])

    def _experts(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        messages = self._received.pop(mb)
        counts = [msg.pairs for msg in messages]
        total = sum(counts)
        if total == 0:
            self._outputs[mb] = [msg.tokens[:0] for msg in messages]
            return
        with self.timer.time(EXPERTS.name):
            tokens = torch.cat([msg.tokens for msg in messages])
            ids = torch.cat([msg.expert_ids for msg in messages])
            if all(msg.token_index is not None for msg in messages):
                offsets = [0]
                for msg in messages[:-1]:
                    offsets.append(offsets[-1] + msg.tokens.shape[0])
                index = torch.cat([msg.token_index + offset for msg, offset in zip(messages, offsets, strict=True)])
                out = self.part(layer, tokens, ids, token_index=index)
            else:
                out = self.part(layer, tokens, ids)
        self.tokens_served += total
        self.count(layer, ids)
        self._outputs[mb] = list(out.split(counts))

    def _combine_issue(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        tag = message_tag(layer, mb, self.m)
        for rank, out in zip(self.attention_ranks, self._outputs.pop(mb), strict=True):
            self._sends.append(self.comm.isend(rank, Combine(self.stop, out.contiguous()).encode(), tag))
