"""Per-stage wall times of one worker, for the bench's stage table and the simulator replay."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


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

    def mark_steady(self) -> None:
        """The prefill step is over: utilization counts from here (a prefill's long stages would swamp it)."""
        if self._steady is None:
            self._steady = (self.busy_s, time.monotonic())

    @contextmanager
    def time(self, stage: str, *, record: bool = True) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if record:
                elapsed = time.perf_counter() - start
                self._add(stage, elapsed)
                if stage in self.compute:
                    self.busy_s += elapsed

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
