"""The front door as users run it: exit codes, messages without tracebacks, nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit_tests.harness.conftest import REPO, run_harness


def test_help_is_readable():
    done = run_harness("--help")
    assert done.returncode == 0
    for text in ("--moe_a2a_overlap", "--ab", "--stable_window", "examples:"):
        assert text in done.stdout


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--no_such_flag"], 2, "unrecognized arguments: --no_such_flag"),
    (["-mr", "no_such_recipe", "-g", "h100"], 2, "unknown recipe 'no_such_recipe'"),
    (["-g", "h100", "comm_overlap.overlap_moe_expert_parallel_comm"], 2, "is not KEY=VALUE"),
    (["-g", "h100", "comm_overlap.no_such_key=true"], 2, "unknown config key"),
    (["-g", "h100", "-ng", "12", "-gn", "8"], 2, "not a multiple of -gn"),
    (["-g", "h100", "-ng", "16", "-ep", "256", "--te_version", "2.9"], 1, "[ep_divides_experts]"),
    (["-g", "h100", "-ng", "16", "--ab", "ep_overlap", "--recompute_granularity", "full"], 1, "[recompute_full]"),
    (["-g", "h100", "--executor", "local"], 2, "use --executor slurm"),
])
def test_bad_input(tmp_path, argv, code, message):
    out = tmp_path / "r.json"
    done = run_harness(*argv, "--results_json", str(out))
    assert done.returncode == code, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() and not out.with_suffix(".slurm").exists()


def test_validation_reports_every_error_with_its_fix(tmp_path):
    done = run_harness("-g", "h100", "-ng", "16", "--ab", "ep_overlap", "--recompute_granularity", "full",
                       "model.moe_shared_expert_overlap=true", "--results_json", str(tmp_path / "r.json"))
    assert done.returncode == 1
    for rule in ("[recompute_full]", "[shared_expert_overlap]", "[delay_te_grad_reduce]"):
        assert rule in done.stderr
    assert done.stderr.count("fix:") >= 3 and "nothing was launched" in done.stderr


def test_missing_sbatch(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # a PATH without the Slurm client tools
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts/performance/run_script.py"), "-g", "h100", "-ng", "16",
                           "--te_version", "2.9", "--results_json", str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert done.returncode == 1
    assert "sbatch not found on PATH" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() and not out.with_suffix(".slurm").exists()


def test_dry_run_writes_the_resolved_config(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    done = run_harness("-g", "h100", "-ng", "16", "--te_version", "2.9", "--dryrun", "--moe_a2a_overlap", "false",
                       "--save_config_filepath", str(cfg), "--results_json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    text = cfg.read_text()
    assert "comm_overlap:" in text and "model:" in text
    assert "overlap_moe_expert_parallel_comm: false" in text
    assert "#SBATCH --nodes=2" in done.stdout


def test_importing_the_harness_front_end_stays_light():
    code = ("import sys, mbridge_epoverlap, mbridge_epoverlap.harness.main, mbridge_epoverlap.harness.flags; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'megatron') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.stdout.strip() == "[]"
