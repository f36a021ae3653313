"""The API fuzzed from its own schema: schemathesis on the server's `/openapi.json`, against a real server.

A seeded, bounded run of `benchmarks/api_fuzz.py`'s fuzzer (its coverage phase's boundary and schema-violating
values, then generated and mutated requests; every check but `positive_data_acceptance`), on a server whose
context is 64 tokens so that no generated request decodes for long. It must find nothing (no 5xx, every
response as documented, every schema-violating body refused), kill no worker, leave the server answering a
well-formed request and logging no traceback, and the drained stop after it exits 0 leaving no process.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.unit_tests.serving.engine_runs import leftovers
from tests.unit_tests.serving.frontend.conftest import MODEL_NAME, REPO

pytest.importorskip("schemathesis")

SEED = 20261202
EXAMPLES = 20  # fuzzing examples per operation, after the coverage phase's ~400 requests
FUZZ_TIMEOUT_S = 600.0  # a bound on a hung run, not a speed limit (it takes well under a minute)


def _fuzzer():
    path = REPO / "benchmarks" / "api_fuzz.py"
    spec = importlib.util.spec_from_file_location("api_fuzz", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["api_fuzz"] = module
    spec.loader.exec_module(module)
    return module


def _get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return answer.status, json.loads(answer.read())


def test_the_api_fuzzed_from_its_schema_finds_nothing_and_kills_nothing(start_server, chat_mixtral_dir,
                                                                       tmp_path: Path):
    fuzz = _fuzzer()
    server = start_server(chat_mixtral_dir, "--max-model-len", "64", "--max-batch", "8", "--timeout", "60")
    pids = {w["pid"] for w in _get(f"{server.url}/health")[1]["workers"]}
    operations = fuzz.documented_operations(server.url)
    assert operations == ["GET /health", "GET /metrics", "GET /v1/models", "POST /v1/chat/completions",
                          "POST /v1/completions"]

    result = fuzz.run_fuzzer(server.url, seed=SEED, max_examples=EXAMPLES, out_dir=tmp_path,
                             timeout_s=FUZZ_TIMEOUT_S)

    assert result["exit_code"] == 0, result["report"]
    assert result["server_errors"] == 0
    sent = result["requests"]
    assert set(operations) <= set(sent)
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):  # both reached the engine and the checks
        assert sent[route].get("200", 0) > 0 and sent[route].get("400", 0) > 0, sent[route]
    code, health = _get(f"{server.url}/health")
    assert code == 200 and health["status"] == "ok"
    assert {w["pid"] for w in health["workers"] if w["alive"]} == pids
    assert fuzz.answers(server.url, MODEL_NAME)
    server.signal(signal.SIGTERM)
    assert server.wait(120) == 0
    assert "Traceback" not in "".join(server.stderr)
    assert leftovers(list(pids)) == ([], [])
