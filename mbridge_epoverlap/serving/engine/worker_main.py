"""One serving worker process: `python -m mbridge_epoverlap.serving.engine.worker_main --plan PLAN.json --out DIR`.

Started by the engine through the process supervisor (`launch.launch_processes`):
rank and world from `RANK`/`WORLD_SIZE` (or Slurm's variables), rendezvous at `MASTER_ADDR`/`MASTER_PORT`
(one TCP store for the M2N rendezvous and the gloo group), heartbeats in the launcher's directory.
Each rank writes `DIR/rank<R>.json`: its completions (attention), its stage times and counters. On a
lost peer an attention worker still writes what it finished, with the rest reported failed.

A replacement expert worker (elastic mode, `--rejoin G`: generation G of that rank) starts after the others:
it joins no process group, announces itself in the TCP store, waits for its admission, connects its M2N
channels to the attention workers and the live expert workers, and serves from the admission's decode step.

Exit codes as the training ranks: 0 done, 1 failed, 2 usage error, 3 a peer died or timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from mbridge_epoverlap.comm.errors import EXIT_COMM, CommError
from mbridge_epoverlap.comm.store import open_store
from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from mbridge_epoverlap.launch.orphan import exit_when_orphaned
from mbridge_epoverlap.runtime.options import PREFIX
from mbridge_epoverlap.runtime.worker import rank_and_world
from mbridge_epoverlap.schedule.program import Role
from mbridge_epoverlap.serving.engine.heap import keep_freed_memory
from mbridge_epoverlap.serving.engine.plan import COLOCATED, EnginePlan
from mbridge_epoverlap.serving.workers.protocol import Worker

ONLINE_TIMER_SAMPLES = 4096  # stage times an online worker keeps per stage


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)


def run(plan: EnginePlan, out: Path, state: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    from mbridge_epoverlap import memory
    from mbridge_epoverlap.launch import heartbeat as hb
    from mbridge_epoverlap.serving.workers.placement import Placement
    from mbridge_epoverlap.serving.workers.requests import Request, RequestQueue

    rank, world, _ = rank_and_world(os.environ)
    if world != plan.world:
        raise UsageError(f"the plan is for {plan.world} processes but WORLD_SIZE is {world}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    keep_freed_memory()
    timeout = timedelta(seconds=plan.timeout_s)
    store = open_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world=world,
                       is_server=rank == 0 and not plan.store_hosted, timeout_s=plan.timeout_s)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timeout)
    beat_dir = os.environ.get(PREFIX + "HEARTBEAT_DIR")
    beat = hb.Heartbeat(hb.heartbeat_path(beat_dir, rank) if beat_dir else None)
    spec = plan.load_spec()
    role, index = plan.role_of(rank)
    placement = Placement.from_list(plan.placement, len(plan.expert_ranks))
    progress = (lambda line: print(line, flush=True)) if rank == 0 and not plan.online else None
    payload: dict[str, Any] = {"rank": rank, "role": "colocated" if role is None else role.value, "index": index,
                               "torch_threads": torch.get_num_threads()}
    state["payload"], state["out"] = payload, out / f"rank{rank}.json"

    queue = None
    if role is not Role.EXPERT:
        queue = RequestQueue([Request(str(r["id"]), tuple(r["prompt_ids"])) for r in plan.requests[index]],
                             max_batch=plan.max_batch, max_new_tokens=plan.max_new_tokens,
                             eos_ids=spec.eos_token_ids)
        state["queue"] = queue
    state["runtime_rss"] = memory.process_memory().get("rss", 0)  # the process before any weight: the runtime
    with torch.no_grad():
        worker = _build(plan, spec, role, index, placement, queue, store, beat, progress)
        state["worker"] = worker
        cores = getattr(getattr(worker, "side", None), "cores", None)
        if cores is not None:
            payload["step_cores"] = cores.summary  # what the process does with its threads at each step
        if plan.online:  # a server runs for days: keep a window of stage times, not every one
            timer = worker.side.timer if role is Role.ATTENTION else getattr(worker, "timer", None)
            if timer is not None:
                timer.limit = ONLINE_TIMER_SAMPLES
        # Every worker loaded its weights: start timing together. A server's workers gather what each process
        # holds on the way (a barrier too), which its attention workers tell the front end for its ready line and
        # `/health`; a batch run reports it when it ends (`_finish`).
        if plan.online:
            loaded: list[Any] = [None] * world
            dist.all_gather_object(loaded, _memory(worker, state, rank))
            if role is not Role.EXPERT:
                worker.side.source.memory = loaded
        else:
            dist.barrier()
        if plan.online and role is not None and not _m2n_on_process_groups(plan):
            # Nothing uses the group after this barrier (the M2N channels and the store carry the rest), and gloo's
            # transport thread wakes every 10 ms while it lives: half of what an idle server still cost. (The
            # colocated transport keeps the group; the `torch` and `gloo` M2N backends run on process groups.)
            dist.destroy_process_group()
        started = time.monotonic()
        if queue is not None:
            queue.start = started
        worker.run()
    _finish(worker, queue, payload, state, beat, started)
    if dist.is_initialized():
        dist.destroy_process_group()
    return EXIT_OK


def _finish(worker: Worker, queue: Any, payload: dict[str, Any], state: dict[str, Any], beat: Any,
            started: float) -> None:
    """After a worker's run: its wall time and report written, its heartbeat done, its channels closed."""
    from mbridge_epoverlap.launch import heartbeat as hb

    payload["wall_s"] = time.monotonic() - started
    payload.update(_report(worker, queue))
    payload["memory"] = _memory(worker, state, payload["rank"])
    _write(state["out"], payload)
    beat.beat(worker.decode_steps, 0, hb.DONE)
    worker.close()


def _memory(worker: Worker, state: dict[str, Any], rank: int) -> dict[str, Any]:
    """What this process holds now: its weights' bytes by kind, its KV cache's, the runtime's (its resident set
    before the weights) and its resident set now and at its peak (`mbridge_epoverlap.memory`)."""
    from mbridge_epoverlap import memory

    return {"rank": rank, **memory.resident_bytes(worker), "runtime": state.get("runtime_rss", 0),
            **memory.process_memory()}


def _build(plan: EnginePlan, spec: Any, role: Role | None, index: int, placement: Any, queue: Any, store: Any,
           beat: Any, progress: Any) -> Worker:
    import torch.distributed as dist

    from mbridge_epoverlap.serving.model import parts

    if plan.mode == COLOCATED or role is None:
        import torch

        from mbridge_epoverlap.comm.alltoall import CommContext
        from mbridge_epoverlap.serving.workers.colocated import colocated_worker
        from mbridge_epoverlap.serving.workers.step_cores import StepCores, experts_tile

        ctx = CommContext.for_device(torch.device("cpu"), plan.timeout_s, comm_thread=False)
        group, comm = None, None
        held = index  # the placement's holder this rank is
        if plan.replicated_experts:  # every expert here: the rank decodes its own sequences as one process does
            from mbridge_epoverlap.serving.workers.placement import Placement

            placement, held = Placement.balanced(spec.num_experts, 1), 0
        elif plan.world > 1:
            # Per layer and micro-batch a rank sends each other rank a dispatch and a reply: slots for every
            # micro-batch's pair, so a send never waits for a slot while its sender waits on another rank.
            group = dist.group.WORLD
            comm = _m2n(plan, dist.PrefixStore("m2n", store), rank=dist.get_rank(),
                        peers=[r for r in range(plan.world) if r != dist.get_rank()], slots=2 * plan.micro_batches + 1)
        experts = parts.load_expert_part(spec, placement.experts_of(held), packed=True)
        attention = parts.load_attention_part(spec, packed=True)
        worker = colocated_worker(spec, attention, parts.KVCache.for_engine(spec), queue, experts, placement,
                                  plan.order, plan.micro_batches, group, ctx, beat, progress, comm)
        worker.side.cores = StepCores(torch.get_num_threads(), experts_tile(spec))
        _serve_online(plan, index, worker.side, worker.transport)
        return worker
    from mbridge_epoverlap.serving.workers.decode import AttentionWorker
    from mbridge_epoverlap.serving.workers.expert import ExpertWorker
    from mbridge_epoverlap.serving.workers.m2n import M2NTransport

    peers = plan.expert_ranks if role is Role.ATTENTION else plan.attention_ranks
    comm = _m2n(plan, dist.PrefixStore("m2n", store), rank=dist.get_rank(), peers=peers)
    if plan.elastic:
        return _build_elastic(plan, spec, role, index, queue, comm, beat, progress, store)
    if role is Role.ATTENTION:
        side = _attention_side(plan, spec, queue)
        transport = M2NTransport(side, comm, plan.expert_ranks, placement)
        _serve_online(plan, index, side, transport)
        return AttentionWorker(side, transport, beat=beat, progress=progress)
    experts = parts.load_expert_part(spec, placement.experts_of(index), packed=True)
    return ExpertWorker(spec, experts, comm, plan.attention_ranks, plan.micro_batches, plan.timeout_s, beat)


def _attention_side(plan: EnginePlan, spec: Any, queue: Any) -> Any:
    """An attention worker's own part: its weights, KV cache and requests."""
    from mbridge_epoverlap.serving.model import parts
    from mbridge_epoverlap.serving.workers.attention import AttentionSide

    return AttentionSide(spec, parts.load_attention_part(spec, packed=True), parts.KVCache.for_engine(spec), queue,
                         plan.micro_batches, plan.timeout_s)


def _serve_online(plan: EnginePlan, index: int, side: Any, transport: Any) -> None:
    """Online serving: attach the front end's request source to the attention side (nothing in a batch run)."""
    if not plan.online:
        return
    from mbridge_epoverlap.serving.workers.online import OnlineSource

    OnlineSource(index, plan.online_requests[index], plan.online_events, side,
                 prefill_budget=plan.prefill_budget or plan.max_model_len, max_model_len=plan.max_model_len,
                 events=transport.events, prefix_cache_bytes=plan.prefix_cache_bytes)


def _grouping(plan: EnginePlan, spec: Any) -> tuple[int, int]:
    """`(groups, nodes)` of the run's placements, as `elastic_plan.make_elastic` chose them for the start one: every
    worker must re-solve with the same, or their tables would differ after a loss or a rebalance."""
    from mbridge_epoverlap.serving.elastic.layout import expert_grouping
    from mbridge_epoverlap.serving.engine.elastic_plan import routing_groups

    return expert_grouping(spec.num_experts, plan.expert_workers, len(plan.slots), routing_groups(spec))


def _build_elastic(plan: EnginePlan, spec: Any, role: Role, index: int, queue: Any, comm: Any, beat: Any,
                   progress: Any, store: Any) -> Worker:
    from mbridge_epoverlap.serving.elastic.layout import ElasticLayout
    from mbridge_epoverlap.serving.elastic.workers import ElasticRouter
    from mbridge_epoverlap.serving.model.expert_store import ExpertStore
    from mbridge_epoverlap.serving.workers.decode import AttentionWorker

    layout = ElasticLayout(spec.num_experts, plan.expert_workers, tuple(plan.slots),
                           frozenset(range(plan.expert_workers)), *_grouping(plan, spec))
    if role is Role.ATTENTION:
        import torch.distributed as dist

        from mbridge_epoverlap.serving.elastic.sync import StepSync

        sync = StepSync(dist.PrefixStore("elastic", store), index, plan.attn_workers, plan.timeout_s) \
            if plan.layout_epochs else None
        side = _attention_side(plan, spec, queue)
        router = ElasticRouter(side, comm, plan.expert_ranks, layout=layout, restore=plan.expert_restore, sync=sync,
                               m2n_store=dist.PrefixStore("m2n", store), rebalance_every=plan.rebalance_every,
                               rejoin_after_steps=plan.rejoin_after_steps,
                               rebalance_threshold=plan.rebalance_threshold, rejoin_hold=plan.rejoin_hold,
                               progress=progress)
        _serve_online(plan, index, side, router)
        return AttentionWorker(side, router, beat=beat, progress=progress)
    kill_at = next((step for worker, step in plan.kill if worker == index), None)
    out = os.environ.get(PREFIX + "HEARTBEAT_DIR")
    mover = _weight_mover(plan, index, store, peers=[r for r in plan.expert_ranks if r != plan.expert_ranks[index]])
    return _expert_worker(plan, spec, comm, beat, layout, index, ExpertStore(spec, layout.experts_of(index)), mover,
                          store, kill_at_step=kill_at, kill_file=os.path.join(out, f"killed{index}") if out else None)


def _expert_worker(plan: EnginePlan, spec: Any, comm: Any, beat: Any, layout: Any, index: int, experts: Any,
                   mover: Any, store: Any, **kwargs: Any) -> Any:
    import torch.distributed as dist

    from mbridge_epoverlap.serving.elastic.workers import ElasticExpertWorker

    # With layout epochs an attention worker it drops is posted lost there, for the others' step boundaries.
    sync_store = dist.PrefixStore("elastic", store) if plan.layout_epochs else None

    return ElasticExpertWorker(spec, experts, comm, plan.attention_ranks, plan.micro_batches, plan.timeout_s, beat,
                               layout=layout, index=index, restore=plan.expert_restore, mover=mover,
                               droppable_attention=set(plan.expendable_ranks) & set(plan.attention_ranks),
                               sync_store=sync_store, **kwargs)


def _weight_mover(plan: EnginePlan, index: int, store: Any, *, peers: list[int], key_prefix: str = "m2n") -> Any:
    """The channel between expert workers that carries moved weights (None when the layout never changes)."""
    if not plan.layout_epochs:
        return None
    import torch.distributed as dist

    from mbridge_epoverlap.serving.elastic.moves import WeightMover

    weights_store = dist.PrefixStore("m2n-weights", store)
    comm = _m2n(plan, weights_store, rank=plan.expert_ranks[index], peers=peers, key_prefix=key_prefix,
                slot_bytes=plan.weight_slot_bytes, slots=2)
    return WeightMover(comm, weights_store, plan.expert_ranks, index, plan.timeout_s, plan.expert_restore)


def run_replacement(plan: EnginePlan, out: Path, state: dict[str, Any], generation: int) -> int:
    """A replacement expert worker: announce, wait for admission, connect, serve (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from mbridge_epoverlap import memory
    from mbridge_epoverlap.launch import heartbeat as hb
    from mbridge_epoverlap.serving.elastic.layout import ElasticLayout
    from mbridge_epoverlap.serving.elastic.moves import rejoin_prefix
    from mbridge_epoverlap.serving.elastic.sync import wait_admission
    from mbridge_epoverlap.serving.model.expert_store import ExpertStore

    started = time.monotonic()
    rank, world, _ = rank_and_world(os.environ)
    role, index = plan.role_of(rank)
    if role is not Role.EXPERT or not plan.rejoin_after_steps:
        raise UsageError(f"--rejoin applies to the expert ranks of a plan with rejoin_after_steps (rank {rank} is "
                         f"{plan.role_name(rank)})")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    keep_freed_memory()
    store = open_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world=world, is_server=False,
                       timeout_s=plan.timeout_s)
    beat_dir = os.environ.get(PREFIX + "HEARTBEAT_DIR")
    beat = hb.Heartbeat(hb.heartbeat_path(beat_dir, rank) if beat_dir else None)
    spec = plan.load_spec()
    state["runtime_rss"] = memory.process_memory().get("rss", 0)
    payload: dict[str, Any] = {"rank": rank, "role": "expert", "index": index, "generation": generation}
    state["payload"], state["out"] = payload, out / f"rank{rank}.json"
    from mbridge_epoverlap.serving.model import packed as packed_gemm

    # Before saying it is ready (the wait for admission is idle time): the packed expert GEMMs' kernels for decode's
    # row counts, which the running workers created in their first steps.
    packed_gemm.warm_up(spec.hidden_size, spec.expert_ffn, spec.torch_dtype(), plan.max_batch)
    elastic = dist.PrefixStore("elastic", store)
    elastic.set(f"ready/{index}/{generation}", str(os.getpid()))
    ready = time.monotonic()
    # No limit of its own: the run may go on for long before this worker's turn; the launcher's run timeout,
    # the `done` key and the store's end (attention worker 0 exited) all end the wait.
    admission = wait_admission(elastic, index, generation, limit_s=float("inf"))
    if admission is None:  # the run ended before this worker's turn
        payload.update({"events": [{"event": "not-admitted", "t": time.monotonic()}], "decode_steps": 0})
        _write(state["out"], payload)
        return EXIT_OK
    layout = ElasticLayout.from_slots(spec.num_experts, plan.expert_workers, admission["slots"],
                                      *_grouping(plan, spec))
    prefix = rejoin_prefix(index, generation)
    comm = _m2n(plan, dist.PrefixStore("m2n", store), rank=rank, peers=plan.attention_ranks, key_prefix=prefix)
    state["comms"] = [comm]  # closed on failure (the worker does not exist yet)
    peers = [plan.expert_ranks[w] for w in sorted(layout.alive)]
    mover = _weight_mover(plan, index, store, peers=peers, key_prefix=prefix)
    state["comms"].append(mover.comm)
    with torch.no_grad():
        worker = _expert_worker(plan, spec, comm, beat, layout, index, ExpertStore(spec, []), mover, store,
                                epoch=admission["epoch"])
        worker.decode_steps = admission["step"]
        worker.events.append({"event": "joined", "t": time.monotonic(), "step": admission["step"],
                              "load_s": ready - started, "connect_s": time.monotonic() - ready})
        state["worker"] = worker
        joined = time.monotonic()
        worker.run()
    _finish(worker, None, payload, state, beat, joined)
    return EXIT_OK


def _m2n_single_host(plan: EnginePlan) -> bool:
    """What `_m2n` tells the backend about the ranks' hosts (`m2n` resolves to `shm` on one host)."""
    return plan.backend != "torch" and not plan.emulate_hosts


def _m2n_on_process_groups(plan: EnginePlan) -> bool:
    """Whether the plan's M2N backend runs on torch.distributed process groups (`torch`, `gloo`)."""
    from mbridge_epoverlap.comm.m2n import resolve_backend

    return resolve_backend(plan.backend, single_host=_m2n_single_host(plan)) in ("torch", "gloo")


def _m2n(plan: EnginePlan, store: Any, *, rank: int, peers: Sequence[int], key_prefix: str = "m2n",
         slot_bytes: int | None = None, slots: int | None = None) -> Any:
    """This rank's end of an M2N channel of the plan's backend to `peers` (named by role in errors); by default
    the dispatch/combine channel: a slot per micro-batch in flight plus one, each `plan.slot_bytes`."""
    from mbridge_epoverlap.comm.m2n import make_communicator

    return make_communicator(plan.backend, rank=rank, peers=peers, store=store, key_prefix=key_prefix,
                             slot_bytes=plan.slot_bytes if slot_bytes is None else slot_bytes,
                             slots=plan.micro_batches + 1 if slots is None else slots, timeout_s=plan.timeout_s,
                             roles={peer: plan.role_name(peer) for peer in peers}, world_size=plan.world,
                             single_host=_m2n_single_host(plan))


def _report(worker: Worker | None, queue: Any, *, failed: bool = False) -> dict[str, Any]:
    """The worker's report; before the worker exists, what its requests came to (all failed or not started)."""
    if worker is not None:
        return worker.report(failed=failed)
    report: dict[str, Any] = {"decode_steps": 0}
    if queue is not None:
        report["completions"] = queue.completions(failed=failed)
        report["step_log"] = []
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.serving.engine.worker_main",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rejoin", type=int, default=0, metavar="G",
                        help="start as replacement G of a lost expert worker (elastic mode; set by the launcher)")
    args = parser.parse_args(argv)
    state: dict[str, Any] = {}
    exit_when_orphaned(lambda: _release(state))
    try:
        plan = EnginePlan.from_json(args.plan.read_text())
        if args.rejoin:
            code = run_replacement(plan, args.out, state, args.rejoin)
        else:
            code = run(plan, args.out, state)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except Exception as exc:
        # Failing already: a SIGTERM now (srun stopping the step after a lost peer) must not cut the report and
        # the front end's last word short; the process exits right after them.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        traceback.print_exc()
        code = EXIT_COMM if isinstance(exc, CommError) else EXIT_FAILED
        print(f"worker failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        state["error"] = f"{type(exc).__name__}: {exc}"
        if "payload" in state:  # report what finished; requests in flight are failed
            payload = dict(state["payload"], error=f"{type(exc).__name__}: {exc}")
            payload.update(_report(state.get("worker"), state.get("queue"), failed=True))
            _write(state["out"], payload)
        _release(state)
    sys.stdout.flush()
    sys.stderr.flush()
    # After a lost peer, tearing down the process group can block on it: leave now.
    os._exit(code)


def _release(state: dict[str, Any]) -> None:
    """Close the worker and the channels it had opened (their shared memory goes with them); an online attention
    worker that failed tells the front end why as it leaves."""
    from mbridge_epoverlap.serving.workers.decode import AttentionWorker

    worker = state.get("worker")
    if isinstance(worker, AttentionWorker) and worker.side.source is not None and state.get("error"):
        worker.side.source.error = state["error"]
    if worker is not None:
        worker.close()
    for comm in state.get("comms", []):
        comm.close()


if __name__ == "__main__":
    sys.exit(main())
