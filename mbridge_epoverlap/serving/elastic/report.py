"""What an elastic run went through: losses, re-placements, restored experts, and the interruption they cost.

Every time here is `time.monotonic()` taken in the worker processes (one clock on one host): the killed
worker notes when it died, attention workers note every token and when they detected the loss.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def elastic_summary(plan: Any, collected: dict[str, Any]) -> dict[str, Any]:
    """The elastic part of an engine result.

    Keys: `lost_workers` (expert worker indices), `events` (detected / re-placed / restored / resumed, from
    every worker, in time order, seconds after the first kill when there was one), `restored_experts`,
    `detected_after_s` (first detection after the kill), `interruption_s` (from the kill to the moment
    every request in flight had produced its next token), `throughput_before` / `throughput_after`
    (tokens/s before the kill and after that moment, up to a rejoin), `survivors_share` (live expert workers
    over all); `streamed` (every attention worker ran its decode steps without draining the pipeline between
    them); `rebalances` (each layout epoch attention worker 0 started or considered: decode step, expert
    copies moved and those a solve from scratch would have moved, which solve was adopted, max/mean load of
    the measured window before and after; `kept` when nothing moved, `skipped` when the load was within the
    threshold and nothing was solved); with a replacement, `rejoined_workers`, `rejoined_after_s` (from the
    kill to its admission) and `throughput_after_rejoin`; `failures` (`failure_rows`: one row per step that
    killed workers, for several failures one after another); `first_token_at` (the first token's
    `time.monotonic()` stamp, for start-up to first token); `move_fallbacks` (each weight message whose source
    died during a move: the expert worker that read those experts from the checkpoint instead, the epoch, the
    source, the experts); `event_counts` (`workers_lost`, `rejoined`, `rebalances`: layout epochs entered for
    the load, `moved_copies`: expert copies that changed owner at those epochs and at rejoins,
    `move_fallbacks`).
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
    lead = [e for e in events if e["worker"] == "attention 0"]
    rejoins = [e for e in lead if e["event"] == "rejoined"]
    summary: dict[str, Any] = {
        "lost_workers": lost, "restored_experts": restored,
        "survivors_share": (plan.expert_workers - len(lost)) / plan.expert_workers,
        "interruption_s": None, "detected_after_s": None, "throughput_before": None, "throughput_after": None,
        "rebalances": [{k: e.get(k) for k in ("step", "epoch", "moved", "moved_from_scratch", "solve",
                                              "imbalance_before", "imbalance_after")}
                       | {"kept": e["event"] != "rebalanced", "skipped": e["event"] == "rebalance-skipped"}
                       for e in lead if e["event"] in ("rebalanced", "rebalance-kept", "rebalance-skipped")],
        "streamed": all(r.get("streamed", False) for r in ranks if r["role"] == "attention"),
        "rejoined_workers": sorted({w for e in rejoins for w in e.get("joined", [])}),
        "rejoined_after_s": None, "rejoin_wait_s": None, "throughput_after_rejoin": None, "failures": [],
    }
    if kill is not None:
        detected = [e["t"] for e in events if e["event"] == "detected"]
        summary["detected_after_s"] = min(detected) - kill if detected else None
        resumed = interruption_end(times, kill)
        rejoined = min((e["t"] for e in rejoins if e["t"] > kill), default=None)
        due = None
        if rejoined is not None:
            # Decoding held at the admission step while the replacement was still starting: not the survivors'
            # throughput, so the "after" window ends where that wait began.
            ready = [e for e in lead if e["event"] == "rejoin-ready" and e["t"] <= rejoined]
            waited = sum(e.get("waited_s", 0.0) for e in ready)
            summary["rejoined_after_s"], summary["rejoin_wait_s"] = rejoined - kill, waited
            due = min((e["t"] - e.get("waited_s", 0.0) for e in ready), default=rejoined)
        if resumed is not None:
            summary["interruption_s"] = resumed - kill
            summary.update(throughput_around(times, kill, resumed, due, rejoined))
        summary["failures"] = failure_rows(plan.kill, killed, events, times, due)
    summary["first_token_at"] = min((ts[0] for ts in times if ts), default=None)
    # Which decode step the replacement joined at (tokens each request had by then, the median): a run without a
    # failure gives the rate of the same steps (`rate_from_step`), at the same context lengths.
    summary["rejoined_at_token"] = (statistics.median(sum(1 for t in ts if t <= rejoined) for ts in times)
                                    if kill is not None and rejoined is not None and times else None)
    summary["move_fallbacks"] = [{"worker": e["worker"], "epoch": e.get("epoch"), **f} for e in events
                                 if e["event"] == "moved" for f in e.get("fallbacks", [])]
    epochs = [e for e in lead if e["event"] in ("rebalanced", "rejoined")]
    summary["event_counts"] = {
        "workers_lost": len(lost), "rejoined": len(summary["rejoined_workers"]),
        "rebalances": sum(e["event"] == "rebalanced" for e in epochs),
        "moved_copies": sum(e.get("moved", 0) for e in epochs), "move_fallbacks": len(summary["move_fallbacks"]),
    }
    origin = kill if kill is not None else (events[0]["t"] if events else 0.0)
    summary["events"] = [{**{k: v for k, v in e.items() if k != "t"}, "at_s": round(e["t"] - origin, 6)}
                         for e in events]
    return summary


def interruption_end(token_times: Sequence[Sequence[float]], kill: float) -> float | None:
    """When every request that was decoding at `kill` (tokens before and after it) produced its next token."""
    nexts = [next(t for t in times if t > kill) for times in token_times
             if times and times[0] <= kill < times[-1]]
    return max(nexts) if nexts else None


def throughput_around(token_times: Sequence[Sequence[float]], kill: float, resumed: float,
                      due: float | None = None, rejoined: float | None = None) -> dict[str, float | None]:
    """Tokens/s from the first token to the kill, from `resumed` to the last token (or to `due`, when a
    replacement's admission began), and from `rejoined` to the last token."""
    flat = sorted(t for times in token_times for t in times)
    start, end = flat[0], flat[-1]

    def rate(lo: float, hi: float) -> float:
        return sum(1 for t in flat if lo < t <= hi) / (hi - lo) if hi > lo else 0.0

    out: dict[str, float | None] = {"throughput_before": rate(start, kill)}
    if due is not None and rejoined is not None and resumed < due <= rejoined < end:
        out.update(throughput_after=rate(resumed, due), throughput_after_rejoin=rate(rejoined, end))
    else:
        out["throughput_after"] = rate(resumed, end)
    return out


def rate_from_step(completions: Sequence[dict[str, Any]], step: float) -> float | None:
    """Tokens/s of a run's decode steps from `step` on (0-based, rounded down): each request's token times from
    its `ttft_ms` and `tbt_ms` (requests that arrived together, as the bench's do), from the earliest of the
    `step`-th tokens to the last token."""
    first = int(step)
    later = []
    for c in completions:
        if c.get("ttft_ms") is None:
            continue
        times = [c["ttft_ms"]]
        for gap in c.get("tbt_ms", []):
            times.append(times[-1] + gap)
        if len(times) > first + 1:
            later.append(times[first:])
    if not later:
        return None
    start, end = min(ts[0] for ts in later), max(ts[-1] for ts in later)
    tokens = sum(len(ts) - 1 for ts in later)  # the tokens after each request's `step`-th
    return tokens / ((end - start) / 1e3) if end > start else None


def failure_rows(victims: Sequence[Sequence[int]], killed: dict[int, float], events: Sequence[dict[str, Any]],
                 token_times: Sequence[Sequence[float]], due: float | None = None) -> list[dict[str, Any]]:
    """One row per decode step that killed expert workers (`victims`: `(worker, step)` pairs), in kill order.

    Keys: `step`, `workers` (killed then), `failed_workers` (killed so far), `interruption_s` (that kill to the
    next token of every request in flight) and its phases, which add up to it: `detection_s` (kill to the first
    attention worker's `detected` naming one of them), `switch_s` (to that worker's re-placement: the new table
    in use) and `recovery_s` (to the end of the interruption: the resends served, weights loaded by their new
    holders, the step finished); `weight_load_s` (the longest expert-worker load of experts it now holds in that
    time, part of the recovery); `throughput_after` (tokens/s from the end of the interruption to the next kill,
    a replacement's admission `due`, or the last token) and `after_over_before` (over the rate before the first
    kill). A phase that did not happen is None.
    """
    flat = sorted(t for times in token_times for t in times)
    kills = []
    for step in sorted({int(s) for _, s in victims}):
        workers = sorted(int(w) for w, s in victims if s == step and int(w) in killed)
        if workers:
            kills.append((step, workers, min(killed[w] for w in workers)))
    if not kills or not flat:
        return []

    def rate(lo: float, hi: float) -> float | None:
        return sum(1 for t in flat if lo < t <= hi) / (hi - lo) if hi > lo else None

    before = rate(flat[0], kills[0][2])
    rows, failed = [], 0
    for i, (step, workers, kill) in enumerate(kills):
        failed += len(workers)
        resumed = interruption_end(token_times, kill)
        detected = next((e for e in events if e["event"] == "detected" and e["t"] >= kill
                         and set(e.get("workers", ())) & set(workers)), None)
        switched = next((e for e in events if detected is not None and e["event"] == "re-placed"
                         and e["worker"] == detected["worker"] and e["t"] >= detected["t"]), None)
        loads = [e.get("load_s", 0.0) for e in events if e["event"] == "re-placed" and "load_s" in e
                 and resumed is not None and kill <= e["t"] <= resumed]
        end = kills[i + 1][2] if i + 1 < len(kills) else (due if due is not None and resumed is not None
                                                           and due > resumed else flat[-1])
        after = rate(resumed, end) if resumed is not None else None
        rows.append({
            "step": step, "workers": workers, "failed_workers": failed,
            "interruption_s": resumed - kill if resumed is not None else None,
            "detection_s": detected["t"] - kill if detected is not None else None,
            "switch_s": switched["t"] - detected["t"] if switched is not None else None,
            "recovery_s": resumed - switched["t"] if switched is not None and resumed is not None else None,
            "weight_load_s": max(loads) if loads else None,
            "throughput_after": after,
            "after_over_before": after / before if after is not None and before else None,
        })
    return rows
