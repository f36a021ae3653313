"""The serving engine on real worker processes: tokens equal transformers' greedy output in every mode.

Tiny real checkpoints come from the serving fixtures (built with `transformers`). Each engine run
starts real processes (attention and expert workers talking over the M2N communicator, or colocated
workers with the gloo all-to-all), so the runs are few and tiny.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from mbridge_epoverlap.serving.engine.run import EngineFailed, make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.workers.requests import Request
from tests.unit_tests.serving.engine_runs import leftovers

MAX_NEW = 6
RECIPE = "qwen3_30b_a3b"

# (checkpoint fixture, layout) pairs: every mode on Mixtral, the other modes on Qwen3-MoE (with its dense layer).
MODES = [
    ("tiny_mixtral_dir", dict(micro_batches=1)),
    ("tiny_mixtral_dir", dict(micro_batches=2, max_batch=1)),  # continuous batching: requests wait and join
    ("tiny_mixtral_dir", dict(micro_batches=3)),
    ("tiny_mixtral_dir", dict(colocated=1)),  # the single-process engine
    ("tiny_mixtral_dir", dict(colocated=1, threads=2)),  # ... on two cores: the tiled expert GEMMs split
    ("tiny_mixtral_dir", dict(colocated=2, order="two_batch_overlap")),
    ("tiny_qwen3_moe_dir", dict(micro_batches=2, expert_workers=2, attn_workers=2)),
    ("tiny_qwen3_moe_dir", dict(colocated=2, order="sequential", micro_batches=1)),
    ("tiny_qwen3_moe_dir", dict(colocated=2, order="sequential", micro_batches=1, replicated_experts=True)),
]
# Every layout on the other architectures (m=2 disaggregated is `test_architectures.py`'s), on two prompts.
OTHER_FAMILIES = ("qwen2_moe", "olmoe", "dbrx", "gpt_oss", "glm4_moe", "deepseek_v3")
MODES += [(f"tiny_{family}_dir", layout) for family in OTHER_FAMILIES for layout in (
    dict(micro_batches=1), dict(micro_batches=3), dict(colocated=2), dict(colocated=2, replicated_experts=True))]
# DeepSeek-V3 with its queries projected directly (no q_lora_rank): the disaggregated and the colocated engine.
MODES += [("tiny_deepseek_v3_direct_q_dir", dict(micro_batches=2, expert_workers=2)),
          ("tiny_deepseek_v3_direct_q_dir", dict(colocated=2))]
FEW_PROMPTS = (*(f"tiny_{family}_dir" for family in OTHER_FAMILIES), "tiny_deepseek_v3_direct_q_dir")


def _requests(prompts):
    return [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]


def _ids(mode):
    checkpoint, layout = mode
    return checkpoint.removeprefix("tiny_").removesuffix("_dir") + "-" + "-".join(f"{k}{v}" for k, v in layout.items())


@pytest.mark.parametrize("mode", MODES, ids=_ids)
def test_engine_tokens_equal_transformers_greedy(request, mode, prompts, hf_greedy):
    fixture, layout = mode
    directory = request.getfixturevalue(fixture)
    spec = load_spec(directory)
    prompts = prompts[1:3] if fixture in FEW_PROMPTS else prompts  # a one-token and a long prompt
    requests = _requests(prompts)
    result = run_engine(make_plan(spec, requests, max_new_tokens=MAX_NEW, timeout_s=20, **layout))
    expected = hf_greedy(directory, prompts, MAX_NEW)
    assert [c["output_ids"] for c in result["completions"]] == expected
    assert all(c["status"] == "ok" for c in result["completions"])
    assert result["generated_tokens"] == sum(len(e) for e in expected)
    assert result["predicted"]["tokens_per_s"] > 0 and result["stage_ms"]["experts"] > 0
    if layout.get("threads") == 2:  # its decode steps ran the tiled expert GEMMs on both threads
        assert "tiled expert GEMMs" in result["worker_cores"][0]
    for c in result["completions"]:
        assert c["ttft_ms"] > 0 and len(c["tbt_ms"]) == len(c["output_ids"]) - 1
    if layout.get("max_batch") == 1:
        # One sequence at a time: each request waited for the one before it, and the steps add up.
        ttft = [c["ttft_ms"] for c in result["completions"]]
        assert ttft == sorted(ttft) and ttft[-1] > ttft[0]
        assert result["decode_steps"] >= sum(len(e) for e in expected)


def test_a_killed_expert_worker_stops_the_run_naming_it(prompts):
    spec = load_spec(RECIPE)  # a recipe model has no EOS: every sequence runs to the limit, past the kill
    assert not spec.eos_token_ids
    plan = make_plan(spec, _requests(prompts), max_new_tokens=200, timeout_s=5, micro_batches=2)
    pids: list[int] = []
    killed = threading.Event()

    def kill_expert(line: str) -> None:
        if "decode step" in line and not killed.is_set():
            os.kill(pids[plan.attn_workers], signal.SIGKILL)  # the first expert worker
            killed.set()

    # The message opens with the kill: had the run ended at its time limit, it would open with "run timed out".
    with pytest.raises(EngineFailed, match=r"^expert worker 0 \(rank 1\) was killed by signal 9") as failure:
        run_engine(plan, progress=kill_expert, on_start=pids.extend, run_timeout_s=120)
    assert killed.is_set()
    message = str(failure.value)
    assert "expert worker 0 (rank 1) was killed by signal 9" in message
    completions = failure.value.result["completions"]
    assert len(completions) == len(prompts)
    assert any(c["status"] == "failed" for c in completions)
    # Every worker gone and nothing of theirs left (only this run's: other tests may run beside this one).
    assert leftovers(pids) == ([], [])


def test_serve_cli_json_and_bad_input_exit_2(tiny_mixtral_dir, tmp_path, capsys):
    from mbridge_epoverlap.cli import main

    good = tmp_path / "prompts.jsonl"
    good.write_text(json.dumps({"id": "x", "prompt_ids": [5, 17, 42]}) + "\n")
    base = ["serve", "--checkpoint", str(tiny_mixtral_dir), "--json"]
    assert main(base + ["--prompts", str(good), "--max-new-tokens", "2", "--colocated", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completions"][0]["id"] == "x" and len(out["completions"][0]["output_ids"]) <= 2
    assert {"tokens_per_s", "machine", "predicted"} <= set(out)
    assert main(["serve", "--checkpoint", str(tmp_path), "--prompts", str(good)]) == 2
    assert "config.json" in capsys.readouterr().err


# What each prompts file holds (None: the file does not exist), extra flags, what the error must say.
BAD_SERVE_INPUT = {
    "missing": (None, [], "missing.jsonl"),
    "bad_json": ('{"id": 1, "prompt_ids": [1]}\nnot json\n', [], "line 2"),
    "out_of_vocab": (json.dumps({"id": "v", "prompt_ids": [1, 100000]}) + "\n", [], "outside the vocabulary"),
    "too_many_experts": (json.dumps({"id": "x", "prompt_ids": [5, 17, 42]}) + "\n", ["--expert-workers", "9"],
                         "--expert-workers 9"),
}


@pytest.mark.parametrize("case", list(BAD_SERVE_INPUT))
def test_serve_cli_bad_input_exits_2_naming_it(tiny_mixtral_dir, tmp_path, capsys, case):
    from mbridge_epoverlap.cli import main

    text, extra, needle = BAD_SERVE_INPUT[case]
    prompts = tmp_path / f"{case}.jsonl"
    if text is not None:
        prompts.write_text(text)
    assert main(["serve", "--checkpoint", str(tiny_mixtral_dir), "--json", "--prompts", str(prompts), *extra]) == 2
    assert needle in capsys.readouterr().err


def test_serve_bench_reports_and_matches_reference(tiny_qwen3_moe_dir, capsys):
    from mbridge_epoverlap.cli import main

    code = main(["serve-bench", "--checkpoint", str(tiny_qwen3_moe_dir), "--batch", "4", "--steps", "3",
                 "--micro-batches", "2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["matches_reference"] is True
    assert out["batch"] == 4 and out["generated_tokens"] > 0
    assert set(out["utilization"]) == {"attention", "expert"}
    assert set(out["predicted"]["utilization"]) == {"attention", "expert"}
    assert out["tbt_ms_p50"] is not None and out["machine"]["cpu"]


def test_serve_bench_decodes_the_same_default_batch_for_every_micro_batch_count(tiny_mixtral_dir, capsys):
    """Without --batch: 64 sequences per attention worker for m = 1 and m = 2 alike (no probes, nothing that moves
    from run to run), said in the result and the table; --batch balanced still sizes it from probes; a wrong
    --batch exits 2 naming both forms."""
    from mbridge_epoverlap.cli import main

    base = ["serve-bench", "--checkpoint", str(tiny_mixtral_dir), "--steps", "2", "--attn-workers", "1",
            "--expert-workers", "1"]
    for m in ("1", "2"):
        assert main([*base, "--micro-batches", m, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["batch"], out["balance_probes"], out["matches_reference"]) == (64, [], True)
        assert "default" in out["batch_source"]
    assert main([*base, "--micro-batches", "2"]) == 0
    assert "64 (the default, 64 per attention worker)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--batch", "many"])
    assert exit_info.value.code == 2 and "'balanced'" in capsys.readouterr().err


def test_balanced_sizing_picks_the_largest_expected_gain(tiny_mixtral_dir):
    from mbridge_epoverlap.serving.engine.bench import balanced_micro_batch

    spec = load_spec(tiny_mixtral_dir)
    best, probes = balanced_micro_batch(spec, attn_workers=1, expert_workers=1, candidates=(1, 4))
    assert [p["micro_batch"] for p in probes] == [1, 4]
    ratio = {p["micro_batch"]: abs(p["attn_ms"] / p["experts_ms"] - 1) for p in probes}
    assert best == min(ratio, key=ratio.get)  # no doubled size probed: the closest times decide
    assert all(p["attn_ms"] > 0 and p["experts_ms"] > 0 for p in probes)
    best, probes = balanced_micro_batch(spec, attn_workers=1, expert_workers=1, candidates=(1, 2, 4))
    gains = {p["micro_batch"]: p["expected_gain"] for p in probes if "expected_gain" in p}
    assert set(gains) == {1, 2} and best == max(gains, key=gains.get)
    by_size = {p["micro_batch"]: p for p in probes}
    assert gains[1] == pytest.approx((by_size[2]["attn_ms"] + by_size[2]["experts_ms"])
                                     / (2 * max(by_size[1]["attn_ms"], by_size[1]["experts_ms"])))
