"""Attention workers agree, at a step boundary, on what the next layout epoch is: rebalanced, a worker rejoined.

At every sync step each attention worker posts to the run's TCP store what it knows: the expert load it
recorded (`eplb.ExpertLoadRecorder`, summed over MoE layers since every expert worker holds the same experts
in every layer) and the expert workers it has seen die. Every attention worker reads every record and merges
them the same way: the union of the losses, the sum of the loads (integer token counts: exact in any order).
Attention worker 0 then adds the decision on replacement workers (which to admit now) and every other reads
it. So they all leave the boundary with the same inputs to `ElasticLayout.resolved`, hence the same epoch,
and nothing passes between them during a step. With one attention worker nothing goes through the store
except a replacement's readiness.

Store keys (under the run's `elastic/` prefix): `sync/<step>/<attention index>`, `decision/<step>`,
`attention_lost/<attention index>` (an expert worker saw it die), `ready/<worker>/<generation>` (a
replacement has started), `admit/<worker>/<generation>` (its admission: the
step and the layout it joins from), `done` (the run is over: a replacement still waiting leaves).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from mbridge_epoverlap.errors import RunFailedError

_POLL_S = 0.02
_FIRST_POLL_S = 0.0005


class StepSync:
    """One attention worker's end of the boundary agreement.

    An attention worker may be lost (online serving, where the front end holds the store): an expert worker that
    drops it posts `attention_lost/<index>` (`post_attention_lost`). A record a worker posted before it died is
    read by every survivor (keys stay), so only a missing record is waited for, until it comes or the worker is
    posted lost: every survivor merges the same records. The decision is the lead's, the lowest attention index
    not lost; a survivor waiting for a lead that was lost turns to the next, so they all read one decision.

    Args:
        store: a store shared by every worker of the run (`set`, `get`, `wait`, `check`).
        index: this attention worker's index.
        attn_workers: how many there are.
        timeout_s: limit of every wait for another worker.
    """

    def __init__(self, store: Any, index: int, attn_workers: int, timeout_s: float) -> None:
        self.store, self.index, self.attn_workers, self.timeout_s = store, index, attn_workers, timeout_s
        self.lost: set[int] = set()  # attention workers seen lost while waiting for them

    @property
    def is_lead(self) -> bool:
        """Whether this worker decides (the lowest attention index not seen lost)."""
        return self.index == self._lead()

    def _lead(self) -> int:
        return min(i for i in range(self.attn_workers) if i not in self.lost)

    def gather(self, step: int, dead: Sequence[int], load: torch.Tensor | None,
               active: bool = True) -> tuple[set[int], torch.Tensor | None, bool]:
        """Post this worker's losses, load and whether it has requests for `step`; return everybody's merged
        (union, sum, any) over the attention workers that posted."""
        mine = {"dead": sorted(dead), "load": None if load is None else load.tolist(), "active": active}
        records = [mine]
        if self.attn_workers > 1:
            self.store.set(f"sync/{step}/{self.index}", json.dumps(mine))
            for i in range(self.attn_workers):
                if i == self.index or i in self.lost:
                    continue
                record = self._get_unless_lost(f"sync/{step}/{i}", i)
                if record is not None:
                    records.append(json.loads(record))
        merged = {w for r in records for w in r["dead"]}
        loads = [torch.tensor(r["load"], dtype=torch.int64) for r in records if r["load"] is not None]
        return merged, (torch.stack(loads).sum(0) if loads else None), any(r["active"] for r in records)

    def decide(self, step: int, decide: Callable[[], list[list[int]]]) -> list[list[int]]:
        """The lead runs `decide` (the admissions `[[worker, generation], ...]`); the others read it."""
        while True:
            lead = self._lead()
            if lead == self.index:
                admit = decide()
                if self.attn_workers > 1:
                    self.store.set(f"decision/{step}", json.dumps(admit))
                return admit
            # The lead may wait up to a timeout for a replacement before it decides.
            decision = self._get_unless_lost(f"decision/{step}", lead, self.timeout_s * 2 + 5)
            if decision is not None:
                return json.loads(decision)

    def wait_ready(self, worker: int, generation: int) -> bool:
        """Whether replacement `generation` of expert worker `worker` announced itself within half the timeout
        (the expert workers wait for this step's messages meanwhile, up to the whole timeout)."""
        try:
            self.store.wait([f"ready/{worker}/{generation}"], timedelta(seconds=self.timeout_s / 2))
        except Exception:  # the store's timeout type differs between versions
            return False
        return True

    def is_ready(self, worker: int, generation: int) -> bool:
        """Whether replacement `generation` of expert worker `worker` announced itself (no waiting)."""
        return self.store.check([f"ready/{worker}/{generation}"])

    def admit(self, worker: int, generation: int, step: int, epoch: int, slots: Sequence[int]) -> None:
        """Tell the replacement when it joins and the layout (epoch, slots) it joins from."""
        record = {"step": step, "epoch": epoch, "slots": list(slots)}
        self.store.set(f"admit/{worker}/{generation}", json.dumps(record))

    def finish(self) -> None:
        """The run is over: a replacement still waiting for admission can leave."""
        self.store.set("done", "1")

    def _get_unless_lost(self, key: str, worker: int, timeout_s: float | None = None) -> str | None:
        """`key`'s value once it is posted, or None when attention worker `worker` was posted lost first (then it
        is in `lost`); RunFailedError after the timeout."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        lost = f"attention_lost/{worker}"
        pause = _FIRST_POLL_S
        while True:
            if self.store.check([key]):  # a record posted before its worker died still counts: look first
                return self.store.get(key).decode()
            if self.store.check([lost]):
                self.lost.add(worker)
                return None
            if time.monotonic() >= deadline:
                raise RunFailedError(f"attention worker {worker} did not reach the elastic step boundary within "
                                     f"{limit:g} s (waiting for '{key}')")
            # Polled, not `store.wait`ed: a wait that times out logs a warning each time, and the poll starts
            # short (the others usually post within a few milliseconds) and backs off.
            time.sleep(pause)
            pause = min(_POLL_S, 2 * pause)


def post_attention_lost(store: Any, index: int) -> None:
    """(An expert worker that dropped it) attention worker `index` is gone: the others stop waiting for it."""
    store.set(f"attention_lost/{index}", "1")


def wait_admission(store: Any, worker: int, generation: int, limit_s: float) -> dict[str, Any] | None:
    """A replacement's wait for its admission record; None when the run ended first (or the store went away)."""
    key = f"admit/{worker}/{generation}"
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if store.check([key]):
                return json.loads(store.get(key).decode())
            if store.check(["done"]):
                return None
        except Exception:  # the store lives in attention worker 0: gone means the run is over
            return None
        time.sleep(_POLL_S)
    return None
