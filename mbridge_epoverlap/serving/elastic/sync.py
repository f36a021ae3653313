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
`ready/<worker>/<generation>` (a replacement has started), `admit/<worker>/<generation>` (its admission: the
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


class StepSync:
    """One attention worker's end of the boundary agreement.

    Args:
        store: a store shared by every worker of the run (`set`, `get`, `wait`, `check`).
        index: this attention worker's index.
        attn_workers: how many there are.
        timeout_s: limit of every wait for another worker.
    """

    def __init__(self, store: Any, index: int, attn_workers: int, timeout_s: float) -> None:
        self.store, self.index, self.attn_workers, self.timeout_s = store, index, attn_workers, timeout_s

    def gather(self, step: int, dead: Sequence[int], load: torch.Tensor | None,
               active: bool = True) -> tuple[set[int], torch.Tensor | None, bool]:
        """Post this worker's losses, load and whether it has requests for `step`; return everybody's merged
        (union, sum, any)."""
        mine = {"dead": sorted(dead), "load": None if load is None else load.tolist(), "active": active}
        records = [mine]
        if self.attn_workers > 1:
            self.store.set(f"sync/{step}/{self.index}", json.dumps(mine))
            others = [i for i in range(self.attn_workers) if i != self.index]
            records += [json.loads(self._get(f"sync/{step}/{i}", f"attention worker {i}")) for i in others]
        merged = {w for r in records for w in r["dead"]}
        loads = [torch.tensor(r["load"], dtype=torch.int64) for r in records if r["load"] is not None]
        return merged, (torch.stack(loads).sum(0) if loads else None), any(r["active"] for r in records)

    def decide(self, step: int, decide: Callable[[], list[list[int]]]) -> list[list[int]]:
        """Attention worker 0 runs `decide` (the admissions `[[worker, generation], ...]`); the others read it."""
        if self.index == 0:
            admit = decide()
            if self.attn_workers > 1:
                self.store.set(f"decision/{step}", json.dumps(admit))
            return admit
        # Worker 0 may wait up to a timeout for a replacement before it decides.
        return json.loads(self._get(f"decision/{step}", "attention worker 0", self.timeout_s * 2 + 5))

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

    def _get(self, key: str, who: str, timeout_s: float | None = None) -> str:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.store.wait([key], timedelta(seconds=limit))
        except Exception as exc:
            raise RunFailedError(f"{who} did not reach the elastic step boundary within {limit:g} s "
                                 f"(waiting for '{key}': {exc})") from None
        return self.store.get(key).decode()


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
