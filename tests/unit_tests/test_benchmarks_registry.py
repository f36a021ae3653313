"""`make bench` (benchmarks/run_all.py) runs every benchmark, each with a short profile."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_is_registered_and_has_a_quick_profile() -> None:
    run_all = _run_all()
    registered = {bench.script for bench in run_all.BENCHMARKS}
    on_disk = {path.name for path in BENCHMARKS.glob("*.py") if path.name != "run_all.py"}
    assert registered == on_disk, "register new benchmarks in benchmarks/run_all.py"
    for name in on_disk:
        text = (BENCHMARKS / name).read_text()
        assert '"--quick"' in text and '"--json"' in text, f"{name} needs --quick and --json for run_all.py"


def test_headlines_read_the_benchmarks_json() -> None:
    run_all = _run_all()
    eplb = next(b for b in run_all.BENCHMARKS if b.name == "eplb")
    doc = {"rows": [{"experts": 64, "gpus": 8, "balance": {"none": 3.0, "greedy": 1.3, "eplb-global": 1.0,
                                                            "eplb-hier": 1.1}, "solve_ms": {"eplb-global": 20.0}}]}
    assert eplb.headline(doc) == ("64 experts on 8 GPUs, max/mean load: none 3.00, greedy 1.30, EPLB 1.00 "
                                  "(hier. 1.10); solve 20 ms")
