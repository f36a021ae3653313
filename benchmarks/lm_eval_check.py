"""lm-evaluation-harness against the project's server: the same multiple-choice scores as lm-eval's own `hf` backend.

Builds a random Mixtral checkpoint with a BPE tokenizer (`serving_online_bench.build_checkpoint`) and a
multiple-choice task from a local JSONL file (questions and choices drawn from the standard library's words; no
download), then scores it twice with `lm_eval.simple_evaluate`: the `hf` backend on the checkpoint, and the
`local-completions` backend (`echo` with `logprobs`, `max_tokens` 1: the prompt's log-probabilities) against
`mbridge-epoverlap serve --http` on the same checkpoint. It prints both accuracies, how many per-choice
log-likelihoods differ by more than `--tolerance`, the largest difference, and the machine; it exits 1 when the
accuracies differ or a log-likelihood is past the tolerance.

Needs the `eval` extra (`pip install -e ".[eval]"`: lm-eval and its dependencies).

    python benchmarks/lm_eval_check.py                 # 64 questions, 4 choices each
    python benchmarks/lm_eval_check.py --quick --json  # 16 questions, a smaller model
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mbridge_epoverlap.serving.engine.bench import machine  # noqa: E402

TASK = "mbe_local_mc"
LAYOUT = ["--attn-workers", "1", "--expert-workers", "1", "--micro-batches", "2"]


def _online_bench() -> Any:
    spec = importlib.util.spec_from_file_location("serving_online_bench", REPO / "benchmarks" /
                                                  "serving_online_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serving_online_bench"] = module
    spec.loader.exec_module(module)
    return module


def write_task(directory: Path, questions: int, seed: int) -> Path:
    """A multiple-choice task over a local JSONL file: `questions` questions of 4 choices, a random answer each."""
    rng = random.Random(seed)
    words = sorted({w for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
                    for w in path.read_text(errors="replace").split() if w.isalpha() and 3 <= len(w) <= 10})
    rows = []
    for _ in range(questions):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        choices = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(4)]
        rows.append({"question": question, "choices": choices, "answer": rng.randrange(4)})
    data = directory / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return directory


def evaluate(model: str, model_args: str, task_dir: Path) -> tuple[float, list[float], float]:
    """(accuracy, each choice's log-likelihood in document order, seconds) of one backend."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                  task_manager=TaskManager(include_path=str(task_dir)), batch_size=8)
    seconds = time.perf_counter() - start
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    loglikelihoods = [float(resp[0][0]) for s in samples for resp in s["resps"]]
    return float(out["results"][TASK]["acc,none"]), loglikelihoods, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest difference of one choice's log-likelihood (summed over its tokens)")
    parser.add_argument("--quick", action="store_true", help="16 questions on a smaller model")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("error: lm-eval is not installed; pip install -e \".[eval]\"", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bench = _online_bench()
    questions = 16 if args.quick else args.questions
    size = dict(hidden=64, layers=2, experts=4, vocab=1024, context=512, text_files=40) if args.quick else \
        dict(hidden=256, layers=4, experts=8, vocab=4096, context=512, text_files=200)
    with tempfile.TemporaryDirectory(prefix="mbe-lm-eval-") as tmp:
        checkpoint = bench.build_checkpoint(Path(tmp) / "model", **size)
        (Path(tmp) / "task").mkdir()
        task_dir = write_task(Path(tmp) / "task", questions, seed=7)
        hf = evaluate("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", task_dir)
        server = bench.ours(checkpoint, LAYOUT)
        try:
            server.wait_ready()
            served = evaluate("local-completions", f"model={bench.NAME},base_url={server.url}/v1/completions,"
                              f"tokenizer={checkpoint},tokenizer_backend=huggingface,num_concurrent=4,"
                              "max_retries=1,tokenized_requests=True", task_dir)
        finally:
            server.stop()
    diffs = [abs(a - b) for a, b in zip(hf[1], served[1], strict=True)]
    doc = {"questions": questions, "choices": len(diffs), "acc_hf": hf[0], "acc_served": served[0],
           "max_loglikelihood_diff": max(diffs), "past_tolerance": sum(d > args.tolerance for d in diffs),
           "tolerance": args.tolerance, "hf_s": round(hf[2], 1), "served_s": round(served[2], 1),
           "machine": machine()}
    ok = doc["acc_hf"] == doc["acc_served"] and not doc["past_tolerance"]
    if args.json:
        print(json.dumps(doc))
    else:
        m = doc["machine"]
        print(f"lm-eval {TASK}: {questions} questions x 4 choices; {m['cpu_model']}, {m['cores']} cores, flags "
              f"{' '.join(m['cpu_flags'])}")
        print(f"  hf backend        acc {doc['acc_hf']:.4f}  ({doc['hf_s']} s)")
        print(f"  local-completions acc {doc['acc_served']:.4f}  ({doc['served_s']} s, against serve --http)")
        print(f"  per-choice log-likelihoods: largest difference {doc['max_loglikelihood_diff']:.2e}, "
              f"{doc['past_tolerance']} of {len(diffs)} past {args.tolerance:g}")
        print("  equal" if ok else "  DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
