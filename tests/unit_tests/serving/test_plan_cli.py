"""`mbridge-epoverlap plan` end to end, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit_tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[3]
PLAN_KEYS = {
    "tp_a", "tp_e", "n_a", "m", "B", "t_attn_ms", "t_expert_ms", "t_comm_ms", "tbt_ms", "throughput_tokens_s",
    "throughput_per_gpu", "cost_per_hour", "throughput_per_cost", "binding_constraint",
}  # fmt: skip


def test_plan_json_has_the_documented_keys():
    proc = run_cli(
        "plan", "--model", "Mixtral-8x22B", "--attn-gpu", "H20", "--expert-gpu", "L40S",
        "--tbt-slo-ms", "150", "--context", "730", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert PLAN_KEYS <= set(out)
    assert out["tbt_ms"] <= 150 and out["B"] > 0


def test_compare_json_ranks_pairs_and_colocated():
    proc = run_cli("plan", "--model", "Mixtral-8x22B", "--compare", "--gpus", "H20,L40S", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {(r["deployment"], r["attn_gpu"], r["expert_gpu"]) for r in rows} >= {
        ("disaggregated", "H20", "L40S"),
        ("disaggregated", "H20", "H20"),
        ("disaggregated", "L40S", "L40S"),
        ("colocated", "H20", "H20"),
    }
    assert rows[0]["attn_gpu"] == "H20" and rows[0]["expert_gpu"] == "L40S"


def test_readable_plan_and_catalog_listing():
    proc = run_cli("plan", "--model", "DBRX", "--attn-gpu", "H100", "--price", "H100=2.5")
    assert proc.returncode == 0, proc.stderr
    assert "time between tokens" in proc.stdout and "binding constraint" in proc.stdout
    listing = run_cli("plan", "--list")
    assert listing.returncode == 0 and "Qwen3-235B-A22B" in listing.stdout and "GB200" in listing.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--model", "GPT-5", "--attn-gpu", "H20"), "known: Mixtral-8x22B"),
        (("--model", "DBRX", "--attn-gpu", "X100"), "known: A100-80G"),
        (("--model", "DBRX", "--attn-gpu", "H20", "--tbt-slo-ms", "1"), "best achievable"),
        (("--model", "DBRX", "--attn-gpu", "H20", "--tbt-slo-ms", "-3"), "--tbt-slo-ms"),
        (("--model", "DBRX", "--attn-gpu", "H20", "--m", "0"), "--m"),
        (("--model", "DBRX", "--attn-gpu", "H20", "--price", "H20"), "--price"),
        (("--model", "DBRX"), "--attn-gpu"),
    ],
)
def test_bad_input_exits_2_without_traceback(args, needle):
    proc = run_cli("plan", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr
