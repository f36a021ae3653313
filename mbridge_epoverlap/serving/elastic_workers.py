"""Attention and expert workers that keep decoding through the loss of expert workers.

They are the engine's workers (`serving.workers`) with three steps replaced:

- dispatch (attention): each (token, choice) goes to the replica `ElasticLayout.router` picks, only to live
  expert workers; the control tensor carries `[active, alive mask]`.
- combine wait (attention): a `PeerError` from an expert worker marks it dead; the placement is re-solved
  over the survivors (`ElasticLayout.without`) and the rows the dead worker held are re-sent, under the
  new placement, as a resend message (tag `RESEND_TAG`) to the survivors, whose answers fill the gaps.
- dispatch wait (expert): waits in short slices and serves resend messages in between; a message whose
  mask drops a worker makes the expert worker re-solve the same placement and load the experts it now
  holds (restoring those whose every replica died from the checkpoint).

Each worker records what happened (`events`: detected, re-placed, restored, resumed, with
`time.monotonic()` stamps, comparable across processes on one host); attention worker 0 prints it as it
happens. Fault injection for tests and the bench (`EnginePlan.kill`): an expert worker SIGKILLs itself at
a given decode step, in the middle of the step (last MoE layer, first micro-batch).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from mbridge_epoverlap.comm.m2n.base import PeerError
from mbridge_epoverlap.schedule.program import DISPATCH
from mbridge_epoverlap.serving.elastic import ElasticLayout, ExpertsLostError
from mbridge_epoverlap.serving.workers import (
    ACTIVE,
    CONTINUE,
    IDLE,
    STOP,
    AttentionWorker,
    ExpertWorker,
    MicroBatchHandle,
    message_tag,
)

RESEND_TAG = 1 << 24  # above every (layer, micro-batch) tag
_SLICE_S = 0.02  # an expert worker looks for resends this often while it waits


def _timed_out(exc: PeerError) -> bool:
    """A wait that ran out of its slice (the peer is alive) rather than a dead peer (`Work.wait`'s message)."""
    return "did not complete within" in str(exc)


class _SendToleratingLoss:
    """A send `Work` whose failure is ignored once its peer is known dead (it was re-sent elsewhere)."""

    def __init__(self, work: Any, worker: ElasticAttentionWorker, index: int) -> None:
        self.work, self.worker, self.index = work, worker, index

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self.work.wait(timeout_s)
        except PeerError:
            self.worker.lose({self.index}, "a send failed")


class ElasticAttentionWorker(AttentionWorker):
    """An attention worker that routes to replicas and re-routes around dead expert workers."""

    def __init__(self, *args: Any, layout: ElasticLayout, restore: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout, self.restore = layout, restore
        self.route = layout.router()
        self.events: list[dict[str, Any]] = []
        self._resume_pending = False

    def _say(self, event: str, line: str, **fields: Any) -> None:
        self.events.append({"event": event, "t": time.monotonic(), **fields})
        if self.progress is not None:
            self.progress(f"elastic: {line}")

    def lose(self, workers: set[int], how: str) -> None:
        """Mark expert workers dead and re-solve the placement over the survivors (idempotent)."""
        dead = workers & self.layout.alive
        if not dead:
            return
        self._say("detected", f"expert workers {sorted(dead)} lost ({how})", workers=sorted(dead))
        layout, orphans = self.layout.without(dead)
        if orphans and not self.restore:
            raise ExpertsLostError(orphans, sorted(dead))
        self.layout, self.route = layout, layout.router()
        counts = layout.replica_counts()
        self._say("re-placed", f"placement re-solved over expert workers {sorted(layout.alive)} "
                  f"(replicas per expert {counts})", alive=sorted(layout.alive), slots=list(layout.slots))
        if orphans:
            self._say("restored", f"experts {orphans} lost every replica: restored from the checkpoint by their "
                      "new holders", experts=orphans)
        self._resume_pending = True

    def _control(self, layer: int) -> torch.Tensor:
        """`[active, alive mask, layer]`: the layer tells a resend's receiver which experts to run."""
        return torch.tensor([ACTIVE if self.active else IDLE, self.layout.mask, layer], dtype=torch.int64)

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        tag = message_tag(layer, h.index, self.m)
        control = self._control(layer)
        with self.timer.time(DISPATCH.name, record=not h.empty):
            if h.empty:
                hidden = torch.zeros(0, self.spec.hidden_size, dtype=self.spec.torch_dtype())
                ids = torch.zeros(0, self.spec.top_k, dtype=torch.int64)
                owners = ids
            else:
                hidden, ids = h.attn.tokens, h.attn.expert_ids
                owners = self.route.workers(ids, h.batch.positions)
            h.routes, h.receives = [], []
            for worker in sorted(self.layout.alive):
                rank = self.expert_ranks[worker]
                token, slot = (owners == worker).nonzero(as_tuple=True)
                h.routes.append((token, slot))
                send = self.comm.isend(rank, [control, hidden[token].contiguous(), ids[token, slot]], tag)
                h.sends.append(_SendToleratingLoss(send, self, worker))
                h.receives.append((worker, self.comm.irecv(rank, tag)))
        h.issued_at = time.perf_counter()

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        replies: list[list[torch.Tensor] | None] = []
        lost: set[int] = set()
        with self.timer.time("combine_wait", record=not h.empty):
            for worker, work in h.receives:
                try:
                    replies.append(work.wait(self.timeout_s))
                except PeerError:
                    replies.append(None)
                    lost.add(worker)
        if not h.empty:
            self.timer.record("round_trip", time.perf_counter() - h.issued_at)
        h.receives = []
        if lost:
            self.lose(lost, f"M2N combine of layer {layer}, micro-batch {h.index}")
        first = next((r for r in replies if r is not None), None)
        if layer == self.first_moe and h.index == 0 and first is not None and int(first[0][0]) == STOP:
            self.stop = True
        if h.empty:
            return
        tokens, k = h.attn.expert_ids.shape
        out = torch.zeros(tokens, k, self.spec.hidden_size, dtype=self.spec.torch_dtype())
        missing: list[torch.Tensor] = []
        for (token, slot), reply in zip(h.routes, replies, strict=True):
            if reply is None:
                missing.append(token * k + slot)
            else:
                out[token, slot] = reply[1]
        if missing:
            self._resend(h, layer, torch.cat(missing), out)
        h.expert_out = out

    def _resend(self, h: MicroBatchHandle, layer: int, flat: torch.Tensor, out: torch.Tensor) -> None:
        """Send the rows a dead worker held to their new holders; wait for the answers (more losses: again)."""
        k = h.attn.expert_ids.shape[1]
        while flat.numel():
            token, slot = flat // k, flat % k
            ids = h.attn.expert_ids[token, slot]
            owners = self.route.workers(ids.view(-1, 1), h.batch.positions[token]).view(-1)
            control = self._control(layer)
            pending = []
            for worker in sorted(self.layout.alive):
                rows = (owners == worker).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                rank = self.expert_ranks[worker]
                self.comm.isend(rank, [control, h.attn.tokens[token[rows]].contiguous(), ids[rows]], RESEND_TAG)
                pending.append((worker, rows, self.comm.irecv(rank, RESEND_TAG)))
            again, lost = [], set()
            for worker, rows, work in pending:
                try:
                    reply = work.wait(self.timeout_s)
                except PeerError:
                    again.append(flat[rows])
                    lost.add(worker)
                    continue
                out[token[rows], slot[rows]] = reply[1]
            if lost:
                self.lose(lost, "M2N resend")
            flat = torch.cat(again) if again else flat[:0]
        self.events.append({"event": "resent", "t": time.monotonic(), "micro_batch": h.index})

    def _post(self, h: MicroBatchHandle, layer: int) -> None:
        super()._post(h, layer)
        if self._resume_pending and layer == self.spec.num_layers - 1 and not h.empty:
            self._resume_pending = False
            self._say("resumed", f"decoding resumed on {len(self.layout.alive)} expert workers")


class ElasticExpertWorker(ExpertWorker):
    """An expert worker that serves resends and follows the alive mask the attention workers send."""

    def __init__(self, *args: Any, layout: ElasticLayout, index: int, restore: bool,
                 kill_at_step: int | None = None, kill_file: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layout, self.index, self.restore = layout, index, restore
        self.kill_at_step, self.kill_file = kill_at_step, kill_file
        self.events: list[dict[str, Any]] = []
        self._last_moe = self.spec.moe_layer_ids[-1]
        self._resends = {rank: self.comm.irecv(rank, RESEND_TAG) for rank in self.attention_ranks}

    def _follow(self, mask: int) -> None:
        layout, orphans = self.layout.with_mask(mask)
        if layout is self.layout:
            return
        if orphans and not self.restore:
            raise ExpertsLostError(orphans, sorted(self.layout.alive - layout.alive))
        started = time.monotonic()
        loaded = self.part.ensure(layout.experts_of(self.index))
        self.events.append({"event": "re-placed", "t": time.monotonic(), "load_s": time.monotonic() - started,
                            "loaded": loaded, "restored": sorted(set(loaded) & set(orphans)),
                            "alive": sorted(layout.alive)})
        self.layout = layout

    def _wait_serving(self, work: Any) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return work.wait(max(1e-3, min(_SLICE_S, deadline - time.monotonic())))
            except PeerError as exc:
                if not _timed_out(exc) or time.monotonic() >= deadline:
                    raise
            self._serve_resends()

    def _serve_resends(self) -> None:
        for rank, work in self._resends.items():
            if not work.done():
                continue
            control, tokens, ids = work.wait(0)
            self._follow(int(control[1]))
            out = self.part(int(control[2]), tokens, ids) if tokens.shape[0] else tokens
            self.comm.isend(rank, [torch.tensor([CONTINUE], dtype=torch.int64), out.contiguous()], RESEND_TAG)
            self._resends[rank] = self.comm.irecv(rank, RESEND_TAG)

    def _dispatch_wait(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        if self.kill_at_step is not None and self.decode_steps == self.kill_at_step and layer == self._last_moe \
                and mb == 0:
            self._die()
        tag = message_tag(layer, mb, self.m)
        with self.timer.time("dispatch_wait"):
            works = [self.comm.irecv(rank, tag) for rank in self.attention_ranks]
            self._received[mb] = [self._wait_serving(work) for work in works]
        mask = self.layout.mask
        for msg in self._received[mb]:
            mask &= int(msg[0][1])
        self._follow(mask)
        if layer == self.first_moe and mb == 0:
            self.stop = all(int(msg[0][0]) == IDLE for msg in self._received[mb])

    def _die(self) -> None:
        """Fault injection: SIGKILL this process mid-decode (after noting when, for the bench)."""
        if self.kill_file:
            with open(self.kill_file, "w") as fh:
                fh.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
