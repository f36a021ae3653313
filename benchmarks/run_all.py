"""Run every benchmark with its short profile (`--quick`) and print one summary table.

Each benchmark runs as its own process (so one that fails or hangs does not take the others down),
with `--quick --json`; the table shows its exit status, wall time and headline figures, and the
full JSON of every benchmark goes to `--out` when given. Figures from `--quick` are a smoke check of
the benchmarks and a rough reading; measure with the full profiles (each script's own command line,
or `--full` here) before quoting numbers.

    python benchmarks/run_all.py                   # every benchmark, short profile (`make bench`)
    python benchmarks/run_all.py --only eplb planner
    python benchmarks/run_all.py --full --out bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.machine import cpu_flags, cpu_model  # noqa: E402


def _eplb(doc: dict[str, Any]) -> str:
    row = doc["rows"][-1]
    b = row["balance"]
    return (f"{row['experts']} experts on {row['gpus']} GPUs, max/mean load: none {b['none']:.2f}, greedy "
            f"{b['greedy']:.2f}, EPLB {b['eplb-global']:.2f} (hier. {b['eplb-hier']:.2f}); "
            f"solve {row['solve_ms']['eplb-global']:.0f} ms")


def _planner(doc: dict[str, Any]) -> str:
    one, every = doc["one_plan_s"], doc["all_pairs_all_models_s"]
    return (f"one plan {one['median']:.2f} s (budget {one['budget']:g} s); all pairs {every['median']:.2f} s "
            f"(budget {every['budget']:g} s)")


def _profile(doc: dict[str, Any]) -> str:
    s, k = doc["sqlite"], doc["kineto"]
    return (f"{doc['kernels']:,} kernels: analyzer CLI (start-up included)/straightforward {s['ratio']:.2f} "
            "(target <= 0.5 at 463k kernels), "
            f"same figures {s['same_figures']}; kineto {k['analyzer_cli_s']:.2f} s, "
            f"same as SQLite {k['same_figures_as_sqlite']}")


def _runtime(doc: dict[str, Any]) -> str:
    cases = doc["cases"]
    on = cases.get("ep_overlap_on") or next(iter(cases.values()))
    return (f"overlap on/off speedup {on['speedup']:.3f}x ({doc['link']}); losses bitwise equal "
            f"{doc['losses_equal']}, finite {doc['finite']}")


def _gloo(doc: dict[str, Any]) -> str:
    return (f"one all-to-all of {doc['bytes'] / 2**20:.2f} MiB: wall {doc['wall_ms']:.2f} ms, CPU "
            f"{100 * doc['cpu_share']:.0f} % of it")


def _elastic(doc: dict[str, Any]) -> str:
    return (f"interruption {doc['interruption_s']:.3f} s, tokens/s after/before {doc['after_over_before']:.2f} "
            f"(survivors {doc['survivors_share']:.2f}), elastic/plain {doc['elastic_over_plain']:.3f}, "
            f"match {doc['outputs_match_reference']}")


def _serving_online(doc: dict[str, Any]) -> str:
    cells = []
    for server, cases in doc["servers"].items():
        burst = cases["burst"]
        cells.append(f"{server} {burst['output_tokens_per_s']:,.1f} output tokens/s, P99 TPOT "
                     f"{burst['p99_tpot_ms']:.1f} ms, {burst['failed']} failed")
    return f"{doc['prompts']} requests at once ({doc['client']} client): " + "; ".join(cells)


def _api_fuzz(doc: dict[str, Any]) -> str:
    failed = [name for name, ok in doc["verdicts"].items() if not ok]
    return (f"{doc['total']} schema-generated requests over {len(doc['requests'])} method/path pairs, "
            f"{doc['server_errors']} answered 5xx; " + (f"FAILED: {', '.join(failed)}" if failed else
                                                          "no worker died, answers afterwards, drained exit 0"))


def _m2n(doc: dict[str, Any]) -> str:
    b = doc["backends"]
    cells = [f"{name} {v['median_vs_gloo']:.2f}x / {v['p99_vs_gloo']:.2f}x" for name, v in b.items() if name != "gloo"]
    return (f"{doc['senders']}x{doc['receivers']} at {doc['size_bytes'] // 1024} KiB, median / P99 vs gloo: "
            + ", ".join(cells))


def _peers(doc: dict[str, Any]) -> str:
    cells = []
    for name, model in doc["models"].items():
        engines, ratios = model["engines"], model["ratios"]
        default = engines["engine_default"]
        vllm = f", vs vLLM {ratios['default_over_vllm']:.2f}x" if "default_over_vllm" in ratios else ""
        cells.append(f"{name}: default {default['tokens_per_s']:.0f} tok/s, vs transformers "
                     f"{ratios['default_over_transformers']:.2f}x{vllm}, equal "
                     f"{default['sequences_equal_transformers']}/{default['sequences']}")
    return "; ".join(cells)


def _serving(doc: dict[str, Any]) -> str:
    r = doc["ratios"]
    match = all(case.get("matches_reference", True) for case in doc["cases"].values())
    return (f"ping-pong m=2/m=1 {r['m2_over_m1']:.2f}x, m=3/m=2 {r['m3_over_m2']:.2f}x, disaggregated/colocated "
            f"{r['disaggregated_m2_over_colocated']:.2f}x; matches reference {match}")


def _bridge_fuzz(doc: dict[str, Any]) -> str:
    text = "; ".join(f"Megatron-Bridge {name}: {t['tried']} configs, {t['rejected_by_bridge']} rejected, missed "
                     f"{t['missed']} / false {t['false']}" for name, t in doc["releases"].items())
    for name, tallies in (doc.get("families") or {}).items():
        text += (f"; {name}, {len(tallies)} families' recipes: missed {sum(t['missed'] for t in tallies.values())}"
                 f" / false {sum(t['false'] for t in tallies.values())}")
    return text


def _fuzz(doc: dict[str, Any]) -> str:
    return ", ".join(f"{release}: missed {t['missed']} / false {t['false']}" for release, t in doc["releases"].items())


def _fp8_tiles(doc: dict[str, Any]) -> str:
    rows = ", ".join(f"{r['threads']}t {r['rows_per_expert']}r {r['speedup']:.2f}x" for r in doc["rows"])
    share = doc["bytes"]["fp8_tiles"] / doc["bytes"]["fp32_tiles"]
    return (f"FP8/fp32 tile bytes {share:.2f}; expert stage speed-up {rows}; bitwise "
            f"{all(r['bitwise_equal'] for r in doc['rows'])}")


def _fp8_decode_step(doc: dict[str, Any]) -> str:
    fp8 = doc["weights"]["fp8"]
    return (f"decode step FP8 {doc['step_ms']['fp8']:.1f} ms vs fp32 {doc['step_ms']['fp32']:.1f} ms "
            f"({doc['speedup']:.2f}x), FP8 tiles {fp8['fp8'] / 2**20:,.0f} MiB beside {fp8['fp32'] / 2**20:,.0f} MiB "
            f"fp32; tokens equal {doc['tokens_equal']}")


def _lm_eval(doc: dict[str, Any]) -> str:
    return (f"lm-eval {doc['questions']} questions: acc hf {doc['acc_hf']:.4f}, served {doc['acc_served']:.4f}; "
            f"log-likelihoods within {doc['max_loglikelihood_diff']:.1e} ({doc['past_tolerance']} past "
            f"{doc['tolerance']:g})")


def _sparse_attention(doc: dict[str, Any]) -> str:
    ms = doc["ms_per_step"]
    return (f"decode attention at {doc['context'] / doc['index_topk']:.0f}x index_topk: sparse {ms['sparse']:.1f} "
            f"ms vs dense {ms['dense']:.1f} ms per step ({doc['dense_over_sparse']:.2f}x)")


def _paper_ablations(doc: dict[str, Any]) -> str:
    findings = doc["findings"]
    return (f"{sum(f['within'] for f in findings)} of {len(findings)} planner figures within 25 % of the paper's; "
            f"explained: {', '.join(sorted({f['experiment'] for f in findings if f['explanation']})) or 'none'}")


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    json_to_file: bool  # writes its JSON to a path (`--json PATH`) instead of stdout (`--json`)
    headline: Callable[[dict[str, Any]], str]
    # An environment variable naming a path the benchmark needs (passed as `path_flag`); skipped when unset.
    needs_path: tuple[str, str] | None = None


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("eplb", "eplb_bench.py", False, _eplb),
    Benchmark("planner", "planner_bench.py", False, _planner),
    Benchmark("paper_ablations", "paper_ablations.py", False, _paper_ablations),
    Benchmark("profile_analyzer", "profile_analyzer_bench.py", False, _profile),
    Benchmark("gloo_alltoall_cost", "gloo_alltoall_cost.py", False, _gloo),
    Benchmark("runtime_overlap", "runtime_overlap_bench.py", True, _runtime),
    Benchmark("elastic", "elastic_bench.py", False, _elastic),
    Benchmark("serving_online", "serving_online_bench.py", False, _serving_online),
    Benchmark("api_fuzz", "api_fuzz.py", False, _api_fuzz),
    Benchmark("m2n", "m2n_bench.py", False, _m2n),
    Benchmark("fp8_tiles", "fp8_tiles.py", False, _fp8_tiles),
    Benchmark("fp8_decode_step", "fp8_decode_step.py", False, _fp8_decode_step),
    Benchmark("serving", "serving_bench.py", True, _serving),
    Benchmark("serving_peers", "serving_peers_bench.py", True, _peers),
    Benchmark("sparse_attention", "sparse_attention_bench.py", True, _sparse_attention),
    Benchmark("lm_eval", "lm_eval_check.py", False, _lm_eval),
    Benchmark("mcore_release_fuzz", "mcore_release_fuzz.py", False, _fuzz,
              needs_path=("MEGATRON_LM", "--megatron-lm")),
    Benchmark("bridge_fuzz", "bridge_fuzz.py", False, _bridge_fuzz,
              needs_path=("MBRIDGE_EPOVERLAP_BRIDGE_PYTHON", "--python")),
)


def _json_document(text: str) -> Any:
    """The benchmark's JSON: its whole output, or (after a printed table) its last line; None if neither."""
    for candidate in (text, text.strip().rsplit("\n", 1)[-1]):
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def run(bench: Benchmark, quick: bool, timeout_s: float) -> dict[str, Any]:
    """Run one benchmark; returns {"rc", "wall_s", "result" (its JSON or None), "error" (text or None)}."""
    with tempfile.TemporaryDirectory(prefix="mbe-bench-") as tmp:
        out_file = Path(tmp) / "result.json"
        argv = [sys.executable, str(HERE / bench.script), *(["--quick"] if quick else [])]
        argv += ["--json", str(out_file)] if bench.json_to_file else ["--json"]
        if bench.needs_path is not None:
            argv += [bench.needs_path[1], os.environ[bench.needs_path[0]]]
        start = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout_s,
                                  env=dict(os.environ, PYTHONPATH=str(REPO)))
        except subprocess.TimeoutExpired:
            return {"rc": None, "wall_s": timeout_s, "result": None, "error": f"timed out after {timeout_s:g} s"}
        wall = time.perf_counter() - start
        text = out_file.read_text() if bench.json_to_file and out_file.is_file() else proc.stdout
    result = _json_document(text)
    error = None
    if result is None:  # a benchmark that ran to the end prints its JSON even when its own check fails
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        error = " | ".join(tail) or f"exit status {proc.returncode}, no JSON"
    return {"rc": proc.returncode, "wall_s": wall, "result": result, "error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHMARKS], help="run just these")
    parser.add_argument("--full", action="store_true", help="each benchmark's full profile (minutes each)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark (default 900)")
    parser.add_argument("--out", type=Path, default=None, help="write every benchmark's JSON here")
    args = parser.parse_args(argv)
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    bf16 = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    print(f"machine: {cpu_model(platform.machine())}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"bf16 flags: {', '.join(bf16) or 'none'}; profile: {'full' if args.full else 'quick'}", flush=True)
    outcomes: dict[str, dict[str, Any]] = {}
    skipped = {b.name: f"skipped: set {b.needs_path[0]} to its path" for b in chosen
               if b.needs_path is not None and not os.environ.get(b.needs_path[0])}
    for bench in chosen:
        if bench.name in skipped:
            continue
        print(f"  running {bench.script} ...", flush=True)
        outcomes[bench.name] = run(bench, quick=not args.full, timeout_s=args.timeout)
    print()
    print("| benchmark | status | wall (s) | headline |")
    print("|---|---|---|---|")
    for bench in chosen:
        if bench.name in skipped:
            print(f"| {bench.name} | skipped | - | {skipped[bench.name]} |")
            continue
        o = outcomes[bench.name]
        if o["error"] is None:
            try:
                headline = bench.headline(o["result"])
            except (KeyError, TypeError, ValueError, StopIteration) as exc:
                headline = f"result without the expected fields ({type(exc).__name__}: {exc})"
        else:
            headline = o["error"]
        if o["error"] is not None:
            status = f"FAILED (exit {o['rc']})"
        else:  # it ran; a non-zero exit is its own verdict (a budget or property it checks)
            status = "ok" if o["rc"] == 0 else f"check failed (exit {o['rc']})"
        print(f"| {bench.name} | {status} | {o['wall_s']:.1f} | {headline} |")
    if args.out:
        args.out.write_text(json.dumps({name: o["result"] for name, o in outcomes.items()}, indent=1) + "\n")
    failed = [name for name, o in outcomes.items() if o["rc"] != 0 or o["error"] is not None]
    if failed:
        print(f"\nnot ok: {', '.join(failed)} (timings on a busy machine miss budgets; rerun on a quiet one)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
