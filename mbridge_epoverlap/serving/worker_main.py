"""One serving worker process: `python -m mbridge_epoverlap.serving.worker_main --plan PLAN.json --out DIR`.

Started by the engine through the training runtime's launcher (`runtime.launch.launch_processes`):
rank and world from `RANK`/`WORLD_SIZE` (or Slurm's variables), rendezvous at `MASTER_ADDR`/`MASTER_PORT`
(one TCP store for the M2N rendezvous and the gloo group), heartbeats in the launcher's directory.
Each rank writes `DIR/rank<R>.json`: its completions (attention), its stage times and counters. On a
lost peer an attention worker still writes what it finished, with the rest reported failed.

Exit codes as the training ranks: 0 done, 1 failed, 2 usage error, 3 a peer died or timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from mbridge_epoverlap.comm.errors import EXIT_COMM
from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from mbridge_epoverlap.runtime.options import PREFIX
from mbridge_epoverlap.runtime.worker import rank_and_world
from mbridge_epoverlap.schedule.program import Role
from mbridge_epoverlap.serving.plan import COLOCATED, EnginePlan


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)


def _is_peer_failure(exc: BaseException) -> bool:
    from mbridge_epoverlap.comm.errors import CommError
    from mbridge_epoverlap.comm.m2n.base import PeerError

    return isinstance(exc, CommError | PeerError)


def run(plan: EnginePlan, out: Path, state: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    from mbridge_epoverlap.runtime import heartbeat as hb
    from mbridge_epoverlap.serving.checkpoint import load_spec
    from mbridge_epoverlap.serving.placement import Placement
    from mbridge_epoverlap.serving.requests import Request, RequestQueue

    rank, world, _ = rank_and_world(os.environ)
    if world != plan.world:
        raise UsageError(f"the plan is for {plan.world} processes but WORLD_SIZE is {world}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = timedelta(seconds=plan.timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                            timeout=timeout)
    beat_dir = os.environ.get(PREFIX + "HEARTBEAT_DIR")
    beat = hb.Heartbeat(hb.heartbeat_path(beat_dir, rank) if beat_dir else None)
    spec = load_spec(plan.source, seed=plan.seed, num_layers=plan.num_layers, dtype=plan.dtype)
    role, index = plan.role_of(rank)
    placement = Placement.from_list(plan.placement, len(plan.expert_ranks))
    progress = (lambda line: print(line, flush=True)) if rank == 0 else None
    payload: dict[str, Any] = {"rank": rank, "role": "colocated" if role is None else role.value, "index": index}
    state["payload"], state["out"] = payload, out / f"rank{rank}.json"

    queue = None
    if role is not Role.EXPERT:
        queue = RequestQueue([Request(str(r["id"]), tuple(r["prompt_ids"])) for r in plan.requests[index]],
                             max_batch=plan.max_batch, max_new_tokens=plan.max_new_tokens,
                             eos_ids=spec.eos_token_ids)
        state["queue"] = queue
    with torch.no_grad():
        worker = _build(plan, spec, role, index, placement, queue, store, beat, progress)
        state["worker"] = worker
        dist.barrier()  # every worker loaded its weights: start timing together
        started = time.monotonic()
        if queue is not None:
            queue.start = started
        worker.run()
        payload["wall_s"] = time.monotonic() - started
    payload.update(_report(worker, queue))
    _write(state["out"], payload)
    beat.beat(getattr(worker, "decode_steps", 0), 0, hb.DONE)
    comm = getattr(worker, "comm", None)
    if comm is not None:
        comm.close()
    dist.destroy_process_group()
    return EXIT_OK


def _build(plan: EnginePlan, spec: Any, role: Role | None, index: int, placement: Any, queue: Any, store: Any,
           beat: Any, progress: Any) -> Any:
    import torch.distributed as dist

    from mbridge_epoverlap.serving import model as parts

    if plan.mode == COLOCATED or role is None:
        import torch

        from mbridge_epoverlap.comm.alltoall import CommContext
        from mbridge_epoverlap.serving.colocated import ColocatedWorker

        ctx = CommContext.for_device(torch.device("cpu"), plan.timeout_s, comm_thread=plan.world > 1)
        group = dist.group.WORLD if plan.world > 1 else None
        return ColocatedWorker(spec, parts.load_attention_part(spec), parts.KVCache.for_spec(spec), queue,
                               parts.load_expert_part(spec, placement.experts_of(index)), placement, plan.order,
                               plan.micro_batches, group, ctx, beat, progress)
    from mbridge_epoverlap.comm.m2n import make_communicator
    from mbridge_epoverlap.serving.workers import AttentionWorker, ExpertWorker

    rank = dist.get_rank()
    peers = plan.expert_ranks if role is Role.ATTENTION else plan.attention_ranks
    comm = make_communicator(plan.backend, rank=rank, peers=peers, store=dist.PrefixStore("m2n", store),
                             slot_bytes=plan.slot_bytes, slots=plan.micro_batches + 1, timeout_s=plan.timeout_s,
                             roles={peer: plan.role_name(peer) for peer in peers}, world_size=plan.world,
                             single_host=plan.backend != "torch")
    if plan.elastic:
        return _build_elastic(plan, spec, role, index, queue, comm, beat, progress)
    if role is Role.ATTENTION:
        return AttentionWorker(spec, parts.load_attention_part(spec), parts.KVCache.for_spec(spec), queue, comm,
                               plan.expert_ranks, placement, plan.micro_batches, plan.timeout_s, beat, progress)
    return ExpertWorker(spec, parts.load_expert_part(spec, placement.experts_of(index)), comm, plan.attention_ranks,
                        plan.micro_batches, plan.timeout_s, beat)


def _build_elastic(plan: EnginePlan, spec: Any, role: Role, index: int, queue: Any, comm: Any, beat: Any,
                   progress: Any) -> Any:
    from mbridge_epoverlap.serving import model as parts
    from mbridge_epoverlap.serving.elastic import ElasticLayout, ExpertStore
    from mbridge_epoverlap.serving.elastic_workers import ElasticAttentionWorker, ElasticExpertWorker
    from mbridge_epoverlap.serving.placement import Placement

    layout = ElasticLayout(spec.num_experts, plan.expert_workers, tuple(plan.slots),
                           frozenset(range(plan.expert_workers)))
    if role is Role.ATTENTION:
        return ElasticAttentionWorker(spec, parts.load_attention_part(spec), parts.KVCache.for_spec(spec), queue,
                                      comm, plan.expert_ranks, Placement.balanced(spec.num_experts, 1),
                                      plan.micro_batches, plan.timeout_s, beat, progress, layout=layout,
                                      restore=plan.expert_restore)
    kill_at = next((step for worker, step in plan.kill if worker == index), None)
    out = os.environ.get(PREFIX + "HEARTBEAT_DIR")
    return ElasticExpertWorker(spec, ExpertStore(spec, layout.experts_of(index)), comm, plan.attention_ranks,
                               plan.micro_batches, plan.timeout_s, beat, layout=layout, index=index,
                               restore=plan.expert_restore, kill_at_step=kill_at,
                               kill_file=os.path.join(out, f"killed{index}") if out else None)


def _report(worker: Any, queue: Any, *, failed: bool = False) -> dict[str, Any]:
    report: dict[str, Any] = {"decode_steps": getattr(worker, "decode_steps", 0)}
    if hasattr(worker, "events"):
        report["events"] = worker.events
        if queue is not None:
            report["token_times"] = {s.request.id: list(s.token_times) for s in queue.running + queue.done}
    timer = getattr(worker, "timer", None)
    if timer is not None:
        report["stages"] = timer.summary()
    if queue is not None:
        report["completions"] = queue.completions(failed=failed)
        report["step_log"] = getattr(worker, "step_log", [])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.serving.worker_main", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    state: dict[str, Any] = {}
    try:
        code = run(EnginePlan.from_json(args.plan.read_text()), args.out, state)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_USAGE
    except Exception as exc:
        traceback.print_exc()
        code = EXIT_COMM if _is_peer_failure(exc) else EXIT_FAILED
        print(f"worker failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if "payload" in state:  # report what finished; requests in flight are failed
            payload = dict(state["payload"], error=f"{type(exc).__name__}: {exc}")
            payload.update(_report(state.get("worker"), state.get("queue"), failed=True))
            _write(state["out"], payload)
        comm = getattr(state.get("worker"), "comm", None)
        if comm is not None:
            comm.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # After a lost peer, tearing down the process group can block on it: leave now.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
