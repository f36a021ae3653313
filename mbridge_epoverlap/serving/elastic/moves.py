"""Expert weights that change owner when a new layout epoch starts, moved from a live holder over M2N.

When a rebalance or a replacement worker changes the placement, each expert a worker gains comes from a
worker that held it in the previous epoch (`transfers`: `eplb.migration_plan` reduced to one message per
(source, destination) pair), over a communicator between the expert workers (the same M2N transport as
dispatch and combine, with slots sized for weights: `expert_store.weight_slot_bytes`). Why not from the host-memory or
on-disk copy, which the loss path uses for experts whose every replica died: a live replica is the one copy
that is certainly current and certainly there (a checkpoint directory may sit on a slow or remote file
system, a recipe model would be redrawn, and a host copy per worker costs host memory for every expert),
and the transfer is one memory copy per tensor on this host (an RDMA write between GPUs on a cluster),
independent of the storage. The disk copy remains the fallback when the source dies during the move.

The protocol needs no agreement round: every expert worker derives the same transfers from the same two
layouts. The attention workers announce an epoch one step before they switch to it; in the announcing step
each expert worker, when it is next idle (waiting for a dispatch), sends what it must (one message per
destination, which fits a free slot, so the send completes at once and nothing waits for it) and posts its
receives (`WeightMover.start`), while that step still runs on the old weights; once they arrived (`ready`),
again while idle, it builds its new share as one part beside the old one (`WeightMover.assemble`), and at the
switch it only swaps them (`WeightMover.finish`, which does what was left). So the copies run beside the
decode steps instead of stalling one.

A source that dies before its message arrives (a failure in the middle of a move): the destination reads those
experts from the checkpoint instead (when restoring is allowed) and names the fallback in its report
(`fallbacks`: the source, the experts); the attention workers see the loss in the same step's combine and drop
the source from the epoch they enter. The test hook `MOVE_FAULT_ENV` kills a source at a chosen point of a move.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mbridge_epoverlap.comm.m2n.base import PeerError
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.elastic import eplb
from mbridge_epoverlap.serving.elastic.layout import ElasticLayout, ExpertsLostError

# Test hook, `EPOCH:MESSAGES`: in the moves of layout epoch EPOCH, the expert worker of lowest index among those
# that send weights SIGKILLs itself once it has sent MESSAGES of its weight messages (0: before the first).
MOVE_FAULT_ENV = "MBRIDGE_EPOVERLAP_MOVE_FAULT"


def move_fault(epoch: int, plan: dict[tuple[int | None, int], list[int]], index: int) -> int | None:
    """The weight messages worker `index` sends in `epoch` before the test hook kills it; None: it is not killed.

    Raises:
        UsageError: `MOVE_FAULT_ENV` is set but is not `EPOCH:MESSAGES`.
    """
    text = os.environ.get(MOVE_FAULT_ENV, "")
    if not text:
        return None
    try:
        at, sent = (int(part) for part in text.split(":"))
    except ValueError:
        raise UsageError(f"{MOVE_FAULT_ENV}={text!r}: expected EPOCH:MESSAGES (two integers, e.g. 1:0), or unset it"
                         ) from None
    sources = sorted({source for source, _ in plan if source is not None})
    return sent if epoch == at and sources and sources[0] == index else None


def transfers(old: ElasticLayout, new: ElasticLayout) -> dict[tuple[int | None, int], list[int]]:
    """`{(source worker, destination worker): experts}` that turn `old` into `new`.

    A destination is a live worker of `new`; it gains the experts it holds in `new` and not in `old`, each from
    the first live holder in `old` (`eplb.migration_plan`'s source, reduced to workers). Source None: no live
    holder (the weights come from the checkpoint). Ordered by (source, destination), so every worker derives
    the same sequence.
    """
    per = new.slots_per_worker
    moves = eplb.migration_plan(torch.tensor([old.slots]), torch.tensor([new.slots]), old.workers,
                                alive_gpus=sorted(old.alive))
    held = {w: set(old.experts_of(w)) for w in range(old.workers)}
    out: dict[tuple[int | None, int], set[int]] = {}
    for move in moves:
        destination = move.slot // per
        if move.expert in held[destination]:
            continue
        source = None if move.source is None else move.source // per
        out.setdefault((source, destination), set()).add(move.expert)
    return {key: sorted(out[key]) for key in sorted(out, key=lambda k: (-1 if k[0] is None else k[0], k[1]))}


class WeightMover:
    """One expert worker's end of the moves.

    Args:
        comm: M2N communicator with the other expert workers.
        store: the M2N rendezvous store, to connect a replacement worker's channel.
        ranks: rank of each expert worker, by index.
        index: this worker's index.
        timeout_s: limit of every wait.
        restore: whether an expert whose source died mid-move may be read from the checkpoint.
    """

    def __init__(self, comm: Any, store: Any, ranks: list[int], index: int, timeout_s: float, restore: bool) -> None:
        self.comm, self.store, self.ranks, self.index = comm, store, ranks, index
        self.timeout_s, self.restore = timeout_s, restore

    def connect(self, worker: int, generation: int) -> None:
        """Open the channel to replacement `generation` of expert worker `worker` (it connects from its side)."""
        self.comm.connect(self.ranks[worker], self.store, rejoin_prefix(worker, generation))

    def start(self, epoch: int, old: ElasticLayout, new: ElasticLayout, experts: Any) -> Prefetch:
        """Send what this worker gives for `new` and post the receives of what it gains (nothing waits here).

        Called in the step that announces the epoch; the step runs on the old weights meanwhile (nothing is
        dropped before `finish`).
        """
        started = time.monotonic()
        plan = transfers(old, new)
        pending = Prefetch(epoch, new)
        die_after = move_fault(epoch, plan, self.index)
        for (source, destination), ids in plan.items():
            if source == self.index:
                if die_after is not None and len(pending.sent) >= die_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # the test hook: a source lost in the middle of a move
                # w1 and w2 (and the experts' biases, where the model has them)
                tensors = [torch.tensor(ids, dtype=torch.int64), *(t.contiguous() for t in experts.export(ids))]
                with contextlib.suppress(PeerError):  # a destination without a channel (its connect failed)
                    pending.sends.append(self.comm.isend(self.ranks[destination], tensors, epoch))
                    pending.sent.append({"to": destination, "experts": ids})
        if die_after is not None:  # it had fewer messages to send than the hook lets through
            os.kill(os.getpid(), signal.SIGKILL)
        for (source, destination), ids in plan.items():
            if destination == self.index:
                work = None
                if source is not None:
                    with contextlib.suppress(PeerError):
                        work = self.comm.irecv(self.ranks[source], epoch)
                pending.receives.append((source, ids, work))
        pending.start_s = time.monotonic() - started
        return pending

    def ready(self, pending: Prefetch) -> bool:
        """Whether every receive of `pending` has arrived and every send was taken (or failed), so `assemble`
        would not wait (a send may complete only once its destination posted the receive, as on gloo: waiting
        for it while idle would hold this worker until the destination starts its own moves)."""
        for work in [work for _, _, work in pending.receives] + pending.sends:
            if work is None:
                continue
            try:
                if not work.done():
                    return False
            except PeerError:  # the source died: `assemble` falls back to the checkpoint at once
                continue
        return True

    def assemble(self, pending: Prefetch, experts: Any) -> None:
        """Wait for what this worker gains and build its whole share of the new layout as one part, beside the
        weights in use (called once this worker's last expert work of the announcing step is done, so the copies
        overlap the attention workers' end of step; `finish` then only swaps). A source that died is replaced
        by the checkpoint copy (a fallback, in `Prefetch.fallbacks`)."""
        started = time.monotonic()
        incoming: dict[int, tuple[torch.Tensor, ...]] = {}
        for source, ids, work in pending.receives:
            message = None
            if work is not None:
                with contextlib.suppress(PeerError):  # the source died: fall back to the checkpoint below
                    message = work.wait(self.timeout_s)
            if message is None:
                if not self.restore:
                    raise ExpertsLostError(ids, [] if source is None else [source])
                pending.restored += experts.ensure(ids)
                if source is not None:
                    pending.fallbacks.append({"from": source, "experts": ids, "read": "checkpoint"})
                continue
            got = message[0].tolist()
            if got != ids:
                raise RuntimeError(f"expert worker {source} sent experts {got} for layout epoch {pending.epoch}, "
                                   f"expert worker {self.index} expected {ids}: the workers disagree on the layouts")
            for i, expert in enumerate(ids):
                incoming[expert] = tuple(t[:, i] for t in message[1:])
            pending.received.append({"from": source, "experts": ids})
        for work in pending.sends:
            with contextlib.suppress(PeerError):  # a destination that died gets its share re-placed later
                work.wait(self.timeout_s)
        pending.part = experts.build(pending.layout.experts_of(self.index), incoming)
        pending.assembled = True
        pending.assemble_s = time.monotonic() - started

    def finish(self, pending: Prefetch, experts: Any) -> dict[str, Any]:
        """Enter the new layout: `assemble` if that has not happened yet, then hold exactly the new share.

        Returns:
            What happened: experts received (and from whom), sent, restored from the checkpoint, the fallbacks
            (sources that died mid-move), dropped, and the seconds spent starting, assembling and at the switch.
        """
        started = time.monotonic()
        if not pending.assembled:
            self.assemble(pending, experts)
        dropped = experts.adopt(pending.part)
        return {"epoch": pending.epoch, "received": pending.received, "sent": pending.sent,
                "restored": sorted(pending.restored), "fallbacks": pending.fallbacks, "dropped": dropped,
                "prefetch_s": pending.start_s, "assemble_s": pending.assemble_s,
                "switch_s": time.monotonic() - started}


@dataclass
class Prefetch:
    """The moves of one announced epoch in flight on one expert worker."""

    epoch: int
    layout: ElasticLayout
    sends: list[Any] = field(default_factory=list)
    sent: list[dict[str, Any]] = field(default_factory=list)
    receives: list[tuple[int | None, list[int], Any]] = field(default_factory=list)  # (source, experts, Work)
    received: list[dict[str, Any]] = field(default_factory=list)
    restored: list[int] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)  # sources that died: read from the checkpoint
    part: Any = None  # this worker's whole share of the new layout, once assembled (None: an empty share)
    assembled: bool = False
    start_s: float = 0.0
    assemble_s: float = 0.0


def rejoin_prefix(worker: int, generation: int) -> str:
    """The M2N rendezvous namespace in which replacement `generation` of expert worker `worker` connects."""
    return f"rejoin/{worker}/{generation}"

