"""The layout `serve --http` runs when no layout flag is given: short trial runs of the engine, then the fastest.

An online server is not an offline batch. Requests join at every step, so a layout whose processes meet at every
layer (EP across processes, attention and expert workers) makes all of them wait whenever one prefills a new
prompt or is slowed by the machine; processes that each hold every expert (`--replicate-experts`) never wait for
each other. The offline choice (`choice.layout`) predicts decode steps from in-process probes and leaves those
exchanges out; here each candidate runs for real instead: the engine's own worker processes, transports and
step agreement, `max_batch` sequences in flight and requests of different lengths, so that one finishes and a
waiting one is prefilled into the batch at nearly every step, as an online server's arrivals are. The output
tokens/s of that run decide.

Candidates on `cores` cores (one core: one process, nothing to try):

- `colocated_{N}_replicated`: N = cores processes with one thread each and every expert each (N times the expert
  memory: left out when that would take more than half of the memory available);
- `colocated_{N}`: the same processes with EP across them (each holds 1/N of the experts);
- `disaggregated_1+1_m2`: one attention and one expert worker, half the cores each, two micro-batches;
- `colocated_1`: one process with every core: its narrow steps share the experts' tiled GEMMs among threads of
  their own and its wide ones run on torch's (`workers.step_cores`). Where the experts do not tile, its every op
  runs on OpenMP threads, which stall each other on a shared machine (every op waits for its slowest thread).

The trial runs without the front end, whose clients take turns with the workers on the same cores once it serves;
so each candidate's trial is weighed by its `handicap`: processes that exchange tokens at every layer must win by
`EXCHANGE_MARGIN` (when the OS runs the front end in place of one of them, the others wait), OpenMP threads in one
process by `THREADS_MARGIN` (the offline choice's rule).

A trial takes a few seconds per candidate on the bundled sizes, so a choice is kept in a cache file
(`$XDG_CACHE_HOME/mbridge-epoverlap/online-layouts.json`, or `~/.cache/...`) under the model's config, the dtype,
the batch, the cores and the CPU: the next start of the same server on the same machine reuses it (and says so).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mbridge_epoverlap.serving.engine.choice.layout import THREADS_MARGIN
from mbridge_epoverlap.serving.engine.plan import available_cores
from mbridge_epoverlap.serving.workers.step_cores import experts_tile

TRIAL_STEPS = 8  # a trial request makes 4-12 tokens: joins at nearly every step, a few seconds a candidate
TRIAL_PROMPT_LEN = 32  # tokens per synthetic prompt (capped by the model's context)
TRIAL_MAX_BATCH = 128  # the most sequences a trial decodes, whatever --max-batch says (bounds the start-up)
SMALL_BATCH = 8  # the sequences in flight of the trial that decides whether the front end keeps its cores
# Runs of each of the two layouts at SMALL_BATCH, alternated (A B A B), each layout's best kept: on a shared VM one
# run can read 20-30 % low (the 108M Qwen3-MoE's two processes measured 382 tokens/s one day and 268 the next at
# the same code, a tie with one process that sent its serving to the slower layout); the best of two is the run
# least disturbed by whatever else ran.
SMALL_BATCH_RUNS = 2
# How much faster every core must decode SMALL_BATCH sequences to take the front end's core, between what the two
# shapes measured on 2 cores (AMD EPYC): the 57M Mixtral's every-core layout 0.88-1.07x the one process, and online
# one process with a core to spare served it better; the 108M Qwen3-MoE's 1.09-1.3x (1.0 once, one run each), and
# online every core served it better at every rate (one process: 0.60-0.67x vLLM's tokens/s at a burst, P99 TPOT
# 2.0-2.5x at 8/s, against 0.79x and 1.75x). 1.15 left the Qwen3-MoE on one process whenever the machine was slow.
SPARE_MARGIN = 1.08
# How much faster offline a layout whose processes exchange tokens at every layer must be than one whose processes
# do not: online the front end and its clients take turns on the same cores, and each time the OS runs them in
# place of one worker the others wait for it at the next exchange. The 108M Qwen3-MoE's two EP processes traded
# 959 tokens/s against one process on both cores' 854 in the trial (64 sequences, 2-core AMD EPYC), and online
# served a burst at 603-714 against 848-875 tokens/s and Poisson 8/s at median TPOT 47-66 against 32-39 ms.
EXCHANGE_MARGIN = 1.2
MEMORY_SHARE = 0.5  # replicated experts may take at most this share of the available memory
CACHE_NAME = "online-layouts.json"
ENGINE_CODE = ("model", "workers", "engine")  # under serving/: what `engine_digest` reads


def candidates(spec: Any, cores: int, *, available_bytes: int | None = None) -> dict[str, dict[str, Any]]:
    """Candidate name -> its layout (`make_plan` keywords) on `cores` cores."""
    if cores < 2:
        return {"colocated_1": dict(colocated=1, micro_batches=1, order="sequential", threads=max(cores, 1))}
    out: dict[str, dict[str, Any]] = {}
    extra = expert_bytes(spec) * (cores - 1)
    available = _available_memory() if available_bytes is None else available_bytes
    if available is None or extra <= MEMORY_SHARE * available:
        out[f"colocated_{cores}_replicated"] = dict(colocated=cores, micro_batches=1, order="sequential", threads=1,
                                                    replicated_experts=True)
    if spec.num_experts >= cores:
        out[f"colocated_{cores}"] = dict(colocated=cores, micro_batches=1, order="sequential", threads=1)
    out["disaggregated_1+1_m2"] = dict(attn_workers=1, expert_workers=1, micro_batches=2, threads=cores // 2)
    out["colocated_1"] = dict(colocated=1, micro_batches=1, order="sequential", threads=cores)
    return out


def worker_cores(available: int, frontend_cores: int) -> int:
    """The cores the workers' layout is chosen for: `available` less the `frontend_cores` kept for the HTTP front
    end and the clients on the host (at least one)."""
    return max(1, available - frontend_cores)


def as_flags(layout: dict[str, Any]) -> dict[str, Any]:
    """A candidate's layout as the values of `serve`'s layout flags (argparse destinations)."""
    processes = layout.get("colocated", 0)
    flags = {"micro_batches": layout["micro_batches"], "threads": layout["threads"], "colocated": processes,
             "replicate_experts": bool(layout.get("replicated_experts"))}
    if processes:
        return dict(flags, attn_workers=1, expert_workers=1, order=layout.get("order", "sequential"))
    return dict(flags, attn_workers=layout["attn_workers"], expert_workers=layout["expert_workers"])


def expert_bytes(spec: Any) -> int:
    """Bytes of the routed experts' weights of every MoE layer (gate, up and down projections)."""
    per_value = 2 if spec.dtype == "bfloat16" else 4
    return len(spec.moe_layer_ids) * spec.num_experts * 3 * spec.hidden_size * spec.expert_ffn * per_value


def choose_online_layout(spec: Any, *, max_batch: int, max_model_len: int, timeout_s: float = 30.0,
                         backend: str = "m2n", cores: int | None = None, cache_dir: Path | None = None,
                         progress: Callable[[str], None] | None = None,
                         trial: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """The layout to serve with: {"layout", "chosen", "summary", "cores", "batch", "candidates", "source"}.

    `source` is "measured" (trial runs now), "cached" (a choice measured before for the same model, dtype,
    batch, cores and CPU) or "only" (one core: one candidate, nothing to measure). `trial(layout, batch,
    prompt_len)` -> {"tokens_per_s"} replaces the engine run (tests).
    """
    cores = available_cores() if cores is None else cores
    batch = max(1, min(max_batch, TRIAL_MAX_BATCH))
    prompt_len = _trial_prompt_len(max_model_len)
    options = candidates(spec, cores)
    key = cache_key(spec, cores, batch, list(options))
    cache = cache_path(cache_dir)
    cached = read_cache(cache).get(key)
    if cached is not None and cached.get("chosen") in options:
        return dict(cached, layout=options[cached["chosen"]], source="cached")
    splits = experts_tile(spec)  # before the trials: it builds the tiled GEMMs' library where none is built yet
    run = _runner(spec, trial, timeout_s=timeout_s, backend=backend)
    measured: dict[str, dict[str, Any]] = {}
    for name, layout in options.items():
        if len(options) == 1:
            measured[name] = {"layout": layout}
            break
        if progress is not None:
            progress(f"layout trial {len(measured) + 1}/{len(options)}: {name} ({batch} sequences in flight)")
        started = time.perf_counter()
        figures = run(layout, batch, prompt_len)
        measured[name] = {"layout": layout, "tokens_per_s": figures["tokens_per_s"],
                          "trial_s": round(time.perf_counter() - started, 2)}
    best, passed_over = best_of(measured, splits=splits)
    line = summary_line(best, measured, cores, passed_over, trial=f"in a trial of {batch} sequences with joins")
    choice = {"chosen": best, "layout": options[best], "summary": line, "cores": cores, "batch": batch,
              "candidates": measured, "source": "measured" if len(options) > 1 else "only"}
    if len(options) > 1:
        write_cache(cache, key, {k: v for k, v in choice.items() if k not in ("layout", "source")})
    return choice


def choose_keeping_frontend(spec: Any, *, frontend_cores: int, cores: int | None = None, max_batch: int,
                            max_model_len: int, timeout_s: float = 30.0, backend: str = "m2n",
                            cache_dir: Path | None = None, progress: Callable[[str], None] | None = None,
                            trial: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """`choose_online_layout`, with `frontend_cores` of the `cores` kept for the HTTP front end and its clients
    unless a layout on every core decodes a few sequences `SPARE_MARGIN` times faster (the best of
    `SMALL_BATCH_RUNS` alternated runs of each).

    Under load the front end and a client on the same host take about a core, which workers on every core then
    share. Whether that costs more than the workers gain from the core depends on the model, and a trial without
    a client cannot show it directly; what does show it is a small batch (`SMALL_BATCH` sequences, the few in
    flight at a Poisson rate), where a step is bound by streaming the experts' weights: the 57M Mixtral (8 experts,
    200 MB a step) decodes as fast on one process as on two (475-480 against 433-474 tokens/s, AMD EPYC, 2 cores),
    and online the one process with a core to spare served Poisson 8/s at 15-16 ms median TPOT against 19-24;
    the 108M Qwen3-MoE (64 experts, 400 MB) decodes 1.3x faster on two (342-354 against 255-271), and online it
    kept that lead (P99 TPOT at 8/s 1.67x vLLM's on two processes against 2.38x on one).
    """
    common = dict(max_batch=max_batch, max_model_len=max_model_len, timeout_s=timeout_s, backend=backend,
                  cache_dir=cache_dir, progress=progress, trial=trial)
    cores = available_cores() if cores is None else cores
    every = choose_online_layout(spec, cores=cores, **common)
    workers = worker_cores(cores, frontend_cores)
    if workers >= cores:
        return every
    if every["layout"].get("colocated") == 1 and handicap(every["layout"], splits=experts_tile(spec))[0] == 1.0:
        # One process whose narrow steps share the tiled expert GEMMs: when the front end takes a core, its helper
        # leaves its units to the caller, nobody waits for it; on fewer cores it would only lose the bursts' speed.
        return dict(every, summary=f"{every['summary']}; every core: one process, its helper threads leave their "
                                   "work to the others when the front end runs")
    kept = choose_online_layout(spec, cores=workers, **common)
    names = (f"{every['chosen']} on {cores} cores", f"{kept['chosen']} on {workers} core{'s' if workers > 1 else ''}")
    cache = cache_path(cache_dir)
    key = cache_key(spec, cores, SMALL_BATCH, [every["chosen"], kept["chosen"], f"front end {frontend_cores}"])
    rates = read_cache(cache).get(key)
    measured = not isinstance(rates, dict) or not {"every", "kept"} <= set(rates)
    if measured:
        run, prompt_len = _runner(spec, trial, timeout_s=timeout_s, backend=backend), _trial_prompt_len(max_model_len)
        rates = {"every": 0.0, "kept": 0.0}
        for round_ in range(SMALL_BATCH_RUNS):
            for which, choice, name in (("every", every, names[0]), ("kept", kept, names[1])):
                if progress is not None:
                    progress(f"layout trial at {SMALL_BATCH} sequences ({round_ + 1}/{SMALL_BATCH_RUNS}): {name}")
                rates[which] = max(rates[which], run(choice["layout"], SMALL_BATCH, prompt_len)["tokens_per_s"])
        write_cache(cache, key, rates)
    keep = rates["every"] < SPARE_MARGIN * rates["kept"]
    chosen = kept if keep else every
    spare = cores - workers
    verdict = (f"{spare} core{'s' if spare != 1 else ''} kept for the front end and its clients"
               if keep else f"every core: {SPARE_MARGIN:g}x or more at a few sequences")
    summary = (f"{chosen['summary']}; at {SMALL_BATCH} sequences {names[1]} {rates['kept']:,.0f} tokens/s, "
               f"{names[0]} {rates['every']:,.0f}: {verdict} (--frontend-cores)")
    source = "measured" if measured or every["source"] == "measured" else "cached"
    return dict(chosen, summary=summary, source=source,
                few_sequences={names[1]: rates["kept"], names[0]: rates["every"]})


def _trial_prompt_len(max_model_len: int) -> int:
    """Tokens per synthetic trial prompt: `TRIAL_PROMPT_LEN`, less where the context leaves no room for the steps."""
    return max(1, min(TRIAL_PROMPT_LEN, max_model_len - TRIAL_STEPS - 1))


def _runner(spec: Any, trial: Callable[..., dict[str, Any]] | None, *, timeout_s: float,
            backend: str) -> Callable[..., dict[str, Any]]:
    """`trial` (tests), or a real engine run of a layout: (layout, batch, prompt_len) -> {"tokens_per_s", ...}."""
    return trial or (lambda layout, b, n: _trial_run(spec, layout, b, n, timeout_s=timeout_s, backend=backend))


def handicap(layout: dict[str, Any], *, splits: bool, front_end: bool = True) -> tuple[float, str]:
    """(how much faster a layout's trial must be, why) against a layout of one-thread processes that never wait for
    each other: `THREADS_MARGIN` for several OpenMP threads in one process (not where its steps split the experts'
    tiled GEMMs instead, `workers.step_cores`: a helper the OS does not schedule only leaves its share to the
    others), `EXCHANGE_MARGIN` for processes that exchange tokens at every layer (EP across processes, attention
    and expert workers) where a front end shares the cores (`front_end`; offline nothing else does); 1 otherwise."""
    exchanges = layout.get("attn_workers") or (layout.get("colocated", 0) > 1 and not layout.get("replicated_experts"))
    if front_end and exchanges:
        return EXCHANGE_MARGIN, "its processes wait for each other at every layer"
    if layout["threads"] > 1 and not splits:
        return THREADS_MARGIN, "OpenMP threads in one process"
    return 1.0, ""


def best_of(measured: dict[str, dict[str, Any]], *, splits: bool, front_end: bool = True) -> tuple[str, str]:
    """The candidate of the best trial ("tokens_per_s") after each one's `handicap`, and why the fastest was not
    taken ("" where it was)."""
    rated = {n: c["tokens_per_s"] for n, c in measured.items() if "tokens_per_s" in c}
    if not rated:
        return next(iter(measured)), ""
    fastest = max(rated, key=rated.__getitem__)
    margins = {n: handicap(measured[n]["layout"], splits=splits, front_end=front_end) for n in rated}
    best = max(rated, key=lambda n: rated[n] / margins[n][0])
    if best == fastest:
        return best, ""
    margin, why = margins[fastest]
    return best, f"{fastest} not {margin:g}x faster: {why}"


def summary_line(best: str, measured: dict[str, dict[str, Any]], cores: int, passed_over: str, *, trial: str) -> str:
    """The line that says which candidate won and what each measured (`trial`: what the figures are, e.g. "in a
    trial of 64 sequences with joins")."""
    if "tokens_per_s" not in measured[best]:
        return f"{best}: the only layout on {cores} core{'s' if cores != 1 else ''}"
    others = ", ".join(f"{n} {c['tokens_per_s']:,.0f}" for n, c in measured.items() if n != best)
    return (f"{best}: {measured[best]['tokens_per_s']:,.0f} tokens/s {trial} on {cores} cores; {others}"
            + (f" ({passed_over})" if passed_over else ""))


def _trial_run(spec: Any, layout: dict[str, Any], batch: int, prompt_len: int, *, timeout_s: float,
               backend: str) -> dict[str, Any]:
    """One short engine run of `layout` at `batch` sequences in flight, with requests joining at every step.

    Twice `batch` requests of different lengths (TRIAL_STEPS/2 to 3*TRIAL_STEPS/2 new tokens, EOS ignored): as
    one finishes, a waiting one is prefilled into the running batch, as an online server's arrivals are.
    """
    from dataclasses import replace

    from mbridge_epoverlap.serving.engine.bench import synthetic_requests
    from mbridge_epoverlap.serving.engine.run import make_plan, run_engine

    processes = layout.get("colocated") or layout["attn_workers"]
    requests = [replace(r, max_new_tokens=TRIAL_STEPS // 2 + i % (TRIAL_STEPS + 1), ignore_eos=True)
                for i, r in enumerate(synthetic_requests(2 * batch, spec.vocab_size, prompt_len=prompt_len))]
    plan = make_plan(spec, requests, max_new_tokens=2 * TRIAL_STEPS, max_batch=max(1, batch // processes),
                     backend=backend, timeout_s=timeout_s, dtype=spec.dtype, **layout)
    result = run_engine(plan)
    return {"tokens_per_s": result["tokens_per_s"], "decode_tokens_per_s": result["decode_tokens_per_s"]}


# --- the cache --------------------------------------------------------------------------------------

def cache_path(cache_dir: Path | None) -> Path:
    if cache_dir is None:
        from mbridge_epoverlap.machine import cache_dir as machine_cache_dir

        cache_dir = machine_cache_dir()
    return cache_dir / CACHE_NAME


def cache_key(spec: Any, cores: int, batch: int, names: list[str]) -> str:
    from mbridge_epoverlap.machine import cpu_model

    if spec.is_checkpoint:
        model = (Path(spec.source) / "config.json").read_bytes()
    else:
        model = f"{spec.source}/{spec.num_layers}/{spec.seed}".encode()
    digest = hashlib.sha256(model).hexdigest()[:16]
    return (f"{digest}|engine {engine_digest()}|{spec.dtype}|batch {batch}|{cores} cores|{cpu_model()}|"
            f"{','.join(names)}")


@functools.cache
def engine_digest() -> str:
    """A digest of the code a trial measures (`serving/model` with its kernels, `serving/workers`,
    `serving/engine`): a choice measured by another version of the engine is measured again, not reused (one
    change of a kernel moved a layout's trial by 10-20 %)."""
    serving = Path(__file__).resolve().parents[2]
    sources = sorted(path for part in ENGINE_CODE for path in (serving / part).rglob("*")
                     if path.suffix in (".py", ".c"))
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.relative_to(serving).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or one this version cannot read: measure again
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    data = read_cache(path)
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # whole or not at all: another server may read it meanwhile
    except OSError:
        pass  # a read-only home: the next start measures again


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
