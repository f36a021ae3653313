"""The HTTP API fuzzed from its own schema: schemathesis (on Hypothesis) against a running `serve --http`.

Builds a small random Mixtral with a tokenizer and a chat template (`serving_online_bench.build_checkpoint`),
starts `mbridge-epoverlap serve --http` on it and runs schemathesis on the OpenAPI schema the server publishes
(`/openapi.json`): every operation, the coverage phase's boundary and schema-violating values, then the
fuzzing phase's generated and mutated requests (`--max-examples` per operation), with every schemathesis check
but `positive_data_acceptance` (a body the schema allows may still be refused: a prompt whose tokens and
`max_tokens` pass the context, a text that encodes to no token). Then it requires what a fuzzed server must
keep:

- no 5xx and no check failed (schemathesis's exit status);
- every worker process alive, with the pid it had before;
- a well-formed request answered;
- after SIGTERM, exit 0 and no worker process left.

It prints the requests sent per operation and status (from schemathesis's HAR report) and the verdicts, and
exits 1 if one fails. `tests/unit_tests/serving/frontend/test_api_fuzz.py` runs a short seeded run of the
same (`run_fuzzer`).

    python benchmarks/api_fuzz.py                          # seed 0, 200 examples per operation
    python benchmarks/api_fuzz.py --seed 7 --max-examples 1000 --server-flags "--elastic --expert-workers 2"
    python benchmarks/api_fuzz.py --quick --json           # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from serving_online_bench import NAME, build_checkpoint, ours  # noqa: E402

from mbridge_epoverlap.machine import machine  # noqa: E402

# Every schemathesis check but one: a body the schema allows may still be refused (see the module docstring).
EXCLUDED_CHECKS = "positive_data_acceptance"
REQUEST_TIMEOUT_S = 120.0  # one request: a generated max_tokens may run to the end of the context


def run_fuzzer(url: str, *, seed: int, max_examples: int, out_dir: Path, timeout_s: float,
               phases: str = "coverage,fuzzing") -> dict[str, Any]:
    """Run schemathesis on `url`'s schema; its exit status, the requests it sent per operation and status, and
    the end of its report.

    Raises:
        subprocess.TimeoutExpired: it ran past `timeout_s` (it is killed first).
    """
    har = out_dir / "requests.har"
    command = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
               f"{url}/openapi.json", "--seed", str(seed), "--max-examples", str(max_examples), "--phases", phases,
               "--checks", "all", "--exclude-checks", EXCLUDED_CHECKS, "--workers", "1",
               "--request-timeout", str(REQUEST_TIMEOUT_S), "--generation-database", "none",
               "--output-sanitize", "false", "--no-color", "--report", "har", "--report-har-path", str(har)]
    # Its own folder as the working directory: whatever it writes stays there.
    done = subprocess.run(command, cwd=out_dir, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    sent: dict[str, Counter[int]] = {}
    if har.is_file():
        for entry in json.loads(har.read_text())["log"]["entries"]:
            operation = f"{entry['request']['method']} {urlsplit(entry['request']['url']).path}"
            sent.setdefault(operation, Counter())[entry["response"]["status"]] += 1
    return {"exit_code": done.returncode,
            "requests": {op: {str(code): n for code, n in sorted(counts.items())}
                         for op, counts in sorted(sent.items())},
            "total": sum(sum(counts.values()) for counts in sent.values()),
            "server_errors": sum(n for counts in sent.values() for code, n in counts.items() if code >= 500),
            "report": (done.stdout + done.stderr)[-6000:]}


def documented_operations(url: str) -> list[str]:
    """`METHOD /path` of every operation the server's schema documents."""
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as answer:
        paths = json.loads(answer.read())["paths"]
    return sorted(f"{method.upper()} {path}" for path, methods in paths.items() for method in methods)


def workers(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        return json.loads(answer.read())["workers"]


def answers(url: str, model: str) -> bool:
    """Whether a well-formed completion request is answered with a completion."""
    body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return answer.status == 200 and len(json.loads(answer.read())["choices"]) == 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-examples", type=int, default=200, help="fuzzing examples per operation")
    parser.add_argument("--server-flags", default="--max-batch 8", help="flags of `serve --http`")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mbe-api-fuzz",
                        help="where the checkpoint is built (reused)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds the fuzzer may run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 examples per operation")
    parser.add_argument("--json", action="store_true", help="JSON on stdout instead of a table")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_examples = 10
    checkpoint = build_checkpoint(args.workdir / "tiny", hidden=32, layers=2, experts=4, vocab=384, context=256,
                                  text_files=14)
    server = ours(checkpoint, shlex.split(args.server_flags))
    try:
        server.wait_ready()
        before = {w["pid"] for w in workers(server.url)}
        operations = documented_operations(server.url)
        with tempfile.TemporaryDirectory(prefix="mbe-api-fuzz-") as out:
            started = time.monotonic()
            result = run_fuzzer(server.url, seed=args.seed, max_examples=args.max_examples, out_dir=Path(out),
                                timeout_s=args.timeout)
            result["wall_s"] = time.monotonic() - started
        after = workers(server.url)
        verdicts = {
            "no_failure": result["exit_code"] == 0 and result["server_errors"] == 0,
            "every_operation_fuzzed": set(operations) <= set(result["requests"]),
            "no_worker_died": {w["pid"] for w in after if w["alive"]} == before,
            "answers_afterwards": answers(server.url, NAME),
        }
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(120)
        verdicts["drained_exit_0"] = code == 0
        verdicts["no_worker_left"] = not [pid for pid in before if Path(f"/proc/{pid}").exists()]
    finally:
        server.stop()
    doc = {"seed": args.seed, "max_examples": args.max_examples, "server_flags": args.server_flags,
           "machine": machine(), **result, "verdicts": verdicts, "ok": all(verdicts.values())}
    if args.json:
        print(json.dumps(doc))
    else:
        _print(doc)
    return 0 if doc["ok"] else 1


def _print(doc: dict[str, Any]) -> None:
    print(f"schemathesis, seed {doc['seed']}, {doc['max_examples']} examples per operation, server "
          f"`{doc['server_flags']}`: {doc['total']} requests in {doc['wall_s']:.0f} s")
    print("| operation | requests | by status |")
    print("|---|---|---|")
    for operation, counts in doc["requests"].items():
        print(f"| {operation} | {sum(counts.values())} | "
              + ", ".join(f"{code}: {n}" for code, n in counts.items()) + " |")
    for name, ok in doc["verdicts"].items():
        print(f"{name}: {'ok' if ok else 'FAILED'}")
    if not doc["ok"]:
        print(doc["report"])


if __name__ == "__main__":
    sys.exit(main())
