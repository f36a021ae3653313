"""`serve` refuses what no worker could run before any starts (exit 2, the reason named)."""

from __future__ import annotations

import json

from tests.unit_tests.cli_runner import run_cli


def _prompts(tmp_path, *prompts):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    return str(path)


def test_an_unknown_backend_is_a_usage_error_naming_the_known_ones(tiny_mixtral_dir, tmp_path):
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", _prompts(tmp_path, [1, 2]),
                   "--backend", "nonsense")
    assert done.returncode == 2, done.stderr
    assert "--backend nonsense" in done.stderr and "shm, mooncake, torch, gloo, m2n" in done.stderr


def test_a_timeout_of_zero_is_refused_before_start(tiny_mixtral_dir, tmp_path):
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", _prompts(tmp_path, [1, 2]),
                   "--timeout", "0")
    assert done.returncode == 2
    assert "--timeout: 0 must be more than 0" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_prompt_past_the_context_names_both_numbers(tiny_mixtral_dir, tmp_path):
    # the tiny Mixtral has 256 positions
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", _prompts(tmp_path, [1] * 60, [2]),
                   "--max-new-tokens", "200")
    assert done.returncode == 2, done.stderr
    assert "60 prompt tokens + --max-new-tokens 200 = 260" in done.stderr and "context of 256 tokens" in done.stderr
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", _prompts(tmp_path, [1] * 60),
                   "--max-new-tokens", "20", "--max-model-len", "64")
    assert done.returncode == 2
    assert "= 80 is more than the model's context of 64 tokens" in done.stderr


def test_http_refuses_a_bad_address_and_colocated_elastic_serving(tiny_mixtral_dir):
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--http", "nowhere")
    assert done.returncode == 2 and "expected HOST:PORT" in done.stderr
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--http", "127.0.0.1:0", "--colocated", "2",
                   "--elastic")
    assert done.returncode == 2 and "drop --colocated" in done.stderr and "--elastic" in done.stderr
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir))
    assert done.returncode == 2 and "--prompts FILE" in done.stderr and "--http HOST:PORT" in done.stderr
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--http", "127.0.0.1:0", "--replicate-experts")
    assert done.returncode == 2 and "--replicate-experts applies to colocated processes" in done.stderr
    done = run_cli("serve", "--checkpoint", str(tiny_mixtral_dir), "--http", "127.0.0.1:0",
                   "--max-prefill-tokens", "0")
    assert done.returncode == 2 and "--max-prefill-tokens" in done.stderr and "Traceback" not in done.stderr
