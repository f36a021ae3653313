"""Per-stage wall times of one worker, for the bench's stage table and the simulator replay.

Besides the stages, `step_done` records each step's `overhead` stage: the step's wall time outside every timed
stage (building batches, the step agreement, bookkeeping: Python and scheduling). The replay adds it once per
step; without it the replay predicted decode 15-18 % faster than measured.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

OVERHEAD_STAGE = "overhead"


class StageTimer:
    """Collects durations by stage name; `busy_s` sums the compute stages."""

    def __init__(self, compute: frozenset[str]) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.compute = compute
        self.busy_s = 0.0
        self.started = time.monotonic()
        self._steady: tuple[float, float] | None = None  # (busy_s, time) when the first decode step ended
        # Keep about the last `limit` samples of each stage (None: all): an online worker runs for days.
        self.limit: int | None = None
        self._depth = 0  # stages open now (a stage timed inside another counts once in `timed_s`)
        self.timed_s = 0.0  # wall time inside timed stages, nested ones counted once
        self._step: tuple[float, float] | None = None  # (time, timed_s) when the current step started

    def mark_steady(self) -> None:
        """The prefill step is over: utilization counts from here (a prefill's long stages would swamp it)."""
        if self._steady is None:
            self._steady = (self.busy_s, time.monotonic())

    @contextmanager
    def time(self, stage: str, *, record: bool = True) -> Iterator[None]:
        start = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            elapsed = time.perf_counter() - start
            if self._depth == 0:
                self.timed_s += elapsed
            if record:
                self._add(stage, elapsed)
                if stage in self.compute:
                    self.busy_s += elapsed

    def step_started(self) -> None:
        """A step starts now (the previous one, if any, ended)."""
        self._step = (time.perf_counter(), self.timed_s)

    def step_done(self, *, record: bool = True) -> None:
        """The step begun at `step_started` ended: record its untimed wall time as stage `overhead` (not for a
        step without work: an idle server's step is mostly its wait for requests)."""
        if self._step is not None and record:
            started, timed = self._step
            self._add(OVERHEAD_STAGE, max(0.0, time.perf_counter() - started - (self.timed_s - timed)))
        self._step = None

    def record(self, stage: str, seconds: float) -> None:
        """A duration measured elsewhere (not counted as busy)."""
        self._add(stage, seconds)

    def _add(self, stage: str, seconds: float) -> None:
        samples = self.samples[stage]
        samples.append(seconds)
        if self.limit is not None and len(samples) > 2 * self.limit:  # trimmed now and then: amortized O(1)
            del samples[:-self.limit]

    def summary(self) -> dict[str, object]:
        """Median milliseconds and counts per stage, busy and wall seconds."""
        trips = sorted(self.samples.get("round_trip", []))
        now = time.monotonic()
        busy_from, wall_from = self._steady or (0.0, self.started)
        return {"median_ms": {k: statistics.median(v) * 1e3 for k, v in self.samples.items() if v},
                "round_trip_ms": [t * 1e3 for t in trips[: max(1, len(trips) // 10)]] if trips else [],
                "count": {k: len(v) for k, v in self.samples.items()},
                "busy_s": self.busy_s, "wall_s": now - self.started,
                "steady_busy_s": self.busy_s - busy_from, "steady_wall_s": now - wall_from}
