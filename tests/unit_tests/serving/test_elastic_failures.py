"""Several expert-worker failures: one after another (`elastic-bench --kill-every S`) and the failure table.

Real worker processes on the tiny checkpoint (the serving fixtures) for two failures one after another (nothing
lost, transformers' greedy tokens; on one host over shm, and across two emulated hosts over mooncake) and for
the table's JSON fields; the split of an interruption into phases on
a hand-made event log; and the bad values that exit 2 naming the flag, before any process starts.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from mbridge_epoverlap.comm.m2n import mooncake_available
from mbridge_epoverlap.launch.netns import existing_namespaces
from mbridge_epoverlap.serving.elastic.report import failure_rows, rate_from_step
from mbridge_epoverlap.serving.engine.elastic_plan import kill_schedule, make_elastic
from mbridge_epoverlap.serving.engine.hosts import emulate_hosts
from mbridge_epoverlap.serving.engine.run import make_plan, run_engine
from mbridge_epoverlap.serving.model.checkpoint import load_spec
from tests.unit_tests.requirements import require_or_skip
from tests.unit_tests.serving.engine_runs import leftovers as _leftovers
from tests.unit_tests.serving.engine_runs import requests_of as _requests

MAX_NEW = 10


def test_kill_schedule_spaces_the_victims():
    assert kill_schedule(3, 8) == ((0, 8), (1, 8), (2, 8))
    assert kill_schedule(3, 8, 4) == ((0, 8), (1, 12), (2, 16))


def test_failure_rows_split_each_interruption_into_phases():
    # Two requests decoding a token every 0.1 s; worker 0 dies at 1.05 (step 4), worker 1 at 2.05 (step 8).
    times = [[0.1 * i for i in range(1, 31)], [0.1 * i + 0.01 for i in range(1, 31)]]
    events = [
        {"event": "detected", "t": 1.08, "worker": "attention 0", "workers": [0]},
        {"event": "re-placed", "t": 1.09, "worker": "attention 0"},
        {"event": "re-placed", "t": 1.095, "worker": "expert 2", "load_s": 0.004},
        {"event": "detected", "t": 2.07, "worker": "attention 0", "workers": [1]},
        {"event": "re-placed", "t": 2.075, "worker": "attention 0"},
    ]
    rows = failure_rows([(0, 4), (1, 8)], {0: 1.05, 1: 2.05}, events, times)
    assert [(r["step"], r["workers"], r["failed_workers"]) for r in rows] == [(4, [0], 1), (8, [1], 2)]
    first, second = rows
    assert first["detection_s"] == pytest.approx(0.03) and first["switch_s"] == pytest.approx(0.01)
    assert first["interruption_s"] == pytest.approx(1.11 - 1.05)  # the second request's token after the kill
    assert first["detection_s"] + first["switch_s"] + first["recovery_s"] == pytest.approx(first["interruption_s"])
    assert first["weight_load_s"] == pytest.approx(0.004) and second["weight_load_s"] is None
    assert second["detection_s"] == pytest.approx(0.02)
    assert first["after_over_before"] == pytest.approx(1.0, abs=0.1)  # the same pace before and after
    assert failure_rows([(0, 4)], {}, events, times) == []  # nobody died (the run ended first)


def test_rate_from_step_counts_the_steps_after_it_in_every_request():
    # Two requests, first tokens at 100 and 110 ms, then a token every 10 ms (the second slower after step 2).
    completions = [{"ttft_ms": 100.0, "tbt_ms": [10.0] * 5}, {"ttft_ms": 110.0, "tbt_ms": [10.0, 10.0, 30.0, 30.0]},
                   {"ttft_ms": None, "tbt_ms": []}]  # a failed request: no tokens
    # From step 2: tokens at 120..150 and 130, 160, 190 -> 3 + 2 tokens after 120 ms, until 190 ms.
    assert rate_from_step(completions, 2) == pytest.approx(5 / 0.070)
    assert rate_from_step(completions, 2.7) == rate_from_step(completions, 2)
    assert rate_from_step(completions, 5) is None  # no request has a token after its 6th


def test_two_failures_one_after_another_lose_nothing(tiny_mixtral_dir, prompts, hf_greedy):
    spec = load_spec(tiny_mixtral_dir)
    plan = make_plan(spec, _requests(prompts), expert_workers=4, micro_batches=2, max_new_tokens=MAX_NEW,
                     timeout_s=20)
    plan = make_elastic(plan, redundant=4, kill=2, kill_step=2, kill_every=3)
    assert plan.kill == ((0, 2), (1, 5))
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    assert result["failed_requests"] == []
    elastic = result["elastic"]
    assert elastic["lost_workers"] == [0, 1]
    rows = elastic["failures"]
    assert [(r["step"], r["workers"], r["failed_workers"]) for r in rows] == [(2, [0], 1), (5, [1], 2)]
    for row in rows:  # each loss was seen, re-placed and served through on its own
        assert row["detection_s"] > 0 and row["switch_s"] >= 0 and row["recovery_s"] >= 0
        assert row["detection_s"] + row["switch_s"] + row["recovery_s"] == pytest.approx(row["interruption_s"])
    assert _leftovers(pids) == ([], [])


@pytest.mark.netns
def test_two_failures_one_after_another_across_emulated_hosts(tiny_mixtral_dir, prompts, hf_greedy):
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        require_or_skip("netns", "link emulation needs root and iproute2 (ip, tc)")
    if not mooncake_available():
        require_or_skip("mooncake", "mooncake.engine does not import (install mooncake-transfer-engine-non-cuda)")
    before = set(existing_namespaces())
    plan = make_plan(load_spec(tiny_mixtral_dir), _requests(prompts), expert_workers=4, micro_batches=2,
                     max_new_tokens=MAX_NEW, timeout_s=20, backend="mooncake")
    plan = emulate_hosts(make_elastic(plan, redundant=4, kill=2, kill_step=2, kill_every=3), 2, 10.0)
    pids: list[int] = []
    result = run_engine(plan, on_start=pids.extend, run_timeout_s=120)
    assert [c["output_ids"] for c in result["completions"]] == hf_greedy(tiny_mixtral_dir, prompts, MAX_NEW)
    assert result["failed_requests"] == []
    rows = result["elastic"]["failures"]
    assert [(r["step"], r["workers"]) for r in rows] == [(2, [0]), (5, [1])]
    assert all(r["interruption_s"] is not None and r["detection_s"] is not None for r in rows)
    assert _leftovers(pids) == ([], [])
    assert set(existing_namespaces()) <= before  # none left (a stale one may be swept meanwhile)


def test_elastic_bench_kill_every_reports_the_failure_table(tiny_mixtral_dir, capsys):
    from mbridge_epoverlap.cli import main

    code = main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "4",
                 "--redundant-experts", "4", "--kill", "2", "--kill-step", "2", "--kill-every", "2", "--steps", "8",
                 "--batch", "4", "--repeats", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lost_requests"] == [] and report["outputs_match_reference"] is True
    assert report["layout"]["kill_every"] == 2
    assert len(report["restart_s"]) == 1 and report["restart_s_median"] == report["restart_s"][0] > 0
    table = report["failures"]
    assert [(f["failed_workers"], f["of"], f["workers"], f["step"]) for f in table] == [(1, 4, [0], 2), (2, 4, [1], 4)]
    for f in table:
        assert f["lost_requests"] == 0 and f["outputs_equal"] is True
        assert f["interruption_over_restart"] == pytest.approx(f["interruption_s"] / report["restart_s_median"])
        assert f["throughput_over_before"] > 0
        assert {"detection_s", "switch_s", "recovery_s", "weight_load_s", "throughput_after"} <= set(f)


@pytest.mark.parametrize(("flags", "message"), [
    (["--kill", "2", "--kill-every", "0"], "--kill-every 0 must be >= 1"),
    (["--kill", "1", "--kill-every", "2"], "--kill-every 2 spaces several kills; add --kill 2"),
    (["--kill", "2", "--kill-every", "-1"], "argument --kill-every: -1 must be at least 0"),
    (["--kill", "2", "--kill-every", "24"], "a kill at decode step 32 falls after decoding ends (--steps 32"),
    (["--kill", "4"], "--kill 4 of 4 expert workers leaves no expert worker"),
])
def test_elastic_bench_kill_flags_bad_input_exit_2(tiny_mixtral_dir, capsys, flags, message):
    from mbridge_epoverlap.cli import main

    try:
        code = main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "4",
                     "--redundant-experts", "4", "--json", *flags])
    except SystemExit as exc:  # argparse rejects a bad value itself
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_elastic_bench_refuses_kills_no_copy_survives_without_restore(tiny_mixtral_dir, capsys):
    from mbridge_epoverlap.cli import main

    # 4 experts in 6 slots over 3 workers: worker 0 holds the only replica of some experts.
    base = ["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "3", "--redundant-experts",
            "2", "--kill", "1", "--json"]
    assert main(base + ["--no-expert-restore"]) == 2
    err = capsys.readouterr().err
    assert "--no-expert-restore: the kill of expert workers [0] at decode step 8 takes every replica" in err
    assert "raise --redundant-experts" in err


def test_elastic_bench_pairs_each_rejoin_run_with_the_no_failure_run_beside_it(tiny_mixtral_dir, capsys):
    """With a replacement, every round runs a failure beside its no-failure runs: the rate after the rejoin is
    compared round by round over the same decode steps, and every round's outputs and losses are checked."""
    from mbridge_epoverlap.cli import main

    code = main(["elastic-bench", "--checkpoint", str(tiny_mixtral_dir), "--expert-workers", "4",
                 "--redundant-experts", "4", "--kill", "1", "--kill-step", "2", "--rejoin-after-steps", "2",
                 "--rejoin-hold", "--steps", "12", "--batch", "4", "--repeats", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lost_requests"] == [] and report["outputs_match_reference"] is True
    rounds = report["rejoin_throughput_ratio_rounds"]
    assert len(rounds) == 1 and rounds[0] is not None and rounds[0] > 0
    assert report["rejoin_throughput_ratio"] == rounds[0]
    assert report["rejoined_workers"] == [0]
