"""`mbridge-epoverlap profile` as users run it: output contract, comparison, errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from profiling_synth import DEEPEP_COMBINE, DEEPEP_DISPATCH, GEMM, kineto_event, write_kineto, write_nsys

REPO = Path(__file__).resolve().parents[3]
DEVICE_KEYS = {
    "pid",
    "device",
    "kernels",
    "comm_ns",
    "compute_ns",
    "overlap_ns",
    "exposed_comm_ns",
    "active_ns",
    "overlap_pct",
    "nvtx",
}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "mbridge_epoverlap.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


def _trace(path: Path, overlap_us: int, rank: int | None = 0) -> Path:
    """GEMM [0, 1000) us and a DeepEP dispatch + combine pair overlapping it by `overlap_us`."""
    start = 1000 - overlap_us
    events = [
        kineto_event("kernel", GEMM, 0, 7, "5000000.0", "1000.0"),
        kineto_event("kernel", DEEPEP_DISPATCH, 0, 20, f"{5000000 + start}.0", "300.0"),
        kineto_event("kernel", DEEPEP_COMBINE, 0, 20, f"{5000000 + start + 300}.0", "200.0"),
    ]
    return write_kineto(path, events, rank=rank)


@pytest.fixture(scope="module")
def before_after(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ab")
    return _trace(tmp / "before.json", 0), _trace(tmp / "after.json", 400)


def test_json_contract_and_compare(before_after):
    before, after = before_after
    run = cli("profile", str(before), str(after), "--compare", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert [t["path"] for t in doc["traces"]] == [str(before), str(after)]
    for trace in doc["traces"]:
        (device,) = trace["devices"]
        assert DEVICE_KEYS <= device.keys()
        assert {"dispatch_ns", "combine_ns", "ranges"} <= device["nvtx"].keys()
    b, a = (t["devices"][0] for t in doc["traces"])
    assert (b["comm_ns"], b["overlap_ns"], b["overlap_pct"]) == (500_000, 0, 0.0)
    assert (a["comm_ns"], a["overlap_ns"], a["exposed_comm_ns"], a["overlap_pct"]) == (500_000, 400_000, 100_000, 80.0)
    cmp = doc["comparison"]
    assert cmp["overlap_ns"] == {"before": 0, "after": 400_000}
    assert cmp["overlap_ms"] == {"before": 0.0, "after": 0.4}
    assert cmp["overlap_pct_of_comm"] == {"before": 0.0, "after": 80.0}
    assert cmp["active_ns"] == {"before": 1_500_000, "after": 1_100_000}
    assert cmp["exposed_comm_ms"] == {"before": 0.5, "after": 0.1}
    assert cmp["kernels"] == {"before": 3, "after": 3} and cmp["same_kernel_count"] is True
    assert "rose from 0.000 ms (0.00 % of comm time) to 0.400 ms (80.00 %)" in cmp["summary"]
    assert cmp["card"]["comm_concurrent_with_compute"] == "0.000 ms (0.00 % of comm) -> 0.400 ms (80.00 %)"
    assert cmp["card"]["kernels"] == "3 -> 3"


def test_table_output(before_after):
    before, after = before_after
    run = cli("profile", str(before), str(after), "--compare")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for text in ("comm ms", "overlap %", "before.json", "80.00", "before -> after", "0.400", "exposed comm (ms)"):
        assert text in out


def test_window_and_directory(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    _trace(folder / "trace_rank-1.json", 400, rank=None)  # rank from the file name
    write_nsys(
        folder / "trace_rank-0.sqlite",
        [(0, 1000, 0, 7, GEMM), (600, 1100, 0, 20, DEEPEP_DISPATCH)],
        pid_of_device={0: 7},
    )
    run = cli("profile", str(folder), "--json", "--window", "0:800")
    assert run.returncode == 0, run.stderr
    (trace,) = json.loads(run.stdout)["traces"]
    assert trace["format"] == "mixed" and trace["window"]["spec"] == "0:800"
    rank0, rank1 = trace["devices"]
    assert (rank0["rank"], rank0["comm_ns"], rank0["overlap_ns"], rank0["compute_ns"]) == (0, 200, 200, 800)
    assert (rank1["rank"], rank1["comm_ns"], rank1["compute_ns"]) == (1, 0, 800)  # dispatch starts at 600 us


def _bad(tmp_path: Path) -> dict[str, list[str]]:
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("just some notes\n")
    no_events = tmp_path / "metrics.json"
    no_events.write_text('{"loss": [1.0, 0.9]}')
    packed = (Path(__file__).parent / "data" / "kineto" / "hta_sampled_rank-0.json.gz").read_bytes()
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(packed[:20_000])
    no_kernels = write_nsys(tmp_path / "nokernels.sqlite", [], kernel_table=False)
    good = _trace(tmp_path / "good.json", 0)
    return {
        "empty.json": ["profile", str(empty)],
        "notes.txt": ["profile", str(text)],
        "metrics.json": ["profile", str(no_events)],
        "cut.json.gz": ["profile", str(cut)],
        "nokernels.sqlite": ["profile", str(no_kernels)],
        "missing.sqlite": ["profile", str(tmp_path / "missing.sqlite")],
        "--window": ["profile", str(good), "--window", "5s:1s"],
        "--comm-regex": ["profile", str(good), "--comm-regex", "nccl(["],
        "--compare": ["profile", str(good), "--compare"],
        "steps": ["profile", str(good), "--window", "steps:3:8"],
    }


def test_bad_inputs_exit_2_without_traceback(tmp_path):
    for needle, args in _bad(tmp_path).items():
        run = cli(*args)
        assert run.returncode == 2, (needle, run.stdout, run.stderr)
        assert "Traceback" not in run.stderr, run.stderr
        assert run.stderr.startswith("error: ") and needle in run.stderr, (needle, run.stderr)
        assert run.stdout == ""


def test_register_is_light():
    code = (
        "import sys, argparse\n"
        "from mbridge_epoverlap.profiling import cli\n"
        "p = argparse.ArgumentParser(); cli.register(p.add_subparsers())\n"
        "print(sorted(m for m in ('numpy', 'rich', 'torch', 'sqlite3') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
