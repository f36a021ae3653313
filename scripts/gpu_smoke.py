"""The reference runtime on a GPU, checked end to end in a few minutes: one command for a borrowed GPU machine.

    python scripts/gpu_smoke.py --out OUT_DIR                # CUDA (the default)
    python scripts/gpu_smoke.py --out /tmp/rehearsal --device cpu --tiny   # the same steps on CPU

Steps, each with a time limit, progress on stderr and a verdict:

1. self-check (`worker --mode check`): plain and combined 1F1B, with and without delayed wgrad, in fp32 and
   bf16, must give bitwise identical losses, gradients and parameters; the staged executor must match
   ordinary autograd; the dispatcher round trip must return every token scaled by its router weights.
2. A/B: `ep_overlap_off`, `ep_overlap_on`, `ep_overlap_on_delay_wgrad` on the CPU-sized recipe; losses
   bitwise identical, step times and `relative` reported.
3. profile: one `ep_overlap_on` run under `torch.profiler` (CUDA activity included), one gzipped chrome
   trace per rank in OUT_DIR/traces, analyzed for communication overlapped with compute.

Ranks that share one GPU use gloo (NCCL refuses two ranks on one device); with a GPU per rank, NCCL and a
communication stream. OUT_DIR/summary.json holds every figure; the exit status is 0 when every step
passed, 1 when one failed, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.config.container import RunConfig  # noqa: E402
from mbridge_epoverlap.config.shrink import CpuShape  # noqa: E402
from mbridge_epoverlap.errors import RunFailedError, UsageError  # noqa: E402
from mbridge_epoverlap.harness.stats import all_finite  # noqa: E402
from mbridge_epoverlap.recipes.cpu_case import cpu_overlap_case  # noqa: E402

CASES = {"ep_overlap_off": (False, False), "ep_overlap_on": (True, False), "ep_overlap_on_delay_wgrad": (True, True)}
# Small enough for the self-check to take seconds, large enough for uneven splits and several experts per rank.
CHECK_SHAPE = CpuShape(num_layers=2, hidden_size=64, num_attention_heads=4, expert_ffn_hidden_size=32, seq_length=32,
                       vocab_size=128, micro_batch_size=1, num_micro_batches=3, max_topk=2,
                       force_balanced_routing=False)
TINY_SHAPE = CpuShape(num_layers=2, hidden_size=32, num_attention_heads=4, expert_ffn_hidden_size=16, seq_length=32,
                      vocab_size=64, micro_batch_size=1, num_micro_batches=4, max_topk=4)


def _log(line: str) -> None:
    print(f"[gpu_smoke] {line}", file=sys.stderr, flush=True)


def make_config(recipe: str, procs: int, overlap: bool, delay: bool, shape: CpuShape, device: str) -> RunConfig:
    cfg = cpu_overlap_case(recipe, procs, overlap=overlap, delay_wgrad=delay, shape=shape)
    cfg.env_vars["MBRIDGE_EPOVERLAP_DEVICE"] = device
    return cfg


def environment(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                            "requested_device": device}
    if torch.cuda.is_available():
        info.update(cuda=torch.version.cuda, gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0),
                    capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return info


def self_check(recipe: str, procs: int, device: str, timeout_s: float) -> dict[str, Any]:
    from mbridge_epoverlap.runtime.check import check_failures
    from mbridge_epoverlap.runtime.launch import launch_ranks

    report = launch_ranks(make_config(recipe, procs, False, False, CHECK_SHAPE, device), mode="check",
                          timeout_s=timeout_s)
    failures = check_failures(report)
    ranks = report["ranks"]
    return {"passed": not failures, "failures": failures,
            "reference_fp32_max_loss_diff": max(r["reference"]["fp32"]["max_loss_diff"] for r in ranks),
            "dispatcher_roundtrip_max_err": max(r["dispatcher"]["roundtrip_max_err"] for r in ranks)}


def ab(recipe: str, procs: int, device: str, shape: CpuShape, steps: int, timeout_s: float) -> dict[str, Any]:
    from mbridge_epoverlap.runtime import run_local

    runs = {}
    for name, (overlap, delay) in CASES.items():
        started = time.monotonic()
        runs[name] = run_local(make_config(recipe, procs, overlap, delay, shape, device), max_steps=steps,
                               timeout_s=timeout_s)
        _log(f"  {name}: {steps} iterations in {time.monotonic() - started:.1f} s")
    window = slice(min(2, steps - 1), steps)  # leave out the first (warm-up) iterations when there are enough
    means = {name: statistics.fmean(m.step_times_s[window]) for name, m in runs.items()}
    base = next(iter(CASES))
    losses = runs[base].losses
    equal = all(m.losses == losses for m in runs.values())
    cases = {name: {"stable_mean_s": means[name], "relative": means[base] / means[name], "losses": m.losses,
                    "step_times_s": m.step_times_s, "comm_wait_s": _mean(m.comm_step_s, window),
                    "peak_mem_bytes": m.peak_mem_bytes} for name, m in runs.items()}
    finite = all(all_finite(m.losses) for m in runs.values())
    return {"passed": equal and finite, "losses_bitwise_equal": equal, "finite": finite, "cases": cases}


def _mean(series: list[float] | None, window: slice) -> float | None:
    return statistics.fmean(series[window]) if series else None


def profile(recipe: str, procs: int, device: str, shape: CpuShape, out: Path, timeout_s: float) -> dict[str, Any]:
    from mbridge_epoverlap.profiling import analyze_trace
    from mbridge_epoverlap.runtime import run_local

    traces = out / "traces"
    run_local(make_config(recipe, procs, True, False, shape, device), max_steps=3, profile_dir=traces,
              timeout_s=timeout_s)
    # Compressed, a trace is small enough to keep as a test fixture of the profile analyzer.
    for plain in sorted(traces.glob("*.json")):
        with plain.open("rb") as src, gzip.open(plain.with_suffix(".json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
    totals = analyze_trace(str(traces)).totals()
    files = {p.name: p.stat().st_size for p in sorted(traces.glob("*.json.gz"))}
    return {"passed": bool(files) and totals["comm_ns"] > 0, "trace_bytes": files,
            "comm_ms": totals["comm_ns"] / 1e6, "overlap_ms": totals["overlap_ns"] / 1e6,
            "exposed_comm_ms": totals["exposed_comm_ns"] / 1e6, "overlap_pct": totals["overlap_pct"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json and the traces")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--recipe", default="qwen3_30b_a3b")
    parser.add_argument("--procs", type=int, default=2, help="ranks (EP = ranks); they may share one GPU")
    parser.add_argument("--steps", type=int, default=6, help="iterations per A/B case")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a rehearsal on CPU)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds each launched run may take")
    args = parser.parse_args(argv)
    if args.procs < 2 or args.steps < 2 or args.timeout <= 0:
        parser.error("--procs and --steps must be at least 2 and --timeout positive")
    env = environment(args.device)
    if args.device == "cuda" and not env["cuda_available"]:
        print("error: --device cuda but CUDA is not available here (torch "
              f"{env['torch']}); rehearse with --device cpu --tiny", file=sys.stderr)
        return 2
    shape = TINY_SHAPE if args.tiny else CpuShape()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"environment": env, "recipe": args.recipe, "procs": args.procs,
                               "shape": vars(shape) if hasattr(shape, "__dict__") else str(shape)}
    steps = (("self_check", lambda: self_check(args.recipe, args.procs, args.device, args.timeout)),
             ("ab", lambda: ab(args.recipe, args.procs, args.device, shape, args.steps, args.timeout)),
             ("profile", lambda: profile(args.recipe, args.procs, args.device, shape, args.out, args.timeout)))
    _log(f"{env}")
    ok = True
    for name, step in steps:
        started = time.monotonic()
        _log(f"{name} ...")
        try:
            result = step()
        except (RunFailedError, UsageError) as exc:
            result = {"passed": False, "error": str(exc)}
        result["seconds"] = round(time.monotonic() - started, 1)
        summary[name] = result
        ok &= bool(result["passed"])
        _log(f"{name}: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s"
             + (f": {result.get('error') or '; '.join(result.get('failures', []))}" if not result["passed"] else ""))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if "cases" in summary.get("ab", {}):
        print("| case | mean step (iters 3+) | relative | exposed comm / iter |\n|---|---|---|---|")
        for name, case in summary["ab"]["cases"].items():
            wait = case["comm_wait_s"]
            print(f"| {name} | {case['stable_mean_s'] * 1e3:.1f} ms | {case['relative']:.3f}x | "
                  f"{'n/a' if wait is None else f'{wait * 1e3:.1f} ms'} |")
    if "comm_ms" in summary.get("profile", {}):
        p = summary["profile"]
        print(f"profile (ep_overlap_on): comm {p['comm_ms']:.1f} ms, overlapped {p['overlap_ms']:.1f} ms "
              f"({p['overlap_pct'] or 0:.1f} %), traces {p['trace_bytes']}")
    print(f"{'all steps passed' if ok else 'FAILED'}; summary: {args.out / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
