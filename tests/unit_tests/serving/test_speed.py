"""Serving speed settings: torch threads per worker process are part of the layout."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.serving.engine.plan import EnginePlan, default_threads
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from mbridge_epoverlap.serving.workers.requests import Request


def test_default_threads_share_the_cores_evenly_and_give_each_process_one_at_least():
    assert default_threads(1, cores=2) == 2
    assert default_threads(2, cores=2) == 1
    assert default_threads(3, cores=2) == 1
    assert default_threads(2, cores=16) == 8


def test_plan_threads_default_from_the_process_count_and_a_flag_forces_them(tiny_mixtral_dir, prompts):
    spec = load_spec(tiny_mixtral_dir)
    requests = [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    assert make_plan(spec, requests, colocated=1).threads == default_threads(1)
    assert make_plan(spec, requests, attn_workers=1, expert_workers=1).threads == default_threads(2)
    assert make_plan(spec, requests, colocated=1, threads=3).threads == 3
    with pytest.raises(UsageError, match="--threads -1"):
        make_plan(spec, requests, threads=-1)
    # A plan written before the field existed runs with one thread per process, as then.
    old = EnginePlan.from_json(make_plan(spec, requests, threads=1).to_json().replace('"threads": 1', '"threads": 0'))
    assert old.threads_per_process == 1


def test_workers_run_with_the_plans_threads_and_the_tokens_stay_the_same(tiny_mixtral_dir, prompts, hf_greedy):
    spec = load_spec(tiny_mixtral_dir)
    requests = [Request(f"p{i}", tuple(p)) for i, p in enumerate(prompts)]
    result = run_engine(make_plan(spec, requests, colocated=1, threads=2, max_new_tokens=4, timeout_s=20))
    assert result["worker_threads"] == [2] and result["threads_per_process"] == 2
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, 4)
