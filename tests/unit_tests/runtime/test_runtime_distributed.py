"""Multi-process tests on gloo: schedule equivalence, dispatcher, the launcher's interface and failures.

Every test starts real rank processes through the runtime's own launcher, with bounded timeouts.
"""

from __future__ import annotations

import json
import math
import os
from unittest import mock

import pytest

from mbridge_epoverlap.errors import RunFailedError, UsageError
from mbridge_epoverlap.launch import Ranks
from mbridge_epoverlap.launch.zygote import ended
from mbridge_epoverlap.runtime import run_local
from mbridge_epoverlap.runtime.launch import launch_ranks

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def check_report(request, make_tiny):
    return request.param, launch_ranks(make_tiny(request.param), mode="check", timeout_s=200)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_schedules_give_bitwise_identical_losses_and_gradients(check_report, dtype):
    ep, report = check_report
    assert len(report["ranks"]) == ep
    for rank in report["ranks"]:
        # By default the backward all-to-alls run on a channel of their own; one variant shares one channel
        # and runs Megatron-Core's edges.
        assert rank["comm_channels"] == 2
        variants = rank["schedules"][dtype]
        assert "combined_delay_wgrad_megatron_core_edges_one_channel" in variants
        plain = variants["plain"]
        assert all(math.isfinite(float.fromhex(x)) for it in plain["losses"] for x in it)
        for name, v in variants.items():
            assert v["losses"] == plain["losses"], name
            assert v["local_grads"] == plain["local_grads"], name
            assert v["grads"] == plain["grads"], name
            assert v["params"] == plain["params"], name
        # Two iterations of training changed the gradients: the comparison is not between zeros.
        assert plain["grads"][0] != plain["grads"][1]


def test_check_verdict_passes_the_real_report_and_names_a_tampered_one(check_report):
    import copy

    from mbridge_epoverlap.runtime.check import check_failures

    _, report = check_report
    assert check_failures(report) == []
    bad = copy.deepcopy(report)
    bad["ranks"][1]["schedules"]["bf16"]["combined"]["grads"][0] = "0" * 16
    bad["ranks"][0]["dispatcher"]["routing_ok"] = False
    assert check_failures(bad) == ["rank 0: dispatch delivered rows to the wrong experts",
                                   "rank 1 bf16: combined grads differ from plain 1F1B"]


def test_staged_run_matches_plain_autograd(check_report):
    _, report = check_report
    for rank in report["ranks"]:
        assert rank["reference"]["fp32"]["max_loss_diff"] < 1e-5
        assert rank["reference"]["fp32"]["max_grad_rel_diff"] < 1e-4
        assert rank["reference"]["bf16"]["max_loss_diff"] < 1e-2


def test_dispatch_combine_round_trip_with_uneven_splits_and_empty_experts(check_report):
    ep, report = check_report
    ranks = report["ranks"]
    assert len({r["dispatcher"]["tokens"] for r in ranks}) == ep  # every rank has a different token count
    for r in ranks:
        assert r["dispatcher"]["routing_ok"]
        assert r["dispatcher"]["roundtrip_max_err"] < 1e-5
        assert r["dispatcher"]["grad_max_err"] < 1e-5
        local = len(r["dispatcher"]["tokens_per_expert"])
        for expert in r["dispatcher"]["zero_token_experts"]:
            if expert // local == r["rank"]:
                assert r["dispatcher"]["tokens_per_expert"][expert % local] == 0


def test_run_local_reports_metrics_progress_and_traces(make_tiny, tmp_path):
    lines: list[str] = []
    cfg = make_tiny(2, overlap=True)
    m = run_local(cfg, max_steps=3, profile_dir=tmp_path / "prof", timeout_s=150, progress=lines.append)
    assert len(m.losses) == len(m.step_times_s) == 3
    assert all(math.isfinite(x) for x in m.losses) and m.skipped_iters == m.nan_iters == 0
    assert m.peak_mem_bytes > 0 and m.tflops_per_gpu and m.tflops_per_gpu > 0
    assert any("iteration 3/3" in line for line in lines)
    assert m.trace_dir == str(tmp_path / "prof")
    # Measured per iteration: the training thread's time in issue/wait steps and the other threads' CPU
    # (gloo moves the bytes on its own threads). Both are positive with EP=2 and smaller than the step.
    assert len(m.comm_step_s) == len(m.comm_cpu_s) == 3
    assert m.schedule["comm_channels"] == 2 and m.schedule["paired_edges"] is True
    share, worst = m.hidden_share(2, 3)
    assert 0.0 <= worst <= share <= 1.0
    for step, comm, cpu in zip(m.step_times_s, m.comm_step_s, m.comm_cpu_s, strict=True):
        assert 0 < comm < step and cpu > 0
    for rank in (0, 1):
        names = {e["name"] for e in json.loads((tmp_path / "prof" / f"rank{rank}.json").read_text())["traceEvents"]
                 if e.get("ph") == "X"}
        assert {"attn", "experts", "dispatch.issue", "combine.wait", "experts_wgrad", "gloo:all_to_all"} <= names


def _failing_run(cfg, fault: str, match: str, *, timeout_s: float, comm_timeout_s: float | None = None):
    """Run with `fault` injected; the run must fail with a message matching `match` (a regex). Returns the message
    and the process ids of the ranks (forked from the launcher's zygote or started fresh, as `Ranks` started them)."""
    cfg.env_vars["MBRIDGE_EPOVERLAP_FAULT"] = fault
    if comm_timeout_s is not None:
        cfg.env_vars["MBRIDGE_EPOVERLAP_COMM_TIMEOUT_S"] = str(comm_timeout_s)
    started: list[int] = []
    start = Ranks.start

    def recording_start(self, *args, **kwargs):
        start(self, *args, **kwargs)
        started.append(self.ranks[-1].proc.pid)

    with mock.patch.object(Ranks, "start", recording_start), pytest.raises(RunFailedError, match=match) as exc:
        run_local(cfg, max_steps=4, timeout_s=timeout_s)
    assert len(started) == cfg.num_gpus
    return str(exc.value), started


def test_a_rank_that_exits_fails_the_run_naming_it(make_tiny):
    # The exit ended the run, not its time limit (that message opens with "run timed out").
    message, ranks = _failing_run(make_tiny(2), "1:exit:2", "^rank 1 failed with exit code 17", timeout_s=120)
    assert "rank 1 failed with exit code 17 (iteration" in message
    assert "injected fault 'exit'" in message  # its last stderr lines
    assert "rank 0 lost its peers" in message
    assert [pid for pid in ranks if not ended(pid)] == []


def test_a_rank_that_raises_is_named_with_its_error(make_tiny):
    message, ranks = _failing_run(make_tiny(2), "0:raise:1", "^rank 0 failed with exit code 1", timeout_s=120)
    assert message.startswith("rank 0 failed with exit code 1")
    assert "RuntimeError: injected fault on rank 0 at iteration 1" in message
    assert [pid for pid in ranks if not ended(pid)] == []


def test_a_hung_rank_is_found_through_the_collective_timeout(make_tiny):
    message, ranks = _failing_run(make_tiny(2), "1:hang:2", r"^rank 1 stopped responding \(iteration 2",
                                   timeout_s=120, comm_timeout_s=3)
    assert message.startswith("rank 1 stopped responding (iteration 2")
    assert "rank 0 lost its peers" in message
    assert [pid for pid in ranks if not ended(pid)] == []


def test_a_hung_rank_is_found_by_the_watchdog(make_tiny):
    # 12 s: forked from the zygote, the ranks reach their first iteration within a few seconds on a loaded 2-core
    # machine; the time limit is all this test waits for.
    message, ranks = _failing_run(make_tiny(2), "1:hang:1", "^run timed out after 12 s; ", timeout_s=12,
                                   comm_timeout_s=600)
    assert message.startswith("run timed out after 12 s; ")
    assert "rank 1 stopped responding (iteration 1, step 0, between steps) and was killed" in message
    assert [pid for pid in ranks if not ended(pid)] == []


def test_launcher_rejects_layouts_the_ranks_cannot_run(make_tiny):
    cfg = make_tiny(2)
    cfg.num_gpus = 3
    with pytest.raises(UsageError, match="expert_model_parallel_size=2 does not divide num_gpus=3"):
        run_local(cfg, max_steps=1, timeout_s=60)
    cfg = make_tiny(2)
    cfg.train.global_batch_size = 5
    with pytest.raises(UsageError, match="global_batch_size=5"):
        run_local(cfg, max_steps=1, timeout_s=60)


def test_worker_reports_usage_errors_with_exit_code_2(make_tiny, tmp_path):
    import subprocess
    import sys

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(make_tiny(2).to_yaml())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    proc = subprocess.run([sys.executable, "-m", "mbridge_epoverlap.runtime.worker", "--config", str(cfg_path),
                           "--results", str(tmp_path / "out.json")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "set RANK and WORLD_SIZE" in proc.stderr
