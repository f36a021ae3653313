"""Elastic EP's rarer paths with real worker processes on the tiny checkpoint: a replacement that never becomes
ready (the survivors go on without it after the wait, and say so); two expert workers lost together inside one
layout epoch switch."""

from __future__ import annotations

import sys

import pytest

from mbridge_epoverlap.serving.engine.elastic_plan import make_elastic
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from tests.unit_tests.serving.engine_runs import leftovers as _leftovers
from tests.unit_tests.serving.engine_runs import requests_of as _requests

MAX_NEW = 10

# A replacement that starts but never says it is ready; it leaves once the run's store is gone.
NEVER_READY = (
    "import os, socket, time\n"
    "while True:\n"
    "    try:\n"
    "        socket.create_connection((os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT'])), 1).close()\n"
    "    except OSError:\n"
    "        break\n"
    "    time.sleep(0.2)\n"
)


@pytest.mark.parametrize("hold", [False, True], ids=["decoding-goes-on", "held"])
def test_survivors_go_on_without_a_replacement_that_never_becomes_ready(tiny_mixtral_dir, prompts, hf_greedy,
                                                                         monkeypatch, hold):
    import mbridge_epoverlap.launch as launch

    real = launch.launch_processes

    def with_a_stuck_replacement(world, command_for, **kwargs):
        kwargs["respawn"] = lambda rank, generation: [sys.executable, "-c", NEVER_READY] if generation == 1 else None
        return real(world, command_for, **kwargs)

    monkeypatch.setattr(launch, "launch_processes", with_a_stuck_replacement)
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=MAX_NEW,
                     timeout_s=6)
    plan = make_elastic(plan, redundant=4, kill=1, kill_step=2, rejoin_after_steps=2, rejoin_hold=hold)
    lines: list[str] = []
    pids: list[int] = []
    result = run_engine(plan, progress=lines.append, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    assert result["failed_requests"] == []
    elastic = result["elastic"]
    assert elastic["lost_workers"] == [0] and not elastic.get("rejoined_workers")
    timeouts = [e for e in elastic["events"] if e["event"] == "rejoin-timeout"]
    assert [e["worker"] for e in timeouts] == ["attention 0"]  # the worker that waited (the merged events say who)
    assert any("no replacement for expert worker 0" in line and "goes on without it" in line for line in lines)
    # Held, the boundary waited half the timeout for it; else decoding went on and the short run ended first.
    if hold:
        assert timeouts[0]["waited_s"] >= plan.timeout_s / 2 and "within 3 s (half of --timeout)" in "".join(lines)
    else:
        assert timeouts[0]["waited_s"] < plan.timeout_s / 2 and "by the end of the run" in "".join(lines)
    assert _leftovers(pids) == ([], [])


def test_two_failures_inside_one_epoch_switch(tiny_mixtral_dir, prompts, hf_greedy):
    # The rebalance of decode step 6 is announced in step 6 (weights move during it, some from the two workers that
    # die) and entered at step 7; expert workers 0 and 1 die together in step 6's last layer. The decode steps
    # stream, so that layer's combines are awaited after the step-7 boundary: the new epoch, announced with them
    # alive, is entered and they are dropped from it as soon as the loss shows.
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=MAX_NEW,
                     timeout_s=20)
    plan = make_elastic(plan, redundant=4, kill=2, kill_step=6, rebalance_every=3, rebalance_threshold=1.0)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    assert result["failed_requests"] == []
    elastic = result["elastic"]
    assert elastic["lost_workers"] == [0, 1]
    events = [e for e in elastic["events"] if e["worker"] == "attention 0"]
    switch = next(i for i, e in enumerate(events) if e["event"] == "rebalanced" and e["announced_at"] == 6)
    assert [e["workers"] for e in events[:switch] if e["event"] == "detected"] == []
    assert [e["workers"] for e in events[switch:] if e["event"] == "detected"][0] == [0, 1]  # both at once
    assert events[switch]["step"] == 7
    assert _leftovers(pids) == ([], [])
