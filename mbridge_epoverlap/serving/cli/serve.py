"""`mbridge-epoverlap serve` and `serve-bench`: decode on attention and expert workers (or colocated ones).

`register` only touches argparse so `mbridge-epoverlap --help` stays fast; torch, the model and the engine
are imported by the handlers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mbridge_epoverlap.arg_types import count, positive
from mbridge_epoverlap.errors import EXIT_FAILED, UsageError
from mbridge_epoverlap.serving.cli.args import (
    apply_layout,
    checked_source,
    epoch_args,
    fill_layout_defaults,
    host_args,
    layout_args,
    layout_forced,
    model_args,
    non_negative_seconds,
    on_hosts,
    positive_seconds,
    progress_printer,
    resolve_dtype,
)
from mbridge_epoverlap.serving.cli.output import fmt, print_result, print_rows


def run_reporting_failure(plan: Any, progress: Callable[[str], None] | None) -> tuple[dict[str, Any], int]:
    """Run the engine; a failed run still returns its partial result (failed requests named), with exit 1."""
    from mbridge_epoverlap.serving.engine.run import EngineFailed, run_engine

    try:
        return run_engine(plan, progress=progress), 0
    except EngineFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.result, EXIT_FAILED


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="decode prompts with disaggregated attention/expert workers (or colocated ones)",
        description="Greedy decoding of a JSONL prompts file on attention and expert worker processes (ping-pong "
                    "pipeline of m micro-batches, M2N transfers) or on N colocated processes (EP all-to-all). "
                    "With --http, an OpenAI-compatible server on the same workers instead, until SIGTERM/SIGINT.")
    model_args(serve, required=True)
    serve.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                       help='JSONL, one request a line: {"id": ..., "prompt_ids": [int, ...]}')
    online = serve.add_argument_group("online serving (--http)")
    online.add_argument("--http", metavar="HOST:PORT", default=None,
                        help="serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models), /health "
                             "and /metrics at HOST:PORT instead of reading --prompts")
    online.add_argument("--served-model-name", metavar="NAME", default=None,
                        help="the model's name in the API (default: --checkpoint as given)")
    online.add_argument("--max-model-len", type=positive, default=None, metavar="N",
                        help="longest prompt plus max_tokens (default: the model's max_position_embeddings)")
    online.add_argument("--max-prefill-tokens", type=positive, default=2048, metavar="N",
                        help="prompt tokens one engine step may feed, shared by its attention workers (default "
                             "2048, the per-step token budget of vLLM's CPU server); a longer prompt is fed in "
                             "chunks over several steps while the other sequences decode")
    online.add_argument("--frontend-cores", type=count, default=1, metavar="N",
                        help="cores the server may keep for its HTTP front end and the clients on this host when "
                             "it picks its layout (no layout flag given): kept unless the layout on every core "
                             "decodes 8 sequences 1.08x faster in a trial (default 1, as vLLM's CPU build keeps "
                             "one for its API server; 0: every core to the workers)")
    online.add_argument("--prefix-cache-mib", type=positive, default=1024, metavar="MIB",
                        help="each attention worker keeps full 16-token blocks of prompts' KV cache, up to MIB "
                             "MiB, and a prompt that begins with cached blocks is prefilled from there "
                             "(automatic prefix caching, least recently used evicted; default 1024)")
    online.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every prompt whole (automatic prefix caching off)")
    online.add_argument("--max-logprobs", type=count, default=20, metavar="K",
                        help="the most log-probabilities a request may ask for per token (`logprobs`, "
                             "`top_logprobs`; default 20, as vLLM's)")
    online.add_argument("--max-waiting", type=count, default=256, metavar="N",
                        help="requests that may wait for a slot; more answer 503 at once (default 256)")
    online.add_argument("--max-connections", type=positive, default=1024, metavar="N",
                        help="open HTTP connections served; a request on one more answers 503 (default 1024)")
    online.add_argument("--read-timeout", type=positive_seconds, default=30.0, metavar="S",
                        help="seconds a client has to send a request's head, and then its body; a slower one is "
                             "closed, or answered 408 (default 30)")
    online.add_argument("--drain-timeout", type=non_negative_seconds, default=30.0, metavar="S",
                        help="on SIGTERM/SIGINT, seconds the running requests get to finish (default 30)")
    online.add_argument("--api-key", metavar="KEY", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MBRIDGE_EPOVERLAP_API_KEY)")
    online.add_argument("--expert-metrics", choices=("top", "full"), default="top",
                        help="expert load in /metrics: top, the 4 hottest experts of each MoE layer (bounded: "
                             "layers x 4 series), or full, also a counter per layer and expert "
                             "(mbe_expert_tokens_total: 58 x 256 series on DeepSeek-V3) (default top)")
    online.add_argument("--workers-plan", type=Path, default=None, metavar="FILE",
                        help="start no worker: write the engine plan to FILE for workers started elsewhere (srun)")
    online.add_argument("--worker-host", default="127.0.0.1", metavar="ADDR",
                        help="the address the front end's worker sockets bind (default 127.0.0.1; the cluster "
                             "interface when the workers run on other nodes)")
    serve.add_argument("--max-new-tokens", type=positive, default=16, metavar="N", help="default 16")
    layout_args(serve)
    serve.add_argument("--replicate-experts", action="store_true",
                       help="with --colocated N: every process holds every expert and keeps its tokens (no "
                            "all-to-all; N data-parallel engines behind one front end, N times the expert memory)")
    serve.add_argument("--elastic", action="store_true",
                       help="survive the loss of expert workers (redundant experts, re-placement, resends)")
    serve.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                       help="with --elastic: redundant expert slots over all expert workers (default 0)")
    serve.add_argument("--no-expert-restore", action="store_true",
                       help="with --elastic: no weight copy; losing every replica of an expert ends the run")
    epoch_args(serve, "with --elastic: ")
    host_args(serve)
    serve.set_defaults(handler=handle_serve)

    bench = subparsers.add_parser(
        "serve-bench", help="decode throughput, time between tokens, utilization and the simulator's prediction",
        description="Synthetic decode on the given layout: tokens/s, TBT p50/p99, per-role utilization measured "
                    "and predicted (replay of the measured stage times), and whether every token matches a "
                    "single-process run of the same weights.")
    model_args(bench, required=False)
    layout_args(bench, colocated_flag=True)
    bench.add_argument("--layers", type=positive, default=None, metavar="L", help="MoE layers of a recipe model")
    bench.add_argument("--batch", type=_bench_batch, default=None, metavar="B",
                       help=f"sequences decoding at once (default: {DEFAULT_BENCH_BATCH} per attention worker, "
                            "whatever the micro-batches, so layouts compare at one batch; 'balanced': sized from "
                            "short probes so the attention and expert stages take about as long)")
    bench.add_argument("--steps", type=positive, default=16, metavar="S", help="tokens generated per sequence")
    host_args(bench)
    bench.set_defaults(handler=handle_bench)


def handle_serve(args: argparse.Namespace) -> int:
    source = checked_source(args)
    from mbridge_epoverlap.serving.engine.bench import finish_bench_result
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import context_length, load_spec
    from mbridge_epoverlap.serving.workers.requests import load_prompts

    check_backend(args)
    if args.http is not None:
        if not args.elastic and (args.redundant_experts or args.no_expert_restore or args.rebalance_every
                                 or args.rejoin_after_steps):
            raise UsageError("--redundant-experts, --no-expert-restore, --rebalance-every and --rejoin-after-steps "
                             "apply to --elastic serving; add --elastic")
        from mbridge_epoverlap.serving.frontend.server import serve_http

        # No layout flag: the server measures its layout once its checks have passed (`engine.choice.online`);
        # elastic EP and emulated hosts run disaggregated workers, and any layout flag is taken as given.
        args.choose_layout = not (layout_forced(args) or args.replicate_experts or args.elastic
                                  or args.emulate_hosts or args.workers_plan is not None)
        fill_layout_defaults(args)
        resolve_dtype(args, source)
        return serve_http(args)
    if args.prompts is None:
        raise UsageError("give --prompts FILE (a batch of requests) or --http HOST:PORT (a server)")
    dtype = resolve_dtype(args, source)
    spec = load_spec(source, dtype=args.dtype)
    from mbridge_epoverlap.serving.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec)
    requests = load_prompts(args.prompts, vocab_size=spec.vocab_size,
                            tokenizer=tokenizer.encode if tokenizer is not None else None)
    check_context(requests, args.max_new_tokens, args.max_model_len or context_length(spec))
    choice = None
    # The choice compares layouts on this host; emulated hosts place the workers themselves.
    if not args.elastic and not args.emulate_hosts and not layout_forced(args) and not args.replicate_experts:
        choice = _choose_measured(spec, requests, args)
        apply_layout(args, choice["layout"])
    fill_layout_defaults(args)
    plan = make_plan(spec, requests, attn_workers=args.attn_workers, expert_workers=args.expert_workers,
                     micro_batches=args.micro_batches, colocated=args.colocated, order=args.order,
                     max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, backend=args.backend,
                     timeout_s=args.timeout, dtype=args.dtype, threads=args.threads,
                     replicated_experts=args.replicate_experts)
    if args.elastic:
        from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic

        plan = make_elastic(plan, redundant=args.redundant_experts, restore=not args.no_expert_restore,
                            rebalance_every=args.rebalance_every, rejoin_after_steps=args.rejoin_after_steps,
                            rebalance_threshold=args.rebalance_threshold, rejoin_hold=args.rejoin_hold)
    elif args.redundant_experts or args.no_expert_restore or args.rebalance_every or args.rejoin_after_steps:
        raise UsageError("--redundant-experts, --no-expert-restore, --rebalance-every and --rejoin-after-steps apply "
                         "to --elastic serving; add --elastic")
    plan = on_hosts(plan, args)
    result, code = run_reporting_failure(plan, progress_printer(args))
    finish_bench_result(result, spec)
    if choice is not None:
        result["layout_choice"] = _choice_field(choice)
    result["dtype"] = dtype.to_dict()
    print_result(result, args.json, _serve_table)
    return code


def check_backend(args: argparse.Namespace) -> None:
    """An unknown `--backend` is a usage error naming the known ones, and so is a backend or layout the emulated
    hosts cannot run (before any probe or worker starts)."""
    from mbridge_epoverlap.comm.m2n import BACKENDS
    from mbridge_epoverlap.serving.engine.hosts import check_emulated_hosts

    if args.backend not in BACKENDS:
        raise UsageError(f"--backend {args.backend}: unknown M2N backend; choose one of {', '.join(BACKENDS)}")
    check_emulated_hosts(args.emulate_hosts, args.emulate_link_gbps, colocated=bool(args.colocated),
                         backend=args.backend)


def check_context(requests: Any, max_new_tokens: int, context: int) -> None:
    """Every prompt plus `--max-new-tokens` within the model's context, else a usage error naming both numbers."""
    for request in requests:
        total = len(request.prompt_ids) + max_new_tokens
        if total > context:
            raise UsageError(f"request {request.id}: {len(request.prompt_ids)} prompt tokens + --max-new-tokens "
                             f"{max_new_tokens} = {total} is more than the model's context of {context} tokens "
                             "(max_position_embeddings)")


# The batch of `serve-bench` without --batch, per attention worker: vLLM's and SGLang's usual concurrency on a small
# server, and a fixed one: the probes' pick (--batch balanced) moved from 32 to 2,048 between runs of one command.
DEFAULT_BENCH_BATCH = 64
BALANCED = "balanced"


def _bench_batch(text: str) -> int | str:
    """--batch: a positive count of sequences, or 'balanced'."""
    if text == BALANCED:
        return BALANCED
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive number of sequences or 'balanced', got {text!r}"
                                         ) from None


def handle_bench(args: argparse.Namespace) -> int:
    source = checked_source(args)
    from mbridge_epoverlap.serving.engine.bench import balanced_micro_batch, finish_bench_result, synthetic_requests
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    if args.checkpoint is not None and args.layers is not None:
        raise UsageError("--layers applies to recipe models; a checkpoint fixes its layers (drop --layers)")
    check_backend(args)
    dtype = resolve_dtype(args, source)
    spec = load_spec(source, dtype=args.dtype, num_layers=args.layers)
    chosen = not layout_forced(args) and not args.emulate_hosts
    fill_layout_defaults(args)
    attn, experts = args.attn_workers, args.expert_workers
    probes: list[dict[str, float]] = []
    if args.batch == BALANCED:
        micro, probes = balanced_micro_batch(spec, attn_workers=attn, expert_workers=experts)
        batch, batch_source = micro * args.micro_batches * attn, "balanced: sized from the stage probes"
    elif args.batch is None:
        batch, batch_source = DEFAULT_BENCH_BATCH * attn, f"the default, {DEFAULT_BENCH_BATCH} per attention worker"
    else:
        batch, batch_source = args.batch, "--batch"
    requests = synthetic_requests(batch, spec.vocab_size)
    choice = None
    if chosen:
        choice = _choose(spec, requests, args.steps, batch)
        apply_layout(args, choice["layout"], colocated_as_flag=True)
        attn, experts = args.attn_workers, args.expert_workers
    colocated = attn + experts if args.colocated else 0
    plan = make_plan(spec, requests, attn_workers=attn, expert_workers=experts, micro_batches=args.micro_batches,
                     colocated=colocated, order=args.order, max_new_tokens=args.steps, max_batch=batch,
                     backend=args.backend, timeout_s=args.timeout, num_layers=args.layers, dtype=args.dtype,
                     threads=args.threads)
    plan = on_hosts(plan, args)
    result, code = run_reporting_failure(plan, progress_printer(args))
    if choice is not None:
        result["layout_choice"] = _choice_field(choice)
    result["batch"] = batch
    result["batch_source"] = batch_source
    result["balance_probes"] = probes
    result["dtype"] = dtype.to_dict()
    finish_bench_result(result, spec, requests=requests, max_new_tokens=args.steps, succeeded=code == 0)
    if not args.json:
        result.pop("completions")
    print_result(result, args.json, _bench_table)
    return code


def _choose(spec: Any, requests: Any, max_new_tokens: int, max_batch: int) -> dict[str, Any]:
    """No layout flag: the layout a short measurement predicts fastest, said on stderr."""
    from mbridge_epoverlap.serving.engine.choice.layout import choose_layout

    choice = choose_layout(spec, requests, max_new_tokens=max_new_tokens, max_batch=max_batch)
    print(f"  layout (no layout flag given; force one with --attn-workers/--expert-workers/--micro-batches/"
          f"--colocated/--threads): {choice['summary']}", file=sys.stderr, flush=True)
    return choice


def _choose_measured(spec: Any, requests: Any, args: argparse.Namespace) -> dict[str, Any]:
    """No layout flag on a batch: the layout whose trial run on the batch's prompts predicts the batch done soonest
    (`engine.choice.offline`, cached per batch shape and machine), said on stderr."""
    from mbridge_epoverlap.serving.engine.choice.offline import choose_offline_layout

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    choice = choose_offline_layout(spec, requests, max_new_tokens=args.max_new_tokens, max_batch=args.max_batch,
                                   backend=args.backend, timeout_s=args.timeout, progress=progress)
    how = {"measured": "measured", "cached": "measured before on this machine, cached", "only": "the only one"}
    print(f"  layout ({how[choice['source']]}; no layout flag given, force one with --attn-workers/--expert-workers/"
          f"--micro-batches/--colocated/--threads): {choice['summary']}", file=sys.stderr, flush=True)
    return choice


def _choice_field(choice: dict[str, Any]) -> dict[str, Any]:
    keys = ("chosen", "layout", "summary", "cores", "batch", "candidates", "probes", "source")
    return {key: choice[key] for key in keys if key in choice}


def _common(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("mode", f"{result['mode']} ({result['order']}, m={result['micro_batches']})"),
            ("workers", f"{result['attn_workers']} attention, {result['expert_workers']} expert"
             if result["mode"] != "colocated" else f"{result['attn_workers']} colocated"),
            ("threads per process", str(result.get("threads_per_process", 1))),
            ("generated tokens", str(result["generated_tokens"])),
            ("tokens/s", fmt(result["tokens_per_s"], "{:,.1f}")),
            ("TBT p50 / p99 (ms)", f"{fmt(result['tbt_ms_p50'])} / {fmt(result['tbt_ms_p99'])}"),
            ("TTFT p50 (ms)", fmt(result["ttft_ms_p50"]))]
    if "stage_ms" in result:
        stages = result["stage_ms"]
        rows.append(("measured stage ms", ", ".join(f"{k} {v:.3f}" for k, v in stages.items())))
        util = result["utilization"]
        pred = result["predicted"]
        rows.append(("utilization (measured)", f"attention {util['attention']:.0%}, expert {util['expert']:.0%}"))
        rows.append(("predicted (replay)", f"{pred['tokens_per_s']:,.1f} tokens/s, attention "
                     f"{pred['utilization']['attention']:.0%}, expert {pred['utilization']['expert']:.0%}"))
    if result.get("failed_requests"):
        rows.append(("failed requests", ", ".join(result["failed_requests"])))
    load = result.get("expert_load")
    if load:
        per_layer = ", ".join(f"layer {layer} {fmt(value, '{:.3f}')}"
                              for layer, value in zip(load["layers"], load["max_over_mean"], strict=True))
        overall = fmt(load["max_over_mean_all_layers"], "{:.3f}")
        rows.append(("expert load max/mean", f"{per_layer}; all layers {overall}"))
    if "elastic" in result:
        lost = result["elastic"]["lost_workers"]
        rows.append(("elastic", f"lost expert workers {lost}, restored experts {result['elastic']['restored_experts']}"
                     if lost else "no expert worker lost"))
        moved = [b for b in result["elastic"].get("rebalances", []) if not b["kept"]]
        if moved:
            rows.append(("rebalanced", "; ".join(f"step {b['step']}: {b['moved']} moved, max/mean "
                                                 f"{b['imbalance_before']:.3f} -> {b['imbalance_after']:.3f}"
                                                 for b in moved)))
        if result["elastic"].get("rejoined_workers"):
            rows.append(("rejoined", str(result["elastic"]["rejoined_workers"])))
        for f in result["elastic"].get("move_fallbacks", []):
            rows.append(("move fallback", f"{f['worker']} read experts {f['experts']} of epoch {f['epoch']} from the "
                         f"checkpoint (expert worker {f['from']} died during the move)"))
    if "dtype" in result:
        rows.append(("dtype", f"{result['dtype']['dtype']} ({result['dtype']['reason']})"))
    if "kv_cache_bytes_per_token" in result:
        cache = f"{result['kv_cache_bytes_per_token']:,} bytes per token"
        if result.get("state_bytes_per_sequence"):  # a hybrid model's DeltaNet or Mamba-2 states
            cache += f"; recurrent states {result['state_bytes_per_sequence']:,} bytes per sequence"
        rows.append(("KV cache", cache))
    if "memory" in result:
        from mbridge_epoverlap.memory import describe

        rows.append(("memory", describe(result["memory"])))
    m = result["machine"]
    rows.append(("machine", f"{m['cpu']} ({m['cores']} cores, avx512_bf16={m['avx512_bf16']}, "
                 f"amx_bf16={m['amx_bf16']})"))
    return rows


def _serve_table(result: dict[str, Any]) -> None:
    for c in result["completions"]:
        print(f"{c['id']}: {c['status']} {c['output_ids']} (TTFT {fmt(c['ttft_ms'])} ms)")
    print_rows(_common(result))


def _bench_table(result: dict[str, Any]) -> None:
    from mbridge_epoverlap.serving.engine.bench import describe_probe

    rows = [("batch", f"{result['batch']} ({result['batch_source']})")]
    for probe in result["balance_probes"]:
        rows.append((f"probe micro-batch {probe['micro_batch']:g}", describe_probe(probe)))
    rows += _common(result)
    rows.append(("matches reference", str(result["matches_reference"])))
    print_rows(rows)


