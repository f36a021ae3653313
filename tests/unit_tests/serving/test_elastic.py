"""Elastic EP: decoding goes on through a SIGKILLed expert worker, with transformers' greedy tokens.

Real worker processes on a tiny real checkpoint (the serving fixtures): 1 attention worker and 4 expert
workers holding 4 experts in 8 slots; the first expert worker SIGKILLs itself in the middle of a decode step
(fault injection through the plan), the others re-solve the placement and re-send what it held.
"""

from __future__ import annotations

import json
import os

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.elastic.layout import ElasticLayout, check_elastic
from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
from mbridge_epoverlap.serving.engine.run import EngineFailed, make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.workers.requests import Request
from tests.unit_tests.serving.engine_runs import leftovers as _leftovers
from tests.unit_tests.serving.engine_runs import requests_of as _requests

MAX_NEW = 10


def test_layout_spreads_replicas_and_resolves_over_survivors():
    layout = ElasticLayout.initial(4, 4, 4)
    assert sorted(layout.slots) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(len(layout.experts_of(w)) == 2 for w in range(4))  # no worker holds two copies of one expert
    after, orphans = layout.without({3})
    assert orphans == [] and after.slots[6:] == (-1, -1) and after.alive == {0, 1, 2}
    assert min(after.replica_counts()) >= 1 and after.experts_of(3) == []
    assert after.with_mask(0b0111) == (after, [])  # the same mask again changes nothing


def test_router_follows_eplb_replica_choice():
    import torch

    from mbridge_epoverlap.serving.elastic import eplb

    layout, _ = ElasticLayout.initial(8, 4, 4).without({1})
    router = layout.router()
    ids, positions = torch.randint(0, 8, (64, 2), generator=torch.Generator().manual_seed(0)), torch.arange(64)
    slots = eplb.choose_replicas(ids, positions, router.log2phy, router.logcnt)
    assert torch.equal(router.workers(ids, positions), eplb.slot_gpus(slots, len(layout.slots), 4))
    assert 1 not in router.workers(ids, positions).unique().tolist()  # nothing goes to the dead worker


# the other architectures: two prompts (a one-token and a long one), 6 tokens, still killed mid-decode
@pytest.mark.parametrize(("family", "max_new"), [("mixtral", MAX_NEW)] + [
    (family, 6) for family in ("qwen2_moe", "olmoe", "dbrx", "gpt_oss", "glm4_moe", "deepseek_v3")])
def test_killed_expert_worker_mid_decode_loses_no_request(family, max_new, request, prompts, hf_greedy):
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    prompts = prompts if family == "mixtral" else prompts[1:3]
    spec = load_spec(directory)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=max_new,
                     timeout_s=20)
    plan = make_elastic(plan, redundant=4, kill=1, kill_step=2)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(directory, prompts, max_new)
    assert result["failed_requests"] == []
    elastic = result["elastic"]
    assert elastic["lost_workers"] == [0]
    assert elastic["interruption_s"] is not None and elastic["detected_after_s"] is not None
    kinds = [e["event"] for e in elastic["events"] if e["worker"] == "attention 0"]
    assert kinds[:2] == ["detected", "re-placed"] and "resumed" in kinds
    assert _leftovers(pids) == ([], [])


def test_losing_every_replica_without_a_copy_names_the_experts(tiny_mixtral_dir, prompts):
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=3, micro_batches=1, max_new_tokens=MAX_NEW,
                     timeout_s=20)
    plan = make_elastic(plan, redundant=2, kill=1, kill_step=2, restore=False)
    layout = ElasticLayout(4, 3, plan.slots, frozenset(range(3)))
    orphans = layout.without({0})[1]
    assert orphans  # the killed worker holds the only replica of some experts
    pids: list[int] = []
    import re

    with pytest.raises(EngineFailed, match=re.escape(f"experts {orphans} lost every replica")):
        run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert _leftovers(pids) == ([], [])


@pytest.mark.parametrize(("workers", "redundant", "kill", "message"), [
    (4, 0, 1, "cannot hold the 4 logical experts"),  # the survivors' slots cannot hold every expert
    (2, 2, 2, "leaves no expert worker"),
    (3, 4, 1, "do not divide over --expert-workers 3"),
    (2, 6, 0, "more than the model's 4 experts"),
])
def test_bad_elastic_layouts_fail_before_start(workers, redundant, kill, message):
    with pytest.raises(UsageError, match=message):
        check_elastic(4, workers, redundant, kill)


def test_elastic_needs_a_backend_whose_waits_resume(tiny_mixtral_dir, prompts):
    plan = make_plan(load_spec(tiny_mixtral_dir), _requests(prompts), expert_workers=2, backend="gloo")
    with pytest.raises(UsageError, match="--backend gloo cannot serve --elastic"):
        make_elastic(plan, redundant=2)


def test_elastic_bench_cli_bad_input_exits_2(tiny_mixtral_dir, capsys):
    from mbridge_epoverlap.cli import main

    code = main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "2",
                 "--redundant-experts", "2", "--kill", "2", "--json"])
    assert code == 2
    assert "leaves no expert worker" in capsys.readouterr().err


def test_serve_elastic_cli_json_and_bad_input_exit_2(tiny_mixtral_dir, prompts, hf_greedy, tmp_path, capsys):
    from mbridge_epoverlap.cli import main

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    base = ["serve", "--checkpoint", str(tiny_mixtral_dir), "--prompts", str(path), "--max-new-tokens", "4", "--json"]
    assert main(base + ["--expert-workers", "3", "--elastic", "--redundant-experts", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, 4)
    assert result["elastic"]["lost_workers"] == []
    assert main(base + ["--expert-workers", "3", "--elastic", "--redundant-experts", "1"]) == 2
    assert "do not divide over --expert-workers 3" in capsys.readouterr().err
    assert main(base + ["--redundant-experts", "2"]) == 2
    assert "add --elastic" in capsys.readouterr().err


def test_a_lost_attention_worker_fails_its_requests_clearly():
    import signal
    import threading

    spec = load_spec("mixtral_8x22b")  # a recipe model has no EOS: every sequence runs past the kill
    requests = [Request(f"r{i}", (3 + i, 5, 7)) for i in range(4)]
    plan = make_elastic(make_plan(spec, requests, attn_workers=2, expert_workers=2, max_new_tokens=40,
                                  timeout_s=20), redundant=2)
    pids: list[int] = []
    killed = threading.Event()

    def kill_attention(line: str) -> None:
        if "decode step" in line and not killed.is_set():
            os.kill(pids[1], signal.SIGKILL)  # attention worker 1
            killed.set()

    with pytest.raises(EngineFailed, match=r"attention worker 1 \(rank 1\) was killed by signal 9") as info:
        run_engine(plan, progress=kill_attention, on_start=pids.extend, run_timeout_s=120)
    assert killed.is_set()
    statuses = {c["id"]: c["status"] for c in info.value.result["completions"]}
    assert statuses["r1"] == "failed" and statuses["r3"] == "failed"  # attention worker 1's requests
    assert _leftovers(pids) == ([], [])
