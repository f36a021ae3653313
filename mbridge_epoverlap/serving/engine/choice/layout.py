"""The layout `serve-bench` runs when no layout flag is given, chosen from a short measurement (`serve --prompts`
measures its own: `choice.offline`).

Four layouts are candidates on one machine of `cores` cores:

- one colocated process with every core (`--colocated 1`, m=1): a decode layer takes A_c(B) + E_c(B), the
  attention-side and expert times of the whole batch B with c threads;
- one colocated process with one thread (`--colocated 1 --threads 1`): A_1(B) + E_1(B); it leaves cores idle
  but streams each expert's weights once per step, where the split below streams them once per micro-batch
  (with many small experts a decode step is bound by that stream, and halving the batch barely halves E);
- one attention and one expert worker with half the cores each, ping-pong over m=2 micro-batches: a layer
  takes 2 * max(A_c/2(B/2), E_c/2(B/2)) (the two stages overlap, each micro-batch passes both);
- one colocated process per core, one thread each, EP across them (`--colocated N`): a layer takes
  A_1(B/N) + E_1(B, experts/N), each process attending to its share of the sequences and running its share
  of the experts for every token (so each expert's weights are streamed once per step, by one process).

`choose_layout` times both stages of one decode layer in this process (`bench.stage_probe`, a fraction
of a second on the shrunk models) at the batch and context the requests will have (and at half the batch
for the split), predicts the decode
tokens/s of each candidate and takes the faster; one colocated process with several threads must be
predicted `THREADS_MARGIN` faster than the one-thread workers (OpenMP threads stall each other on a shared
machine, which a short probe misses). What it measured and why it chose travel with the result
(`layout_choice`). Transfers between the workers and prefill are left out of the prediction: the measured
run says how far that is from the truth.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mbridge_epoverlap.serving.engine.plan import available_cores
from mbridge_epoverlap.serving.workers.requests import Request

THREADS_MARGIN = 1.3  # how much faster a layout with more threads per process must be predicted


def choose_layout(spec: Any, requests: Sequence[Request], *, max_new_tokens: int, max_batch: int = 64,
                  cores: int | None = None, rounds: int = 2) -> dict[str, Any]:
    """The layout to run `requests` with: {"layout" (make_plan keywords), "summary", "candidates", "probes"}."""
    import torch

    from mbridge_epoverlap.serving.engine.bench import stage_probe

    before = torch.get_num_threads()
    try:
        return _choose(spec, requests, max_new_tokens, max_batch, cores, rounds, stage_probe)
    finally:
        torch.set_num_threads(before)  # the probes set their own


def _choose(spec: Any, requests: Sequence[Request], max_new_tokens: int, max_batch: int, cores: int | None,
            rounds: int, stage_probe: Any) -> dict[str, Any]:
    cores = available_cores() if cores is None else cores
    batch = max(1, min(len(requests), max_batch))
    context = int(statistics.fmean(len(r.prompt_ids) for r in requests)) + max_new_tokens // 2
    layers = max(1, len(spec.moe_layer_ids))
    split = cores >= 2 and batch >= 2
    # A B A B, the lower of each's medians: a shared machine's stalls only ever make a probe slower.
    ranks = cores if split and spec.num_experts >= cores and batch >= cores else 0
    wholes, halves, singles, shares = [], [], [], []
    for _ in range(rounds):
        wholes.append(stage_probe(spec, batch, context=context, threads=cores))
        if split:
            halves.append(stage_probe(spec, max(1, batch // 2), context=context, threads=cores // 2))
        if cores > 1:
            singles.append(stage_probe(spec, batch, context=context, threads=1))
        if ranks:
            shares.append(stage_probe(spec, batch // ranks, attn_workers=ranks, expert_workers=ranks,
                                      context=context, threads=1))
    whole = _fastest(wholes)
    candidates: dict[str, dict[str, Any]] = {
        "colocated_1": {"layout": dict(colocated=1, micro_batches=1, order="sequential", threads=cores),
                        "layer_ms": whole["attn_ms"] + whole["experts_ms"]},
    }
    probes = [dict(whole, threads=cores)]
    if cores > 1:
        single = _fastest(singles)
        probes.append(dict(single, threads=1))
        candidates["colocated_1_thread_1"] = {
            "layout": dict(colocated=1, micro_batches=1, order="sequential", threads=1),
            "layer_ms": single["attn_ms"] + single["experts_ms"]}
    if split:
        half = _fastest(halves)
        probes.append(dict(half, threads=cores // 2))
        candidates["disaggregated_1+1_m2"] = {
            "layout": dict(attn_workers=1, expert_workers=1, micro_batches=2, threads=cores // 2),
            "layer_ms": 2 * max(half["attn_ms"], half["experts_ms"])}
    if ranks:
        share = _fastest(shares)
        probes.append(dict(share, threads=1, processes=ranks))
        candidates[f"colocated_{ranks}"] = {
            "layout": dict(colocated=ranks, micro_batches=1, order="sequential", threads=1),
            "layer_ms": share["attn_ms"] + share["experts_ms"]}
    for c in candidates.values():
        c["predicted_decode_tokens_per_s"] = batch / (layers * c["layer_ms"] / 1e3)
    best = min(candidates, key=lambda name: candidates[name]["layer_ms"])
    margin = False
    one_thread = [name for name, c in candidates.items() if c["layout"]["threads"] == 1]
    if candidates[best]["layout"]["threads"] > 1 and one_thread:
        fastest_single = min(one_thread, key=lambda name: candidates[name]["layer_ms"])
        if candidates[best]["layer_ms"] * THREADS_MARGIN > candidates[fastest_single]["layer_ms"]:
            # Several OpenMP threads in one process stall each other whenever the machine is shared (every op
            # waits for its slowest thread): measured here, 5-10x slower runs than the probe predicted. A
            # layout with more threads per process must win the probe by a margin.
            best, margin = fastest_single, True

    others = ", ".join(f"{name} {c['predicted_decode_tokens_per_s']:,.0f}" for name, c in candidates.items()
                       if name != best)
    layout = candidates[best]["layout"]
    summary = (f"{best} (threads per process {layout['threads']}, m={layout['micro_batches']}): predicted "
               f"{candidates[best]['predicted_decode_tokens_per_s']:,.0f} decode tokens/s at batch {batch}, "
               f"context {context}, {cores} cores" + (f"; {others}" if others else "")
               + (f" (not {THREADS_MARGIN:g}x faster: one thread per process)" if margin else ""))
    return {"layout": layout, "chosen": best, "summary": summary, "cores": cores, "batch": batch,
            "candidates": candidates, "probes": probes}


def _fastest(probes: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per stage, the lowest time of several probes of one configuration."""
    return dict(probes[0], attn_ms=min(p["attn_ms"] for p in probes),
                experts_ms=min(p["experts_ms"] for p in probes))
