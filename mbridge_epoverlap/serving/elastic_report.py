"""What an elastic run went through: losses, re-placements, restored experts, and the interruption they cost.

Every time here is `time.monotonic()` taken in the worker processes (one clock on one host): the killed
worker notes when it died, attention workers note every token and when they detected the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def elastic_summary(plan: Any, collected: dict[str, Any]) -> dict[str, Any]:
    """The elastic part of an engine result.

    Keys: `lost_workers` (expert worker indices), `events` (detected / re-placed / restored / resumed, from
    every worker, in time order, seconds after the first kill when there was one), `restored_experts`,
    `detected_after_s` (first detection after the kill), `interruption_s` (from the kill to the moment
    every request in flight had produced its next token), `throughput_before` / `throughput_after`
    (tokens/s before the kill and after that moment), `survivors_share` (live expert workers over all).
    """
    ranks = collected.get("ranks", [])
    first = min(plan.expert_ranks)
    lost = sorted(rank - first for rank in collected.get("lost_ranks", []))
    killed = collected.get("killed_at", {})
    kill = min(killed.values()) if killed else None
    events = []
    for r in ranks:
        for e in r.get("events", []):
            events.append({**e, "worker": f"{r['role']} {r['index']}"})
    events.sort(key=lambda e: e["t"])
    times = [ts for r in ranks for ts in r.get("token_times", {}).values()]
    restored = sorted({x for e in events for x in e.get("restored", []) + e.get("experts", [])
                       if e["event"] in ("re-placed", "restored")})
    summary: dict[str, Any] = {
        "lost_workers": lost, "restored_experts": restored,
        "survivors_share": (plan.expert_workers - len(lost)) / plan.expert_workers,
        "interruption_s": None, "detected_after_s": None, "throughput_before": None, "throughput_after": None,
    }
    if kill is not None:
        detected = [e["t"] for e in events if e["event"] == "detected"]
        summary["detected_after_s"] = min(detected) - kill if detected else None
        resumed = interruption_end(times, kill)
        if resumed is not None:
            summary["interruption_s"] = resumed - kill
            summary.update(throughput_around(times, kill, resumed))
    origin = kill if kill is not None else (events[0]["t"] if events else 0.0)
    summary["events"] = [{**{k: v for k, v in e.items() if k != "t"}, "at_s": round(e["t"] - origin, 6)}
                         for e in events]
    return summary


def interruption_end(token_times: Sequence[Sequence[float]], kill: float) -> float | None:
    """When every request that was decoding at `kill` (tokens before and after it) produced its next token."""
    nexts = [next(t for t in times if t > kill) for times in token_times
             if times and times[0] <= kill < times[-1]]
    return max(nexts) if nexts else None


def throughput_around(token_times: Sequence[Sequence[float]], kill: float, resumed: float) -> dict[str, float]:
    """Tokens/s from the first token to the kill, and from `resumed` to the last token."""
    flat = sorted(t for times in token_times for t in times)
    start, end = flat[0], flat[-1]
    before = sum(1 for t in flat if start < t <= kill)
    after = sum(1 for t in flat if resumed < t <= end)
    return {"throughput_before": before / (kill - start) if kill > start else 0.0,
            "throughput_after": after / (end - resumed) if end > resumed else 0.0}
