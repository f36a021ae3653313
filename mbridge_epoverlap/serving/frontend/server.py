"""`serve --http HOST:PORT`: the engine's workers in online mode behind the HTTP front end, until a signal.

The order of a server's life:

1. the checks (model, layout, context length) run before anything starts; a usage error exits 2;
2. the front end binds its worker sockets on loopback, the engine starts its workers (online: no requests
   dealt), uvicorn binds HOST:PORT; `/health` answers 503 "starting" until every attention worker is ready;
3. one line on stderr says the server is ready, with its URL;
4. SIGTERM or SIGINT drains: new requests get 503, the running ones finish within `--drain-timeout`, the
   workers leave, the process exits 0 (a second signal stops at once);
5. if the engine fails (a worker died, without `--elastic`), the requests in flight fail naming the worker,
   `/health` answers 503 and the process exits 1, for a supervisor to restart it. What the server survived
   (a worker lost with `--elastic`, a request a worker could not serve) does not make a drained stop fail: it
   is a "warning: ..." line on stderr and a count in `/metrics`, and the drain exits 0.

With `--emulate-hosts 2 --emulate-link-gbps G` the workers run on two emulated hosts (`serving.engine.hosts`)
and the front end's sockets bind on the link's gateway address, the one address the namespaces reach.

With `--workers-plan FILE` the server starts no worker: it writes the engine plan there, and whoever runs
it (`run_script.py --task serve`: srun, roles by rank) starts the workers, which connect to the front end's
sockets at `--worker-host` (the first node's cluster address).

Whatever ends the server, no worker process is left behind (their shared memory is removed by the engine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

import uvicorn

from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, UsageError

API_KEY_ENV = "MBRIDGE_EPOVERLAP_API_KEY"  # listed in `mbridge_epoverlap.envvars`


def parse_address(text: str) -> tuple[str, int]:
    """HOST:PORT of `--http`.

    Raises:
        UsageError: not HOST:PORT with a port in 0..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--http {text}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]"), int(port)


def serve_http(args: argparse.Namespace) -> int:
    """Run the server the flags describe (`args.dtype_choice`: the dtype `serve` resolved); the exit code (0 after
    a drain, 1 after an engine failure)."""
    from mbridge_epoverlap.serving.engine.hosts import emulate_hosts
    from mbridge_epoverlap.serving.engine.plan import model_source
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.frontend.engine_client import EngineClient
    from mbridge_epoverlap.serving.frontend.metrics import ServerMetrics
    from mbridge_epoverlap.serving.model.checkpoint import context_length, load_spec

    host, port = parse_address(args.http)
    if args.colocated and (args.elastic or args.emulate_hosts):
        raise UsageError(f"--colocated {args.colocated} serves on one host without elastic EP; drop --colocated for "
                         "--elastic or --emulate-hosts (disaggregated attention and expert workers)")
    if args.prompts is not None:
        raise UsageError("--prompts is the batch command; with --http requests come over HTTP (drop one)")
    source = model_source(args.checkpoint, args.recipe)
    dtype = args.dtype_choice  # `serve` resolved --dtype (auto: the checkpoint's where this CPU computes it)
    spec = load_spec(source, dtype=args.dtype)
    model_len = context_length(spec)
    if args.max_model_len is not None and args.max_model_len > model_len:
        raise UsageError(f"--max-model-len {args.max_model_len} is more than the model's context of {model_len} "
                         "tokens (max_position_embeddings)")
    max_model_len = args.max_model_len or model_len
    layout = _layout(args, spec, max_model_len)
    name = args.served_model_name or str(args.checkpoint if args.checkpoint is not None else source)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None

    def plan_for(endpoints: list[str], events: str) -> Any:
        return emulate_hosts(base_plan(endpoints, events), args.emulate_hosts, args.emulate_link_gbps)

    def base_plan(endpoints: list[str], events: str) -> Any:
        plan = make_plan(spec, [], attn_workers=args.attn_workers, expert_workers=args.expert_workers,
                         micro_batches=args.micro_batches, colocated=args.colocated, order=args.order,
                         max_batch=args.max_batch, backend=args.backend,
                         timeout_s=args.timeout, dtype=args.dtype, online_requests=endpoints, online_events=events,
                         max_model_len=max_model_len, max_prefill_tokens=args.max_prefill_tokens,
                         threads=args.threads, replicated_experts=args.replicate_experts,
                         prefix_cache_bytes=0 if args.no_prefix_cache else args.prefix_cache_mib << 20)
        if args.elastic:
            from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic

            plan = make_elastic(plan, redundant=args.redundant_experts, restore=not args.no_expert_restore,
                                rebalance_every=args.rebalance_every, rejoin_after_steps=args.rejoin_after_steps,
                                rebalance_threshold=args.rebalance_threshold, rejoin_hold=args.rejoin_hold)
        return plan

    _log_to_stderr()
    from mbridge_epoverlap.serving.model.kv_cache import kv_cache_bytes_per_token
    from mbridge_epoverlap.serving.model.linear.state_cache import state_bytes_per_sequence

    metrics = ServerMetrics(spec.moe_layer_ids, args.expert_metrics, kv_cache_bytes_per_token(spec),
                            state_bytes_per_sequence(spec))
    outcome: dict[str, Any] = {"code": EXIT_OK, "server": None}  # the exit code; uvicorn's server once it exists

    def engine_ended(reason: str | None) -> None:
        if reason is not None:
            print(f"error: {reason}", file=sys.stderr, flush=True)
            outcome["code"] = EXIT_FAILED
        if outcome["server"] is not None:
            outcome["server"].should_exit = True

    external = args.workers_plan is not None
    with contextlib.ExitStack() as hosts:
        link, worker_host = None, args.worker_host
        if args.emulate_hosts:
            link = hosts.enter_context(_emulated_link(plan_for, args))
            worker_host = link.gateway_address
        engine = EngineClient(plan_for, attn_workers=args.colocated or args.attn_workers, max_batch=args.max_batch,
                              max_waiting=args.max_waiting, metrics=metrics, on_end=engine_ended,
                              host=worker_host, external=external, link=link)
        return _serve(args, engine, spec, name, max_model_len, api_key, metrics, outcome, host, port, layout,
                      dtype.to_dict())


def _layout(args: argparse.Namespace, spec: Any, max_model_len: int) -> dict[str, Any]:
    """The layout the server runs, as `/health` reports it: measured now or earlier (`serve` without layout flags;
    `args` then take it) or the flags'."""
    if not getattr(args, "choose_layout", False):
        return {"source": "flags", "summary": _workers(args)}
    from mbridge_epoverlap.serving.engine.choice.online import as_flags, choose_keeping_frontend

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    choice = choose_keeping_frontend(spec, frontend_cores=args.frontend_cores, max_batch=args.max_batch,
                                     max_model_len=max_model_len, timeout_s=args.timeout, backend=args.backend,
                                     progress=progress)
    for name, value in as_flags(choice["layout"]).items():
        setattr(args, name, value)
    print(f"  layout ({choice['source']}; no layout flag given, force one with --colocated/--replicate-experts/"
          f"--attn-workers/--expert-workers/--micro-batches/--threads): {choice['summary']}", file=sys.stderr,
          flush=True)
    layout = {"source": choice["source"], "chosen": choice["chosen"], "summary": choice["summary"],
              "candidates": {n: c.get("tokens_per_s") for n, c in choice["candidates"].items()}}
    if "few_sequences" in choice:  # the trial that decided whether the front end keeps its cores
        layout["few_sequences"] = choice["few_sequences"]
    return layout


def _workers(args: argparse.Namespace) -> str:
    """The worker processes of the layout, in words."""
    if args.colocated:
        experts = " with every expert each" if args.replicate_experts else ""
        threads = f", {args.threads} thread{'s' if args.threads > 1 else ''} each" if args.threads else ""
        return f"{args.colocated} colocated workers{experts}{threads}"
    return f"{args.attn_workers} attention and {args.expert_workers} expert workers, m={args.micro_batches}"


class _LevelPrefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {super().format(record)}"


def _log_to_stderr() -> None:
    """The front end's warnings (a worker lost, a request a worker could not serve) and errors as lines on
    stderr ("warning: ..."), beside the server's own "error: ..." line."""
    logger = logging.getLogger("mbridge_epoverlap.serving.frontend")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_LevelPrefix("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def _emulated_link(plan_for: Any, args: argparse.Namespace) -> Any:
    """The emulated hosts' link for `--emulate-hosts`, with a gateway in this namespace for the front end's
    sockets (the flags are checked on a plan first: a usage error before anything is created)."""
    from mbridge_epoverlap.launch.netns import EmulatedLink
    from mbridge_epoverlap.serving.engine.hosts import host_of_ranks

    if args.workers_plan is not None:
        raise UsageError("--emulate-hosts starts the workers on this machine; drop it with --workers-plan")
    probe = plan_for([f"tcp://127.0.0.1:{1 + i}" for i in range(args.attn_workers)], "tcp://127.0.0.1:1")
    return EmulatedLink(probe.world, probe.emulate_link_gbps, host_of_ranks(probe), gateway=True)


def _serve(args: argparse.Namespace, engine: Any, spec: Any, name: str, max_model_len: int, api_key: str | None,
           metrics: Any, outcome: dict[str, Any], host: str, port: int, layout: dict[str, Any],
           dtype: dict[str, Any]) -> int:
    from mbridge_epoverlap.memory import describe
    from mbridge_epoverlap.serving.api.served_model import ModelInfo
    from mbridge_epoverlap.serving.frontend.app import Settings, build_app
    from mbridge_epoverlap.serving.frontend.connections import guarded_h11
    from mbridge_epoverlap.serving.frontend.engine_client import FAILED, READY, STOPPED
    from mbridge_epoverlap.serving.frontend.text import TextCodec

    external = args.workers_plan is not None
    if external:  # srun starts the workers from this plan (they read their rank and rendezvous from Slurm)
        from mbridge_epoverlap.serving.frontend.engine_client import WORKERS_ENDED_SIGNAL

        # The job script's word that the workers' step ended must not kill the process (the signal's default)
        # before the engine listens for it; until then the engine's start-up limits apply.
        signal.signal(WORKERS_ENDED_SIGNAL, signal.SIG_IGN)
        tmp = args.workers_plan.with_suffix(".tmp")
        tmp.write_text(engine.plan.to_json())
        tmp.replace(args.workers_plan)
    codec = TextCodec(spec.source if spec.is_checkpoint else None)
    workers = args.colocated or args.attn_workers
    info = ModelInfo(name, spec.vocab_size, max_model_len, codec, eos_ids=tuple(spec.eos_token_ids),
                     max_logprobs=args.max_logprobs, max_sequences=args.max_batch * workers + args.max_waiting)
    settings = Settings(info, api_key=api_key,
                        body_timeout_s=args.read_timeout, max_connections=args.max_connections,
                        serving={"layout": dict(layout, workers=_workers(args)), "dtype": dtype})
    # The connections counted are uvicorn's own (`server` is bound below, before the first request).
    app = build_app(settings, engine, metrics, open_connections=lambda: len(server.server_state.connections))
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            http=guarded_h11(args.read_timeout))
    server = outcome["server"] = _DrainingServer(config, engine, args.drain_timeout)

    async def announce() -> None:
        while not (server.started and engine.state == READY):
            if engine.state in (FAILED, STOPPED) or server.should_exit:
                return
            await asyncio.sleep(0.02)
        chosen = f"; layout {layout['chosen']}, {layout['source']}" if "chosen" in layout else ""
        held = engine.memory_now()
        memory = f"; {describe(held)}" if held is not None else ""
        print(f"mbridge-epoverlap serve: ready at http://{host}:{port} (model {name}, {_workers(args)}{chosen}; "
              f"dtype {dtype['dtype']}: {dtype['reason']}{memory})",
              file=sys.stderr, flush=True)

    async def main() -> None:
        engine.start()
        announcing = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            announcing.cancel()
            if engine.state not in (FAILED, STOPPED):  # not drained (a bind error, a forced stop): stop the workers
                engine.stop_workers()
            # srun's workers may be gone without a word (their step was cancelled): no long wait for them
            await engine.wait_ended(timeout_s=5.0 if external else 30.0)

    try:
        asyncio.run(main())
    finally:
        if external:  # the closed loop put the signal's default (end the process) back; the word may come yet
            signal.signal(WORKERS_ENDED_SIGNAL, signal.SIG_IGN)
        engine.stop_workers()
        engine.close()
    if not server.started and outcome["code"] == EXIT_OK:
        return EXIT_FAILED  # uvicorn could not bind HOST:PORT (it said why)
    return outcome["code"]


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM/SIGINT drains the engine before the HTTP side stops (uvicorn's own
    handler would stop taking connections at once); a second one stops at once."""

    def __init__(self, config: uvicorn.Config, engine: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.draining = False

    def handle_exit(self, sig: int, frame: Any) -> None:  # a signal handler, on the loop's thread
        if self.draining:
            self.force_exit = self.should_exit = True
            return
        self.draining = True
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        await self.engine.drain(self.drain_timeout_s)
        self.should_exit = True
