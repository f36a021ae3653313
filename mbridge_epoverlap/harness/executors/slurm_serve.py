"""`run_script.py --task serve_bench`: the serving bench as one Slurm job, roles placed by rank.

srun starts one serving worker per task (`mbridge_epoverlap.serving.engine.worker_main`): ranks 0..A-1 are the
attention workers and ranks A..A+E-1 the expert workers (`serving.plan.EnginePlan.role_of`); they meet
at the first node's address. One node uses the shared-memory M2N backend, more nodes the `torch`
point-to-point one. The job then merges the workers' reports and checks every token against the
single-process reference (`mbridge_epoverlap.serving.engine.collect`). `--executor local` runs the same bench
on local processes.

Flags: `-mr` recipe, `-ng` workers (A+E), `-gn` workers per node, `--attn_workers A`, `--micro_batches M`,
`-gb` sequences, `-ms` tokens per sequence, `--results_json`, `--dryrun` (print the sbatch script).

`run_script.py --task serve` is the online server as one Slurm job: the batch script starts
`mbridge-epoverlap serve --http` on the first node (its worker sockets on that node's cluster address, the
plan written for srun with `--workers-plan`), then srun starts the workers from that plan, roles by rank as
above. The harness submits the job, waits for the server's ready line in the job's log and prints the URL
(`scancel` the job to stop it: the server drains). Same flags, `-gb` is the sequences per attention worker.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import EXIT_OK, RunFailedError, UsageError
from mbridge_epoverlap.harness.executors.slurm_script import (
    MARKER,
    PORT_BASE_LINE,
    JobShape,
    ScriptOptions,
    sbatch_header,
)


def render_serve_script(plan_path: Path, world: int, shape: JobShape, opts: ScriptOptions, *, attn_workers: int,
                        results: Path) -> str:
    """The sbatch script: srun the workers (role by rank), then collect."""
    q = shlex.quote
    out_dir = opts.job_dir / "workers"
    lines = _preamble("serve-bench", f"serve-bench: ranks 0..{attn_workers - 1} attention workers, ranks "
                      f"{attn_workers}..{world - 1} expert workers", shape, opts)
    lines += [
        "export MASTER_ADDR",
        PORT_BASE_LINE,
        "export MASTER_PORT=$PORT_BASE",
        f'log() {{ echo "{MARKER} $*"; }}',
        f"mkdir -p {q(str(out_dir))}",
        'log "serve-bench: start (port $MASTER_PORT)"',
        *_srun_workers(world, shape, q(str(plan_path)), out_dir),
        'log "serve-bench: workers done; collecting"',
        f'"$PYTHON" -m mbridge_epoverlap.serving.engine.collect --plan {q(str(plan_path))} --out {q(str(out_dir))} '
        f"--results {q(str(results))}",
        f"log {q('results written to ' + str(results))}",
        "",
    ]
    return "\n".join(lines)


def _preamble(task: str, comment: str, shape: JobShape, opts: ScriptOptions) -> list[str]:
    """The lines both serving scripts start with: the sbatch header, what the job is, the job directory,
    Python and its path, and the first node's name."""
    q = shlex.quote

    class _Exp:  # what the shared header reads
        recipe = task

    return [*sbatch_header(_Exp(), shape, opts), "#", f"# mbridge-epoverlap {comment}",  # type: ignore[arg-type]
            "set -euo pipefail",
            f"JOB_DIR={q(str(opts.job_dir))}",
            f'PYTHON="${{MBRIDGE_EPOVERLAP_PYTHON:-{opts.python}}}"',
            f'export PYTHONPATH={q(str(opts.repo_root))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
            'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"']


def _srun_workers(world: int, shape: JobShape, plan: str, out_dir: Path, *, background: bool = False) -> list[str]:
    """srun one serving worker per task from the plan at `plan` (shell-quoted), its rank from Slurm."""
    return [f"srun --ntasks={world} --ntasks-per-node={shape.tasks_per_node} --kill-on-bad-exit=1 \\",
            "  bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS; exec \"$@\"' "
            f'rank "$PYTHON" -m mbridge_epoverlap.serving.engine.worker_main --plan {plan} '
            f"--out {shlex.quote(str(out_dir))}" + (" &" if background else "")]


HTTP_PORT_BASE = 30000  # the server's port is HTTP_PORT_BASE + job id % 20000 (above the rendezvous ports)
READY_LINE = "ready at http://"


def render_online_script(plan_path: Path, world: int, shape: JobShape, opts: ScriptOptions, *, recipe: str,
                         attn_workers: int, micro_batches: int, max_batch: int, backend: str) -> str:
    """The sbatch script of the online server: the front end on the first node, then srun the workers."""
    q = shlex.quote
    out_dir = opts.job_dir / "workers"
    serve = (f'"$PYTHON" -m mbridge_epoverlap.cli serve -mr {q(recipe)} --http "0.0.0.0:$HTTP_PORT" '
             f'--workers-plan "$PLAN" --worker-host "$MASTER_IP" --attn-workers {attn_workers} '
             f"--expert-workers {world - attn_workers} --micro-batches {micro_batches} --max-batch {max_batch} "
             f"--backend {backend} --max-model-len 512")
    lines = _preamble("serve", f"serve --http on the first node; ranks 0..{attn_workers - 1} attention workers, "
                      f"ranks {attn_workers}..{world - 1} expert workers", shape, opts)
    lines += [
        """MASTER_IP="$(getent hosts "$MASTER_ADDR" | awk '{print $1; exit}')\"""",
        'MASTER_IP="${MASTER_IP:-127.0.0.1}"',
        "export MASTER_ADDR",
        PORT_BASE_LINE,
        "export MASTER_PORT=$PORT_BASE",
        f"HTTP_PORT=$(( {HTTP_PORT_BASE} + SLURM_JOB_ID % 20000 ))",
        f"PLAN={q(str(plan_path))}",
        'rm -f "$PLAN"',
        f'log() {{ echo "{MARKER} $*"; }}',
        f"mkdir -p {q(str(out_dir))}",
        'log "serve: front end on $MASTER_ADDR port $HTTP_PORT (workers connect to $MASTER_IP)"',
        serve + " &",
        "SERVER=$!",
        "trap 'kill -TERM $SERVER 2>/dev/null' TERM INT",
        'for _ in $(seq 1200); do [ -f "$PLAN" ] && break; kill -0 "$SERVER" 2>/dev/null || break; sleep 0.5; done',
        '[ -f "$PLAN" ] || { log "serve: the front end wrote no plan"; wait "$SERVER"; exit 1; }',
        *_srun_workers(world, shape, '"$PLAN"', out_dir, background=True),
        "WORKERS=$!",
        # The workers' step ending tells the front end at once (SIGUSR1: `WORKERS_ENDED_SIGNAL`): srun may stop
        # it before a worker's last word leaves, and the front end would otherwise learn it from --timeout's silence.
        '( while kill -0 "$WORKERS" 2>/dev/null; do sleep 0.5; done; kill -USR1 "$SERVER" 2>/dev/null ) &',
        'code=0; wait "$SERVER" || code=$?',
        'wait "$WORKERS" || true',
        'log "serve: the server exited with $code"',
        'exit "$code"',
        "",
    ]
    return "\n".join(lines)


def run_serve(args: argparse.Namespace) -> int:
    """The harness's serve task: the online server as one Slurm job (`--dryrun` prints the script)."""
    from mbridge_epoverlap.harness.executors.slurm import job_status, require_tool
    from mbridge_epoverlap.harness.flags import given
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    if (args.executor or "slurm") != "slurm":
        raise UsageError("--task serve runs the server as a Slurm job; on this machine run "
                         "`mbridge-epoverlap serve -mr RECIPE --http HOST:PORT` instead")
    if args.gpu not in (None, "cpu"):
        raise UsageError(f"--task serve runs the CPU serving engine; drop -g {args.gpu} (or use -g cpu)")
    world, attn, shape = _serving_layout(args)
    recipe = args.model_recipe_name or DEFAULT_RECIPE
    load_spec(recipe)  # a bad recipe is a usage error here, not in the job
    batch = args.global_batch_size if given(args, "global_batch_size") else 64
    results_path = Path(args.results_json or Path("results") / f"{recipe}_serve_ng{world}.json").resolve()
    job_dir = results_path.with_suffix(".slurm")
    job_dir.mkdir(parents=True, exist_ok=True)
    if not args.dryrun:
        require_tool("sbatch")
    opts = ScriptOptions(job_dir=job_dir, repo_root=Path(__file__).resolve().parents[3], python=sys.executable,
                         time_limit=args.time_limit, account=args.account, partition=args.partition)
    plan_path = job_dir / "plan.json"
    text = render_online_script(plan_path, world, shape, opts, recipe=recipe, attn_workers=attn,
                                micro_batches=args.micro_batches, max_batch=batch,
                                backend="m2n" if shape.nodes == 1 else "torch")
    submitted = _submit(text, job_dir, plan_path, opts, shape, dryrun=args.dryrun)
    if submitted is None:
        return EXIT_OK
    slurm, job_id = submitted
    log = job_dir / f"slurm-{job_id}.out"
    print(f"[slurm] submitted job {job_id}; log {log}", file=sys.stderr, flush=True)
    url = _wait_ready(job_id, log, job_status, limit_s=600.0)
    if url is None:
        raise RunFailedError(f"job {job_id} ended before the server was ready; see {log}")
    port = url.rsplit(":", 1)[1]
    print(f"serving: job {job_id}, http://<first node>:{port} (from the log: {url}); scancel {job_id} stops it")
    return EXIT_OK


def _wait_ready(job_id: str, log: Path, status: Any, *, limit_s: float) -> str | None:
    """The server's URL once its ready line is in the job's log; None if the job ended (or `limit_s` passed)."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if log.is_file():
            for line in log.read_text(errors="replace").splitlines():
                if READY_LINE in line:
                    return "http://" + line.split(READY_LINE, 1)[1].split()[0]
        state = status(job_id).state
        if state is not None and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return None
        time.sleep(1.0)
    return None


def run_serve_bench(args: argparse.Namespace) -> int:
    """The harness's serve_bench task (local processes or one Slurm job)."""
    from mbridge_epoverlap.harness.executors.slurm import require_tool
    from mbridge_epoverlap.harness.flags import given
    from mbridge_epoverlap.serving.engine.bench import synthetic_requests
    from mbridge_epoverlap.serving.engine.run import make_plan
    from mbridge_epoverlap.serving.model.checkpoint import load_spec

    executor = args.executor or "local"
    if args.gpu not in (None, "cpu"):
        raise UsageError(f"--task serve_bench runs the CPU serving engine; drop -g {args.gpu} (or use -g cpu)")
    world, attn, shape = _serving_layout(args)
    from mbridge_epoverlap.recipes import DEFAULT_RECIPE

    recipe = args.model_recipe_name or DEFAULT_RECIPE
    batch = args.global_batch_size if given(args, "global_batch_size") else 8
    steps = args.max_steps if given(args, "max_steps") else 8
    spec = load_spec(recipe)
    requests = synthetic_requests(batch, spec.vocab_size)
    plan = make_plan(spec, requests, attn_workers=attn, expert_workers=world - attn, micro_batches=args.micro_batches,
                     max_new_tokens=steps, max_batch=batch, backend="m2n" if shape.nodes == 1 else "torch",
                     timeout_s=60.0)
    results_path = Path(args.results_json or Path("results") / f"{recipe}_serve_bench_ng{world}.json").resolve()
    if executor == "local":
        return _local(plan, spec, requests, steps, results_path, dry=args.dryrun)
    if not args.dryrun:
        require_tool("sbatch")
    job_dir = results_path.with_suffix(".slurm")
    job_dir.mkdir(parents=True, exist_ok=True)
    opts = ScriptOptions(job_dir=job_dir, repo_root=Path(__file__).resolve().parents[3], python=sys.executable,
                         time_limit=args.time_limit, account=args.account, partition=args.partition)
    plan_path = job_dir / "plan.json"
    plan_path.write_text(plan.to_json())
    text = render_serve_script(plan_path, world, shape, opts, attn_workers=attn, results=results_path)
    submitted = _submit(text, job_dir, plan_path, opts, shape, dryrun=args.dryrun)
    if submitted is None:
        return EXIT_OK
    slurm, job_id = submitted
    log = job_dir / f"slurm-{job_id}.out"
    print(f"[slurm] submitted job {job_id}; log {log}", file=sys.stderr, flush=True)
    status = slurm.follow(job_id, log)
    if status.state != "COMPLETED" or not results_path.is_file():
        raise RunFailedError(slurm.failure_message(job_id, status, log, results_path))
    return _report(json.loads(results_path.read_text()), results_path)


def _local(plan: Any, spec: Any, requests: Any, steps: int, results_path: Path, *, dry: bool) -> int:
    from mbridge_epoverlap.serving.engine.bench import finish_bench_result
    from mbridge_epoverlap.serving.engine.run import run_engine

    if dry:
        print(plan.to_json())
        return EXIT_OK
    result = run_engine(plan, progress=lambda line: print(line, file=sys.stderr, flush=True))
    finish_bench_result(result, spec, requests=requests, max_new_tokens=steps)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(result, indent=1))
    return _report(result, results_path)


def _report(result: dict[str, Any], path: Path) -> int:
    print(f"serve-bench: {result['tokens_per_s']:.1f} tokens/s, TBT p50 {result['tbt_ms_p50']} ms, matches "
          f"reference {result['matches_reference']}\nresults: {path}")
    return EXIT_OK if result["matches_reference"] else 1


def _serving_layout(args: Any) -> tuple[int, int, Any]:
    """(workers, attention workers, job shape) of a serving task: -ng workers (default 2), the first
    --attn_workers of them attention workers, -gn of them per node."""
    from mbridge_epoverlap.harness.executors.slurm import job_shape
    from mbridge_epoverlap.harness.flags import given

    world = args.num_gpus if given(args, "num_gpus") else 2
    attn = args.attn_workers
    if attn >= world:
        raise UsageError(f"--attn_workers {attn} leaves no expert worker among -ng {world} workers; "
                         f"use --attn_workers at most {world - 1}")
    per_node = args.gpus_per_node if given(args, "gpus_per_node") else world
    return world, attn, job_shape(world, per_node, gpus=False)


def _submit(text: str, job_dir: Path, plan_path: Path, opts: Any, shape: Any, *,
            dryrun: bool) -> tuple[Any, str] | None:
    """Write the job's sbatch script and submit it: (executor, job id). With --dryrun, print the script and
    say where it is instead (None: nothing submitted)."""
    from mbridge_epoverlap.harness.executors.slurm import JobFiles, SlurmExecutor

    script = job_dir / "job.sbatch"
    script.write_text(text)
    if dryrun:
        print(text, end="")
        print(f"dry run: sbatch script written to {script} (not submitted)", file=sys.stderr)
        return None
    slurm = SlurmExecutor(opts, shape, poll_s=2.0, progress=lambda line: print(line, file=sys.stderr, flush=True))
    return slurm, slurm.submit(JobFiles(job_dir, script, plan_path, text))
