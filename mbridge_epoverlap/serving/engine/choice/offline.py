"""The layout `serve --prompts` runs when no layout flag is given: short trial runs of the engine on the batch's own
prompts, then the layout that finishes the batch soonest.

The in-process probes of `choice.layout` time one decode layer per stage and leave out what the engine's processes
add around it (the exchanges, the step agreement, the prefills, the OS's turns between processes). On the 108M
Qwen3-MoE (64 prompts, 2-core AMD EPYC) they predicted `colocated_2` at 2,059 decode tokens/s against 1,347 for
`colocated_1`, and the runs measured 511 against 618. Here each candidate of `choice.online.candidates` runs for real
instead: the engine's worker processes on the first `batch` prompts of the request file, each continued by half the
new tokens so that the trial decodes at a run's mean context (`at_mean_context`), all prefilled at the first step,
then `TRIAL_STEPS` decode steps. From each trial come the batch's prefill time (the median first-token latency,
scaled to the prompts' own tokens) and its decode step (the median time between tokens), and from those the time
the whole file takes on that layout:

    rounds * (prefill_s + (max_new_tokens - 1) * step_s),   rounds = ceil(requests / batch)

The layout with the highest predicted tokens/s wins, the two best tried twice where they are within `CONTEST_MARGIN`
(the faster trial of each kept: a trial on a shared machine only ever reads slow); several OpenMP threads in one
process must win by `THREADS_MARGIN` where its experts do not run on the tiled GEMMs (`choice.online.handicap`
without the front end's margin: offline nothing else takes turns on the cores). The choice is cached beside the
online server's, under the model's config, dtype, batch, prompt length (to the power of two above), cores, CPU and
engine code: the next run of a batch of that shape on this machine reuses it and says so.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from mbridge_epoverlap.serving.engine.choice import online
from mbridge_epoverlap.serving.engine.plan import available_cores
from mbridge_epoverlap.serving.workers.requests import Request
from mbridge_epoverlap.serving.workers.step_cores import experts_tile

TRIAL_STEPS = 8  # decode steps after the prefill: enough for a steady step time, a few seconds a candidate
TRIAL_MAX_BATCH = 128  # the most sequences a trial decodes, whatever --max-batch says (bounds the start-up)
# A runner-up within this factor of the leader gets a second trial, and so does the leader (A B A B, the best of each
# kept): one trial of the 108M Qwen3-MoE's `colocated_2` read 666 tokens/s in one run and 878 in another (the runs
# measured 838-922), enough to swap it with `colocated_1` (795; runs 710-851) on a 2-core AMD EPYC.
CONTEST_MARGIN = 1.3


def choose_offline_layout(spec: Any, requests: Sequence[Request], *, max_new_tokens: int, max_batch: int,
                          timeout_s: float = 60.0, backend: str = "m2n", cores: int | None = None,
                          cache_dir: Path | None = None, progress: Callable[[str], None] | None = None,
                          trial: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """The layout to run `requests` with: {"layout", "chosen", "summary", "cores", "batch", "candidates", "source"}.

    `source` is "measured" (trial runs now), "cached" (measured before for a batch of this shape on this machine)
    or "only" (one core). `trial(layout, requests)` -> {"ttft_ms_p50", "tbt_ms_p50"} replaces the engine run
    (tests).
    """
    cores = available_cores() if cores is None else cores
    batch = max(1, min(len(requests), max_batch, TRIAL_MAX_BATCH))
    prompt_len = statistics.fmean(len(r.prompt_ids) for r in requests[:batch])
    sample = at_mean_context(requests[:batch], max_new_tokens)
    # The trial prefills the longer prompts: its prefill, scaled to the batch's own prompt tokens.
    prefill_share = sum(len(r.prompt_ids) for r in requests[:batch]) / sum(len(r.prompt_ids) for r in sample)
    options = online.candidates(spec, cores)
    shape = f"offline, prompts ~{_bucket(prompt_len)} tokens, {max_new_tokens} new"
    key = online.cache_key(spec, cores, batch, [*options, shape])
    cache = online.cache_path(cache_dir)
    cached = online.read_cache(cache).get(key)
    if cached is not None and cached.get("chosen") in options:
        return dict(cached, layout=options[cached["chosen"]], source="cached")
    # Whether the experts run on the tiled GEMMs; asked before the trials because it builds their library where this
    # machine has none yet: built inside the first trial that loads it, the compile took that trial's cores and
    # read `colocated_1` at 447 tokens/s against 795 once built (108M Qwen3-MoE, 2-core AMD EPYC).
    splits = experts_tile(spec)
    run = trial or (lambda layout, reqs: _trial_run(spec, layout, reqs, timeout_s=timeout_s, backend=backend))
    rounds = math.ceil(len(requests) / batch)

    def trial_of(name: str, which: str) -> dict[str, Any]:
        if progress is not None:
            progress(f"layout trial {which}: {name} ({batch} prompts, {TRIAL_STEPS} decode steps)")
        started = time.perf_counter()
        figures = predict(run(options[name], sample), requests=len(requests), rounds=rounds,
                          max_new_tokens=max_new_tokens, prefill_share=prefill_share)
        return dict(figures, layout=options[name], trial_s=round(time.perf_counter() - started, 2))

    measured: dict[str, dict[str, Any]] = {}
    if len(options) == 1:
        measured = {name: {"layout": layout} for name, layout in options.items()}
    else:
        for number, name in enumerate(options, 1):
            measured[name] = trial_of(name, f"{number}/{len(options)}")
        for name in _close_contest(measured, splits=splits):  # A B A B for the two that one noisy trial could swap
            again = trial_of(name, "again, a close contest")
            kept = max((measured[name], again), key=lambda figures: figures["tokens_per_s"])
            measured[name] = dict(kept, trials=2)
    best, passed_over = online.best_of(measured, splits=splits, front_end=False)
    line = online.summary_line(best, measured, cores, passed_over,
                               trial=f"predicted for the batch from a trial of {batch} prompts")
    choice = {"chosen": best, "layout": options[best], "summary": line, "cores": cores, "batch": batch,
              "candidates": measured, "source": "measured" if len(options) > 1 else "only"}
    if len(options) > 1:
        online.write_cache(cache, key, {k: v for k, v in choice.items() if k not in ("layout", "source")})
    return choice


def at_mean_context(sample: Sequence[Request], max_new_tokens: int) -> list[Request]:
    """`sample`'s prompts, each continued by half the new tokens (its own tokens again, cycled) where the context
    leaves room for the trial's steps: the trial then decodes at the context a run's average step has.

    A decode step's attention grows with the context, and more so on one process whose attention runs on one thread
    for every sequence: trials at the prompts' own length (108M Qwen3-MoE, 64 prompts of 32-128 tokens, 64 new)
    predicted `colocated_1` 8-12 % fast and `colocated_2` 2-4 % slow, enough to swap the two."""
    extra = max(0, min(max_new_tokens // 2, max_new_tokens - TRIAL_STEPS - 1))
    out = []
    for request in sample:
        ids = request.prompt_ids
        out.append(replace(request, prompt_ids=ids + tuple(ids[i % len(ids)] for i in range(extra)) if ids else ids))
    return out


def predict(figures: dict[str, Any], *, requests: int, rounds: int, max_new_tokens: int,
            prefill_share: float = 1.0) -> dict[str, float]:
    """The batch's time on a layout from its trial: prefill and decode step seconds, the predicted seconds and
    tokens/s of the whole request file (`rounds` batches of one prefill and `max_new_tokens - 1` decode steps).
    `prefill_share`: the batch's prompt tokens over the trial's (`at_mean_context` lengthens them)."""
    prefill_s = prefill_share * (figures["ttft_ms_p50"] or 0.0) / 1e3
    step_s = figures["tbt_ms_p50"] / 1e3 if figures.get("tbt_ms_p50") else math.inf  # a sequence's decode step
    seconds = rounds * (prefill_s + max(0, max_new_tokens - 1) * step_s)
    tokens_per_s = requests * max_new_tokens / seconds if 0 < seconds < math.inf else 0.0
    return {"prefill_s": round(prefill_s, 4), "decode_step_ms": round(step_s * 1e3, 3),
            "predicted_s": round(seconds, 3), "tokens_per_s": round(tokens_per_s, 1)}


def _close_contest(measured: dict[str, dict[str, Any]], *, splits: bool) -> list[str]:
    """The runner-up and the leader, in that order, where the runner-up is within `CONTEST_MARGIN` of the leader
    (each trial over its `online.handicap`); else nothing."""
    rated = {n: c["tokens_per_s"] / online.handicap(c["layout"], splits=splits, front_end=False)[0]
             for n, c in measured.items()}
    ranked = sorted(rated.items(), key=lambda item: -item[1])
    if len(ranked) < 2 or ranked[1][1] * CONTEST_MARGIN < ranked[0][1]:
        return []
    return [ranked[1][0], ranked[0][0]]


def _bucket(tokens: float) -> int:
    """The power of two at or above `tokens`: batches of about the same prompt length share a cached choice."""
    return 1 << max(0, math.ceil(math.log2(max(1.0, tokens))))


def _trial_run(spec: Any, layout: dict[str, Any], sample: Sequence[Request], *, timeout_s: float,
               backend: str) -> dict[str, Any]:
    """One short engine run of `layout` on `sample` (one batch): every prompt prefilled, then `TRIAL_STEPS` decode
    steps (EOS ignored, so every sequence decodes them all)."""
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine

    requests = [replace(r, max_new_tokens=TRIAL_STEPS + 1, ignore_eos=True) for r in sample]
    processes = layout.get("colocated") or layout["attn_workers"]
    plan = make_plan(spec, requests, max_new_tokens=TRIAL_STEPS + 1,
                     max_batch=max(1, math.ceil(len(requests) / processes)), backend=backend, timeout_s=timeout_s,
                     dtype=spec.dtype, **layout)
    result = run_engine(plan)
    return {key: result[key] for key in ("ttft_ms_p50", "tbt_ms_p50", "tokens_per_s")}
