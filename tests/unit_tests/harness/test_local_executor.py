"""The local executor's bookkeeping (run order, progress, failures), with a stand-in for `run_local`."""

from __future__ import annotations

import pytest

from mbridge_epoverlap.errors import RunFailedError
from mbridge_epoverlap.harness.cases import build_cases, case_specs
from mbridge_epoverlap.harness.executors import local
from mbridge_epoverlap.harness.experiment import CaseRecord, Experiment
from mbridge_epoverlap.harness.flags import build_parser
from mbridge_epoverlap.harness.resolve import resolve
from mbridge_epoverlap.harness.stats import Window
from mbridge_epoverlap.runtime.metrics import RunMetrics


def cpu_cases():
    args = build_parser().parse_intermixed_args(["-g", "cpu", "-ng", "2", "--max_steps", "4"])
    r = resolve(args)
    cases, _ = build_cases(r, case_specs("ep_overlap", r.cfg, r.explicit))
    return cases


def experiment(cases, repeats=2, profile=False):
    return Experiment(recipe="qwen3_30b_a3b", task="pretrain", gpu="cpu", num_gpus=2, gpus_per_node=2,
                      environment={}, cases=[CaseRecord(c.name, c.overrides) for c in cases], repeats=repeats,
                      max_steps=4, window=Window(2, 4), results_json="unused.json", profile=profile)


def fake_runtime(calls, fail_on=None, error=RunFailedError):
    def run_local(cfg, *, max_steps, profile_dir=None, emulate_link_gbps=None, timeout_s=600.0, progress=None):
        calls.append((cfg.comm_overlap.overlap_moe_expert_parallel_comm, cfg.comm_overlap.delay_wgrad_compute,
                      profile_dir, cfg.env_vars.get("CUDA_DEVICE_MAX_CONNECTIONS"), emulate_link_gbps))
        if fail_on is not None and len(calls) == fail_on:
            raise error("rank 1 exited with status 3")
        progress("iteration 1/4 | loss 1.0")
        step = 1.0 if cfg.comm_overlap.overlap_moe_expert_parallel_comm else 2.0
        return RunMetrics(step_times_s=[step] * max_steps, losses=[1.0] * max_steps, peak_mem_bytes=1,
                          trace_dir=str(profile_dir or "") or None)

    return run_local


def test_interleaved_order_and_results(monkeypatch, tmp_path):
    calls, lines = [], []
    monkeypatch.setattr(local, "_runtime", lambda: fake_runtime(calls))
    cases = cpu_cases()
    executor = local.LocalExecutor(timeout_s=30, emulate_link_gbps=2.0, trace_root=tmp_path, progress=lines.append)
    results = executor.run(experiment(cases, profile=True), cases)
    switches = [(overlap, delay) for overlap, delay, *_ in calls]
    assert switches == [(False, False), (True, False), (True, True)] * 3  # A B C A B C, then the profiled runs
    assert [c[2] for c in calls][:6] == [None] * 6 and calls[6][2] == tmp_path / "ep_overlap_off"
    assert {c[3] for c in calls} == {"8"} and {c[4] for c in calls} == {2.0}
    assert [c["relative"] for c in results["cases"]] == [1.0, 2.0, 2.0]
    assert results["cases"][0]["repeats"] == 2 and results["cases"][0]["trace_dir"] == str(tmp_path / "ep_overlap_off")
    assert "[run] ep_overlap_on (case 2/3, repeat 2/2, run 5/6): starting" in lines
    assert "  ep_overlap_on: iteration 1/4 | loss 1.0" in lines


@pytest.mark.parametrize("error", [RunFailedError, OSError])
def test_a_failed_run_names_case_and_repeat(monkeypatch, error):
    calls = []
    monkeypatch.setattr(local, "_runtime", lambda: fake_runtime(calls, fail_on=2, error=error))
    cases = cpu_cases()
    with pytest.raises(RunFailedError, match=r"ep_overlap_on \(case 2/3, repeat 1/2, run 2/6\) failed: .*rank 1"):
        local.LocalExecutor(timeout_s=30).run(experiment(cases), cases)
    assert len(calls) == 2  # nothing runs after a failure
