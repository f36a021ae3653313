"""`mbridge-epoverlap simulate` end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit_tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[3]


def test_pingpong_json_and_png(tmp_path):
    png = tmp_path / "pp.png"
    proc = run_cli(
        "simulate", "--schedule", "pingpong", "--micro-batches", "3", "--layers", "2",
        "--t-attn", "1", "--t-expert", "1", "--t-comm", "0.3", "--png", str(png), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"makespan", "utilization", "idle"} <= set(out)
    assert {"attention", "expert"} <= set(out["utilization"]) and {"attention", "expert"} <= set(out["idle"])
    assert out["makespan"] == pytest.approx((1 + 1 + 0.6) + 1 * (3 * 2 - 1))
    assert out["makespan"] == pytest.approx(out["closed_form"])
    assert out["min_micro_batches"] == 3
    assert png.stat().st_size > 5000


def test_1f1b_overlap_flags_change_the_timeline():
    base = ("simulate", "--schedule", "1f1b", "--micro-batches", "4", "--layers", "2", "--t-comm", "1", "--json")
    plain = json.loads(run_cli(*base, "--no-overlap").stdout)
    combined = json.loads(run_cli(*base, "--overlap").stdout)
    delayed = json.loads(run_cli(*base, "--overlap", "--delay-wgrad").stdout)
    assert set(plain["utilization"]) == {"compute", "comm"}
    assert combined["makespan"] < plain["makespan"]
    assert delayed["makespan"] <= combined["makespan"] + 1e-9  # equal here, up to float rounding
    assert (plain["overlap"], combined["overlap"], delayed["delay_wgrad"]) == (False, True, True)
    megatron = json.loads(run_cli(*base, "--overlap", "--megatron-core-edges").stdout)
    assert (combined["paired_edges"], megatron["paired_edges"]) == (True, False)
    assert combined["makespan"] < megatron["makespan"] < plain["makespan"]


def test_two_batch_readable_output():
    proc = run_cli("simulate", "--schedule", "two-batch", "--layers", "3")
    assert proc.returncode == 0, proc.stderr
    assert "makespan" in proc.stdout and "compute" in proc.stdout and "comm" in proc.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--schedule", "pingpong", "--micro-batches", "0"), "--micro-batches"),
        (("--schedule", "1f1b", "--t-attn", "-2"), "--t-attn"),
        (("--schedule", "pingpong", "--layers", "-1"), "--layers"),
        (("--schedule", "pingpong", "--delay-wgrad"), "only to --schedule 1f1b"),
        (("--schedule", "two-batch", "--megatron-core-edges"), "--megatron-core-edges applies only"),
        (("--schedule", "two-batch", "--t-comm", "nan"), "--t-comm"),
    ],
)
def test_bad_input_exits_2_without_traceback(args, needle):
    proc = run_cli("simulate", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr


def test_subcommand_registration_stays_light():
    code = (
        "import argparse, json, sys\n"
        "from mbridge_epoverlap.schedule import cli as a\n"
        "from mbridge_epoverlap.serving.cli import plan as b\n"
        "subparsers = argparse.ArgumentParser().add_subparsers()\n"
        "a.register(subparsers); b.register(subparsers)\n"
        "print(json.dumps([m for m in ('numpy', 'torch', 'matplotlib', 'rich') if m in sys.modules]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
