"""The result of a simulation: timed events per resource and what they add up to.

Busy time is the length of the union of a resource's intervals, never a sum of durations, so the
numbers stay right even if a caller builds a timeline whose events overlap on one resource.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """One stage of one micro-batch and layer, timed on one resource."""

    resource: str
    micro_batch: int
    layer: int
    stage: str
    start: float
    end: float
    kind: str  # "compute" or "comm"

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "micro_batch": self.micro_batch,
            "layer": self.layer,
            "stage": self.stage,
            "start": self.start,
            "end": self.end,
            "kind": self.kind,
        }


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge intervals into sorted, disjoint ones; empty intervals vanish."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two sorted, disjoint interval lists."""
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class Timeline:
    """Timed events of a schedule.

    Attributes:
        events: every timed stage, in the order the simulator produced them.
        resources: resource names, streams first, then channels, each in order of first use.
        channels: the resources that carry collectives (the rest run compute).
        stalls: the time streams spent on communication steps instead of compute: issuing a collective
            (kind "issue", when issuing has a cost) and blocking in a wait (kind "wait"), one event each
            with the step's stage; not part of `events`, so busy time stays compute time.
    """

    events: tuple[Event, ...]
    resources: tuple[str, ...]
    channels: frozenset[str] = field(default_factory=frozenset)
    stalls: tuple[Event, ...] = ()

    def stalled(self) -> dict[str, float]:
        """Total stall time per "<stage>.<kind>" (e.g. "dispatch_bwd.wait"): where the streams waited."""
        out: dict[str, float] = {}
        for e in self.stalls:
            key = f"{e.stage}.{e.kind}"
            out[key] = out.get(key, 0.0) + e.duration
        return out

    @property
    def makespan(self) -> float:
        """Time from 0 to the end of the last event."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(r for r in self.resources if r not in self.channels)

    def intervals(self, resources: Iterable[str]) -> list[tuple[float, float]]:
        """Union of the busy intervals of `resources`."""
        wanted = set(resources)
        return union((e.start, e.end) for e in self.events if e.resource in wanted)

    def busy(self) -> dict[str, float]:
        """Busy time per resource."""
        return {r: length(self.intervals([r])) for r in self.resources}

    def utilization(self) -> dict[str, float]:
        """Busy time over makespan per resource (0 for an empty timeline)."""
        span = self.makespan
        return {r: (b / span if span > 0 else 0.0) for r, b in self.busy().items()}

    def idle(self) -> dict[str, float]:
        """Makespan minus busy time per resource."""
        span = self.makespan
        return {r: span - b for r, b in self.busy().items()}

    def overlap(self, a: Iterable[str], b: Iterable[str]) -> float:
        """Time during which some resource of `a` and some resource of `b` are both busy."""
        return length(intersect(self.intervals(a), self.intervals(b)))

    def exposed_comm(self) -> float:
        """Time some channel is busy while no compute stream is: communication nobody hid."""
        comm = self.intervals(self.channels)
        return length(comm) - length(intersect(comm, self.intervals(self.streams)))

    def summary(self) -> str:
        """One line: makespan, then utilization per resource, then exposed communication."""
        parts = [f"makespan {self.makespan:.4g}"]
        parts += [f"{r} {u:.0%}" for r, u in self.utilization().items()]
        if self.channels:
            parts.append(f"exposed comm {self.exposed_comm():.4g}")
        return "; ".join(parts)

    def to_dict(self, *, events: bool = False) -> dict[str, Any]:
        """JSON-ready summary; with `events`, every event too."""
        out: dict[str, Any] = {
            "makespan": self.makespan,
            "utilization": self.utilization(),
            "idle": self.idle(),
            "busy": self.busy(),
            "exposed_comm": self.exposed_comm(),
            "resources": list(self.resources),
        }
        if events:
            out["events"] = [e.to_dict() for e in self.events]
        return out
