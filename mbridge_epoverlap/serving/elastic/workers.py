"""Attention and expert workers that keep decoding through the loss of expert workers.

The attention side is the engine's (`serving.workers.attention`) with the elastic router as its transport
(`ElasticRouter`); the expert worker is the engine's with its waits replaced:

- dispatch (attention): each (token, choice) goes to the replica `ElasticLayout.router` picks, only to live
  expert workers; the control (`protocol.ElasticControl`) carries whether the sender is active and the alive
  mask.
- combine wait (attention): a `PeerError` from an expert worker marks it dead; the placement is re-solved
  over the survivors (`ElasticLayout.without`) and the rows the dead worker held are re-sent, under the
  new placement, as a resend message (tag `protocol.RESEND_TAG`) to the survivors, whose answers fill the gaps.
- dispatch wait (expert): waits in short slices and serves resend messages in between; a message whose
  mask drops a worker makes the expert worker re-solve the same placement and load the experts it now
  holds (restoring those whose every replica died from the checkpoint).

Two more hooks make the layout change while requests flow, at step boundaries (layout epochs), without
draining the pipeline (decode steps stream: the next step's first round follows the last round of the one
before):

- attention, at the start of a decode step (`ElasticRouter.begin_step`, the round boundary where layer 0 of
  step s follows the last layer of step s - 1): at a sync step (`elastic.sync`) the attention workers merge
  what they know, every `rebalance_every` steps consider a rebalance for the load they recorded
  (`eplb.ExpertLoadRecorder`, fed by every dispatch), and admit a replacement expert worker
  `rejoin_after_steps` after a loss (the survivors' slots kept, its own filled: `ElasticLayout.rejoined`, so only
  its experts move). A rebalance is skipped while max/mean load is at most
  `rebalance_threshold` (by default 1.1 or `routing_noise` of the window's pairs, the higher); otherwise the
  placement in force is changed slot by slot
  (`ElasticLayout.rebalanced`, aiming at the balance a solve from scratch gets), or solved from scratch when
  that balances clearly better, and adopted when it lowers max/mean load by `MIN_REBALANCE_GAIN` or more. A
  new layout becomes a new epoch, announced in that step and entered at the next step boundary; the control
  carries the current epoch and its table and the announced one (`ElasticControl.epoch`, `slots`,
  `announced`, `announced_slots`). Every dispatch of a round carries the same epoch, so the switch falls
  between two rounds: the micro-batches still in flight (the last layer of the step before) finish on the old
  placement, the next round runs on the new one.
- expert `_dispatch_wait` (and resends): the first message of a step that announces an epoch makes the expert
  worker plan the moves; it connects a replacement's channel, sends the weights that change owner and posts
  its receives (`elastic.moves`) when it is next idle, waiting for a dispatch, and builds its new share there
  too once they arrived, while decoding goes on with the old weights. The first message of the epoch itself
  makes it install the new share (at the latest then it does what was left); the old weights stay behind it
  (`ExpertStore.adopt`) until the last micro-batch's messages of the first round of the new epoch arrived:
  nothing routed by the old table can come after them (`ExpertStore.retire`).

Online serving with several attention workers (`droppable_attention`): an expert worker whose dispatch wait
or combine send fails because an attention worker died (any of them when the front end holds the rendezvous
store, `EnginePlan.store_hosted`; else one after the first, which holds it) drops it and goes on serving the
others; the front end moves that worker's requests to a survivor, which re-prefills each prompt with the
tokens generated so far.

Each worker records what happened (`events`: detected, re-placed, restored, resumed, with
`time.monotonic()` stamps, comparable across processes on one host); attention worker 0 prints it as it
happens. Fault injection for tests and the bench (`EnginePlan.kill`): an expert worker SIGKILLs itself at
a given decode step, in the middle of the step (last MoE layer, first micro-batch).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Collection
from typing import Any

import torch

from mbridge_epoverlap.comm.m2n.base import PeerError, PeerTimeout
from mbridge_epoverlap.schedule.program import COMBINE, DISPATCH, Phase
from mbridge_epoverlap.serving.elastic.layout import ElasticLayout, ExpertsLostError
from mbridge_epoverlap.serving.elastic.moves import rejoin_prefix, transfers
from mbridge_epoverlap.serving.workers.attention import AttentionSide, MicroBatchHandle
from mbridge_epoverlap.serving.workers.expert import ExpertWorker
from mbridge_epoverlap.serving.workers.protocol import (
    RESEND_TAG,
    Combine,
    Dispatch,
    ElasticControl,
    Transport,
    message_tag,
)

# A rebalance is adopted when it lowers max/mean load by at least this fraction: moving weights for less is churn.
MIN_REBALANCE_GAIN = 0.01
# The default threshold (`rebalance_threshold` 0): skip at max/mean up to this, or up to what routing the window's
# pairs at random would give (`routing_noise`), whichever is higher.
DEFAULT_REBALANCE_THRESHOLD = 1.1


def routing_noise(pairs: int, workers: int) -> float:
    """max/mean load that uniform random routing of `pairs` (token, expert) pairs over `workers` equal workers
    stays below almost always: 1 + 3 sigma of one worker's share (a binomial's relative spread,
    sqrt((workers - 1) / pairs)). A measured imbalance below it cannot be told from chance: a placement fitted
    to it would fit the past window's draw, not the next one's, and the weight moves would buy nothing."""
    if pairs < 1 or workers < 2:
        return math.inf if workers >= 2 else 1.0
    return 1.0 + 3.0 * math.sqrt((workers - 1) / pairs)
_SLICE_S = 0.02  # an expert worker looks for resends this often while it waits


class _SendToleratingLoss:
    """A send `Work` whose failure is ignored once its peer is known dead (it was re-sent elsewhere)."""

    def __init__(self, work: Any, router: ElasticRouter, index: int) -> None:
        self.work, self.router, self.index = work, router, index

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self.work.wait(timeout_s)
        except PeerError:
            self.router.lose({self.index}, "a send failed")


class _SendToAttention:
    """An expert worker's combine send whose failure drops its attention worker when that loss is survivable."""

    def __init__(self, work: Any, worker: ElasticExpertWorker, rank: int) -> None:
        self.work, self.worker, self.rank = work, worker, rank

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self.work.wait(timeout_s)
        except PeerTimeout:
            raise
        except PeerError:
            if not self.worker._droppable(self.rank) and self.rank in self.worker.attention_ranks:
                raise
            if self.rank in self.worker.attention_ranks:
                self.worker._drop_attention(self.rank)


class ElasticRouter(Transport):
    """The transport of an elastic attention worker: routes to replicas, re-routes around dead expert workers,
    and changes the layout at step boundaries (rebalancing, a replacement joining).

    Args:
        side: the attention side it serves.
        comm: the M2N communicator (peers: the expert workers).
        expert_ranks: rank of each expert worker, by worker index.
        layout: the start layout.
        restore: whether experts whose every replica died may be restored from the checkpoint.
        sync: the boundary agreement with the other attention workers (None: no layout epochs).
        m2n_store: the M2N rendezvous store (to connect a replacement's channel).
        rebalance_every: re-solve the placement for the measured load every this many decode steps (0: never).
        rejoin_after_steps: admit a replacement this many or more steps after a loss, at the first boundary where
            it is ready (0: never).
        rejoin_hold: wait at that boundary for the replacement instead (up to half the timeout).
        rebalance_threshold: skip a rebalance while max/mean load over the live expert workers is at most this
            (0: `DEFAULT_REBALANCE_THRESHOLD` or the window's `routing_noise`, the higher).
        progress: called with a line for what happens (rank 0 only).
    """

    stages = ((DISPATCH, Phase.ISSUE), (COMBINE, Phase.WAIT))

    def __init__(self, side: AttentionSide, comm: Any, expert_ranks: list[int], *, layout: ElasticLayout,
                 restore: bool, sync: Any = None, m2n_store: Any = None, rebalance_every: int = 0,
                 rejoin_after_steps: int = 0, rebalance_threshold: float = 0.0, rejoin_hold: bool = False,
                 progress: Callable[[str], None] | None = None) -> None:
        self.side, self.comm, self.expert_ranks, self.progress = side, comm, expert_ranks, progress
        self.spec, self.m, self.timeout_s = side.spec, side.m, side.timeout_s
        self.layout, self.restore = layout, restore
        self.route = layout.router()
        self.events: list[dict[str, Any]] = []
        self._resume_pending = False
        side.on_sampled.append(self._sampled)
        self.sync, self.m2n_store = sync, m2n_store
        self.rebalance_every, self.rejoin_after_steps = rebalance_every, rejoin_after_steps
        self.rebalance_threshold, self.rejoin_hold = rebalance_threshold, rejoin_hold
        self.recorder = None
        if rebalance_every:
            from mbridge_epoverlap.serving.elastic.eplb import ExpertLoadRecorder

            self.recorder = ExpertLoadRecorder(self.spec.num_layers, self.spec.num_experts, rebalance_every)
        self.epoch = 0
        self._announced: tuple[ElasticLayout, dict[str, Any]] | None = None  # entered at the next step
        # The epochs the control carries: (epoch, its table as announced) now, and the announced next one.
        self._tables = ((0, tuple(layout.slots)), (0, tuple(layout.slots)))
        self._joining = 0  # mask bits of the replacements the announced epoch admits (see `_control`)
        self.lost_at: dict[int, int] = {}  # expert worker -> decode step its loss was seen
        self.generations: dict[int, int] = {}  # expert worker -> replacements admitted
        self._rejoin_tried: set[tuple[int, int]] = set()
        self._rejoin_due: dict[tuple[int, int], float] = {}  # replacement -> when its turn came (monotonic)

    def close(self) -> None:
        self.comm.close()

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
        for worker in dead:
            self.lost_at[worker] = self.side.decode_steps
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

    def _sampled(self, h: MicroBatchHandle) -> None:
        """A micro-batch got its next tokens: the first time after a loss, decoding has resumed."""
        if self._resume_pending:
            self._resume_pending = False
            self._say("resumed", f"decoding resumed on {len(self.layout.alive)} expert workers")

    def _control(self, layer: int) -> ElasticControl:
        """The layer tells a resend's receiver which experts to run; the epochs and their tables tell an expert
        worker the layout it must hold and the one to move weights for."""
        (epoch, slots), (announced, announced_slots) = self._tables
        # The mask also carries the replacements the announced epoch admits: an expert worker connects to a
        # worker the announced table adds only when its bit is set (a table decided before a loss was seen may
        # still hold the lost worker; it leaves again at the switch). Merging masks by AND ignores extra bits.
        mask = self.layout.mask | self._joining
        return ElasticControl(active=self.side.active, mask=mask, layer=layer, epoch=epoch, slots=slots,
                              announced=announced, announced_slots=announced_slots)

    # --- layout epochs ------------------------------------------------------------------------------
    def finish(self) -> None:
        if self.sync is not None and self.sync.is_lead and self.rejoin_after_steps:
            for (worker, _), due in self._rejoin_due.items():  # turns that came, never ready before the end
                self._rejoin_gave_up(worker, time.monotonic() - due, "by the end of the run")
            self._rejoin_due.clear()
            self.sync.finish()

    def begin_step(self, step: int) -> None:
        if self._announced is not None:
            self._switch(step)
        if self.sync is not None and step > 0 and (self.rejoin_after_steps or step % self.rebalance_every == 0):
            self._boundary(step)

    def end_step(self) -> None:
        if self.recorder is not None:
            self.recorder.advance()

    def _boundary(self, step: int) -> None:
        """Merge what every attention worker knows, then maybe enter a new layout epoch (same on all of them)."""
        self._boundary_started = time.monotonic()
        rebalance = self.recorder is not None and step % self.rebalance_every == 0
        load = self.recorder.load().sum(0) if rebalance else None
        dead, load, active = self.sync.gather(step, sorted(set(range(self.layout.workers)) - self.layout.alive), load,
                                              bool(self.side.queue.running))
        if not active:
            load = None  # the last (empty) step: nothing left to balance
        self.lose(dead, "another attention worker saw it")
        admitted = self.sync.decide(step, lambda: self._admissions(step))
        joined = set()
        for worker, generation in admitted:
            self.generations[worker] = generation
            try:
                self.comm.connect(self.expert_ranks[worker], self.m2n_store, rejoin_prefix(worker, generation))
            except PeerError as exc:  # it died while connecting (every attention worker waits for it alike)
                self._say("rejoin-failed", f"the replacement of expert worker {worker} did not connect ({exc}); "
                          "decoding goes on without it", worker=worker)
                continue
            joined.add(worker)
        if load is not None and not int(load.sum()):
            load = None  # nothing was routed: no measurement to balance for
        if not joined and load is None:
            return
        if joined:
            self._rejoin(step, joined, load)
            return
        self._rebalance(step, load)

    def _rejoin(self, step: int, joined: set[int], load: torch.Tensor | None) -> None:
        """Announce the placement with the replacements `joined` back: the survivors' slots kept and the
        newcomers' filled (`ElasticLayout.rejoined`: only their experts move), unless that leaves max/mean load
        above the rebalance threshold and a solve from scratch lowers it by `MIN_REBALANCE_GAIN`, or the placement
        packs routing groups onto node sets (the solve keeps them there)."""
        alive = self.layout.alive | joined
        candidate = self.layout.rejoined(joined, load)
        scratch = self.layout.resolved(alive, load)
        solve = "fill"
        if self.layout.nodes > 1:  # the fill ignores which node set each routing group is packed onto
            candidate, solve = scratch, "from scratch"
        elif load is not None:
            threshold = self.rebalance_threshold or max(DEFAULT_REBALANCE_THRESHOLD,
                                                        routing_noise(int(load.sum()), len(alive)))
            if candidate.imbalance(load) > threshold and \
                    scratch.imbalance(load) < candidate.imbalance(load) * (1 - MIN_REBALANCE_GAIN):
                candidate, solve = scratch, "from scratch"
        from_scratch = sum(len(ids) for ids in transfers(self.layout, scratch).values())
        self._announce(candidate, step, load, f"expert workers {sorted(joined)} rejoined", joined=sorted(joined),
                       solve=solve, moved_from_scratch=from_scratch)

    def _rebalance(self, step: int, load: torch.Tensor) -> None:
        """Skip (within the threshold), keep (no solve helps enough), or announce a rebalanced placement: the
        incremental one when it moves no more copies than the one solved from scratch and balances within
        `MIN_REBALANCE_GAIN` of it, else that one (so a rebalance never moves more than a solve from scratch)."""
        before = self.layout.imbalance(load)
        record = {"t": time.monotonic(), "step": step, "imbalance_before": before, "imbalance_after": before}
        threshold = self.rebalance_threshold or max(DEFAULT_REBALANCE_THRESHOLD,
                                                    routing_noise(int(load.sum()), len(self.layout.alive)))
        if before <= threshold:
            self.events.append({"event": "rebalance-skipped", **record, "threshold": threshold})
            return
        scratch = self.layout.resolved(self.layout.alive, load)
        goal = scratch.imbalance(load)
        incremental = self.layout.rebalanced(load, goal)
        from_scratch = sum(len(ids) for ids in transfers(self.layout, scratch).values())
        use_scratch = incremental.imbalance(load) > goal * (1 + MIN_REBALANCE_GAIN) or \
            sum(len(ids) for ids in transfers(self.layout, incremental).values()) > from_scratch
        candidate = scratch if use_scratch else incremental
        if candidate.imbalance(load) < before * (1 - MIN_REBALANCE_GAIN):
            self._announce(candidate, step, load, "rebalanced", moved_from_scratch=from_scratch,
                           solve="from scratch" if use_scratch else "incremental")
        else:
            self.events.append({"event": "rebalance-kept", **record, "moved_from_scratch": from_scratch})

    def _admissions(self, step: int) -> list[list[int]]:
        """(The lead attention worker) the replacements to admit at `step`: lost at least `rejoin_after_steps` ago and
        ready. One whose turn has come but is still starting is looked at again at the next boundary (decoding
        goes on meanwhile), until half the timeout passed; with `rejoin_hold` this boundary waits for it."""
        admitted: list[list[int]] = []
        if not self.rejoin_after_steps:
            return admitted
        for worker in sorted(set(range(self.layout.workers)) - self.layout.alive):
            generation = self.generations.get(worker, 0) + 1
            if (worker, generation) in self._rejoin_tried or \
                    step - self.lost_at.get(worker, step) < self.rejoin_after_steps:
                continue
            due = self._rejoin_due.setdefault((worker, generation), time.monotonic())
            if self.rejoin_hold:
                ready = self.sync.wait_ready(worker, generation)
            else:
                ready = self.sync.is_ready(worker, generation)
                if not ready and time.monotonic() - due < self.timeout_s / 2:
                    continue  # still starting: decoding goes on, the next boundary looks again
            self._rejoin_tried.add((worker, generation))
            self._rejoin_due.pop((worker, generation), None)
            started = time.monotonic()
            if not ready:
                self._rejoin_gave_up(worker, started - due, f"within {self.timeout_s / 2:g} s (half of --timeout)")
                continue
            # It joins the epoch entered at the next step; this step moves its weights.
            self.sync.admit(worker, generation, step + 1, self.epoch, self.layout.slots)
            admitted.append([worker, generation])
            self.events.append({"event": "rejoin-ready", "t": time.monotonic(), "worker": worker,
                                "waited_s": time.monotonic() - due})
        return admitted

    def _rejoin_gave_up(self, worker: int, waited_s: float, when: str) -> None:
        self._say("rejoin-timeout", f"no replacement for expert worker {worker} was ready {when}, {waited_s:.1f} s "
                  "after its turn came: decoding goes on without it", worker=worker, waited_s=waited_s)

    def _announce(self, layout: ElasticLayout, step: int, load: torch.Tensor | None, why: str,
                  **fields: Any) -> None:
        """Announce `layout` as the next epoch in this step's messages (weights move meanwhile); entered next step."""
        moves = transfers(self.layout, layout)
        before = self.layout.imbalance(load) if load is not None else None
        after = layout.imbalance(load) if load is not None else None
        self._announced = (layout, {"why": why, "announced_at": step, "moved": sum(len(ids) for ids in moves.values()),
                                    "moves": [[src, dst, ids] for (src, dst), ids in moves.items()],
                                    "imbalance_before": before, "imbalance_after": after,
                                    "decide_s": time.monotonic() - self._boundary_started, **fields})
        self._tables = (self._tables[0], (self.epoch + 1, tuple(layout.slots)))
        self._joining = sum(1 << w for w in fields.get("joined", []))

    def _switch(self, step: int) -> None:
        """Enter the announced epoch; expert workers lost while it was announced are dropped from it again."""
        layout, fields = self._announced
        self._announced = None
        joined = set(fields.get("joined", []))
        lost_meanwhile = {w for w in layout.alive if w not in self.layout.alive and w not in joined}
        self.epoch += 1
        self._tables = ((self.epoch, tuple(layout.slots)), (self.epoch, tuple(layout.slots)))
        self._joining = 0
        self.layout, self.route = layout, layout.router()
        why = fields.pop("why")
        before, after = fields["imbalance_before"], fields["imbalance_after"]
        balance = f", max/mean load {before:.3f} -> {after:.3f}" if before is not None else ""
        scratch = f" ({fields['solve']}; from scratch: {fields['moved_from_scratch']})" if "solve" in fields else ""
        self._say("rebalanced" if not joined else "rejoined",
                  f"{why} at decode step {step}: layout epoch {self.epoch} over expert workers "
                  f"{sorted(layout.alive)}, {fields['moved']} expert copies moved during step {fields['announced_at']}"
                  f"{scratch}{balance}", step=step, epoch=self.epoch, slots=list(layout.slots), **fields)
        if lost_meanwhile:
            self.lose(lost_meanwhile, "while the epoch was announced")

    def _dispatch_issue(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        tag = message_tag(layer, h.index, self.m)
        control = self._control(layer)
        with self.side.timer.time(DISPATCH.name, record=not h.empty):
            hidden, ids = self.side.dispatch_rows(h)
            owners = ids
            if not h.empty:
                owners = self.route.workers(ids, h.batch.positions)
                if self.recorder is not None:
                    self.recorder.record(layer, ids)
            h.routes, h.receives = [], []
            for worker in sorted(self.layout.alive):
                rank = self.expert_ranks[worker]
                token, slot = (owners == worker).nonzero(as_tuple=True)
                h.routes.append((token, slot))
                message = Dispatch(control, hidden[token].contiguous(), ids[token, slot])
                h.sends.append(_SendToleratingLoss(self.comm.isend(rank, message.encode(), tag), self, worker))
                h.receives.append((worker, self.comm.irecv(rank, tag)))
        h.issued_at = time.perf_counter()

    def _combine_wait(self, h: MicroBatchHandle, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        lost: set[int] = set()

        def wait() -> list[Combine | None]:
            replies: list[Combine | None] = []
            for worker, work in h.receives:
                try:
                    replies.append(Combine.decode(work.wait(self.timeout_s)))
                except PeerError:
                    replies.append(None)
                    lost.add(worker)
            return replies

        replies = self.side.wait_combine(h, wait)
        if lost:
            self.lose(lost, f"M2N combine of layer {layer}, micro-batch {h.index}")
        self.side.note_combine(h, layer, next((r for r in replies if r is not None), None))
        if h.empty:
            return
        tokens, k = h.attn.expert_ids.shape
        out = torch.zeros(tokens, k, self.spec.hidden_size, dtype=self.spec.torch_dtype())
        missing: list[torch.Tensor] = []
        for (token, slot), reply in zip(h.routes, replies, strict=True):
            if reply is None:
                missing.append(token * k + slot)
            else:
                out[token, slot] = reply.outputs
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
                message = Dispatch(control, h.attn.tokens[token[rows]].contiguous(), ids[rows])
                self.comm.isend(rank, message.encode(), RESEND_TAG)
                pending.append((worker, rows, self.comm.irecv(rank, RESEND_TAG)))
            again, lost = [], set()
            for worker, rows, work in pending:
                try:
                    reply = Combine.decode(work.wait(self.timeout_s))
                except PeerError:
                    again.append(flat[rows])
                    lost.add(worker)
                    continue
                out[token[rows], slot[rows]] = reply.outputs
            if lost:
                self.lose(lost, "M2N resend")
            flat = torch.cat(again) if again else flat[:0]
        self.events.append({"event": "resent", "t": time.monotonic(), "micro_batch": h.index})


class ElasticExpertWorker(ExpertWorker):
    """An expert worker that serves resends, follows the alive mask the attention workers send, and enters the
    layout epochs they start (moving weights with `mover`, a `WeightMover`; None when epochs are off)."""

    def __init__(self, *args: Any, layout: ElasticLayout, index: int, restore: bool,
                 kill_at_step: int | None = None, kill_file: str | None = None, mover: Any = None, epoch: int = 0,
                 droppable_attention: Collection[int] = (), sync_store: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.droppable_attention = frozenset(droppable_attention)  # attention ranks whose loss is survived
        # Layout epochs: where a dropped attention worker is posted lost, so the others stop waiting for it at
        # their step boundaries (`elastic.sync`).
        self.sync_store = sync_store
        self._attention_index = {rank: i for i, rank in enumerate(self.attention_ranks)}
        self.layout, self.index, self.restore = layout, index, restore
        self.kill_at_step, self.kill_file = kill_at_step, kill_file
        self.mover, self.epoch = mover, epoch
        # An announced epoch whose moves have not started: (epoch, slots, the workers it admits as a mask).
        self._announced: tuple[int, list[int], int] | None = None
        self._prefetch: Any = None  # the moves of an announced epoch in flight (`moves.Prefetch`)
        self._retire_pending = False  # the previous epoch's weights are still held (`ExpertStore.retire`)
        self.generations: dict[int, int] = {}  # expert worker -> replacements seen joining
        self.events: list[dict[str, Any]] = []
        self._last_moe = self.spec.moe_layer_ids[-1]
        self._resends = {rank: self.comm.irecv(rank, RESEND_TAG) for rank in self.attention_ranks}

    def close(self) -> None:
        """Close the dispatch/combine channel and the weight channel."""
        super().close()
        if self.mover is not None:
            self.mover.comm.close()

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

    def _enter_epoch(self, controls: list[ElasticControl]) -> None:
        """Follow the epochs the controls carry (all of one step carry the same): enter the current one
        (finishing its moves), and start the moves of an announced one."""
        current, announced = {c.epoch for c in controls}, {c.announced for c in controls}
        if max(announced) <= self.epoch:
            return
        if len(current) > 1 or len(announced) > 1:
            raise RuntimeError(f"attention workers sent layout epochs {sorted(current)} (announced "
                               f"{sorted(announced)}) in one step: they must switch at the same step boundary")
        if self.mover is None:
            raise RuntimeError(f"layout epoch {max(announced)} started but expert worker {self.index} has no channel "
                               "to the other expert workers (the plan enables neither rebalancing nor rejoining)")
        control = controls[0]
        epoch, upcoming = control.epoch, control.announced
        if epoch > self.epoch:
            if self._announced is not None and self._announced[0] == epoch:  # announced, not yet started
                self._start_announced()
            if self._prefetch is None or self._prefetch.epoch != epoch:  # not announced to this worker (a newcomer)
                self._prefetch = self._start(epoch, list(control.slots), control.mask)
            if self._retire_pending:  # two switches within one round (never with an epoch per announcing step)
                self.part.retire()
            report = self.mover.finish(self._prefetch, self.part)
            self.layout, self.epoch, self._prefetch = self._prefetch.layout, epoch, None
            self._retire_pending = True
            self.events.append({"event": "moved", "t": time.monotonic(), "step": self.decode_steps, **report})
        if upcoming > self.epoch and (self._prefetch is None or self._prefetch.epoch != upcoming) and \
                (self._announced is None or self._announced[0] != upcoming):
            mask = control.mask
            for other in controls:
                mask &= other.mask
            self._announced = (upcoming, list(control.announced_slots), mask)  # moved when this worker is idle

    def _moves_pending(self) -> bool:
        return self._announced is not None or (self._prefetch is not None and not self._prefetch.assembled)

    def _idle(self) -> bool:
        """One piece of the announced epoch's moves, done while waiting for a dispatch: start them, or build the
        new share once what it gains arrived. Whether there was something to do."""
        if self._announced is not None:
            self._start_announced()
            return True
        if self._prefetch is not None and not self._prefetch.assembled and self.mover.ready(self._prefetch):
            self.mover.assemble(self._prefetch, self.part)
            return True
        return False

    def _start_announced(self) -> None:
        epoch, slots, mask = self._announced
        self._announced = None
        self._prefetch = self._start(epoch, slots, mask)

    def _combine_issue(self, mb: int, layer: int) -> None:
        issued = len(self._sends)
        super()._combine_issue(mb, layer)
        if self.droppable_attention:
            ranks = self.attention_ranks if self.spec.is_moe(layer) else []
            self._sends[issued:] = [_SendToAttention(work, self, rank)
                                    for work, rank in zip(self._sends[issued:], ranks, strict=True)]

    def _start(self, epoch: int, slots: list[int], mask: int) -> Any:
        """Connect the newcomers of epoch `epoch` (the workers its table adds whose bit `mask`, the announcing
        controls' mask, sets: a table decided before a loss was seen may still hold the lost worker, which the
        switch drops again) and start its moves (`WeightMover.start`)."""
        new = ElasticLayout.from_slots(self.layout.num_experts, self.layout.workers, slots, self.layout.groups,
                                       self.layout.nodes)
        self._follow(new.mask)  # losses the new epoch already accounts for, as within an epoch
        for worker in sorted(new.alive - self.layout.alive):
            if not mask >> worker & 1:
                continue
            self.generations[worker] = self.generations.get(worker, 0) + 1
            if worker != self.index:
                try:
                    self.mover.connect(worker, self.generations[worker])
                except PeerError:  # it died while joining: the attention workers will see it lost
                    self.events.append({"event": "rejoin-failed", "t": time.monotonic(), "worker": worker})
        return self.mover.start(epoch, self.layout, new, self.part)

    def _wait_serving(self, work: Any) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._moves_pending() and not self._arrived(work) and self._idle():
                continue  # the moves advanced while the dispatch was on its way: look again
            try:
                return work.wait(max(1e-3, min(_SLICE_S, deadline - time.monotonic())))
            except PeerTimeout:  # the slice ran out, the peer is alive: serve resends, wait on
                if time.monotonic() >= deadline:
                    raise
            self._serve_resends()

    @staticmethod
    def _arrived(work: Any) -> bool:
        try:
            return work.done()
        except PeerError:  # the wait below raises it
            return True

    def _serve_resends(self) -> None:
        for rank, work in list(self._resends.items()):
            try:
                if not work.done():
                    continue
            except PeerError:
                if not self._droppable(rank):
                    raise
                self._drop_attention(rank)
                continue
            message = Dispatch.decode(work.wait(0))
            control = message.control
            self._enter_epoch([control])
            self._follow(control.mask)
            tokens = message.tokens
            out = self.part(control.layer, tokens, message.expert_ids) if tokens.shape[0] else tokens
            self.count(control.layer, message.expert_ids)
            self.comm.isend(rank, Combine(False, out.contiguous()).encode(), RESEND_TAG)
            self._resends[rank] = self.comm.irecv(rank, RESEND_TAG)

    def _receive(self, mb: int, layer: int) -> list[Dispatch]:
        if self.kill_at_step is not None and self.decode_steps == self.kill_at_step and layer == self._last_moe \
                and mb == 0:
            self._die()
        works = [(rank, self.comm.irecv(rank, message_tag(layer, mb, self.m))) for rank in self.attention_ranks]
        received = []
        for rank, work in works:
            try:
                received.append(Dispatch.decode(self._wait_serving(work)))
            except PeerTimeout:
                raise
            except PeerError:
                if not self._droppable(rank):
                    raise
                self._drop_attention(rank)
        return received

    def _droppable(self, rank: int) -> bool:
        """Whether the loss of attention worker `rank` can be survived (online: one the plan lets go, while
        another is left; one already dropped: its last receives fail too)."""
        return rank in self.droppable_attention and (rank not in self.attention_ranks or len(self.attention_ranks) > 1)

    def _drop_attention(self, rank: int) -> None:
        """Serve the other attention workers only (online serving moved the lost one's requests)."""
        if rank not in self.attention_ranks:
            return
        self.attention_ranks = [r for r in self.attention_ranks if r != rank]
        self._resends.pop(rank, None)
        self.events.append({"event": "attention-lost", "t": time.monotonic(), "rank": rank})
        if self.sync_store is not None:
            from mbridge_epoverlap.serving.elastic.sync import post_attention_lost

            post_attention_lost(self.sync_store, self._attention_index[rank])

    def _dispatch_wait(self, mb: int, layer: int) -> None:
        if not self.spec.is_moe(layer):
            return
        super()._dispatch_wait(mb, layer)
        controls = [msg.control for msg in self._received[mb]]
        self._enter_epoch(controls)
        mask = self.layout.mask
        for control in controls:
            mask &= control.mask
        self._follow(mask)
        if self._retire_pending and mb == self.m - 1 and all(c.epoch == self.epoch for c in controls):
            # The last micro-batch of a round of the new epoch is here: every attention worker has waited for
            # (and re-sent) all it routed by the old table, so the old weights can go.
            self._retire_pending = False
            self.events.append({"event": "retired", "t": time.monotonic(), "step": self.decode_steps,
                                "dropped": self.part.retire()})

    def _die(self) -> None:
        """Fault injection: SIGKILL this process mid-decode (after noting when, for the bench)."""
        if self.kill_file:
            with open(self.kill_file, "w") as fh:
                fh.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
