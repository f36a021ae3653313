"""Turn a finished experiment's run files into the results JSON, markdown table and chart.

Runs as the last step of a cluster job (`python -m mbridge_epoverlap.harness.collect --plan plan.json`)
so results appear even when nobody follows the job; reads the runtime's results JSON of CPU runs and
the training logs of GPU (Megatron-Bridge) runs, laid out by `run_file`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mbridge_epoverlap.errors import EXIT_FAILED, EXIT_OK, RunFailedError
from mbridge_epoverlap.harness.experiment import Experiment
from mbridge_epoverlap.harness.results import build_results, write_outputs
from mbridge_epoverlap.machine import machine
from mbridge_epoverlap.runtime.metrics import RunMetrics


def run_file(job_dir: Path, case: str, repeat: int | str, suffix: str) -> Path:
    """`runs/<case>_r<repeat><suffix>` (repeat "profile" for the profiled run)."""
    tag = f"r{repeat}" if isinstance(repeat, int) else str(repeat)
    return job_dir / "runs" / f"{case}_{tag}{suffix}"


def trace_dir(job_dir: Path, case: str) -> Path:
    return job_dir / "traces" / case


def load_run(job_dir: Path, exp: Experiment, case: str, repeat: int | str) -> RunMetrics:
    """Metrics of one run: the runtime's JSON on cpu, the parsed training log on GPUs.

    Raises:
        RunFailedError: missing or unreadable output.
    """
    from mbridge_epoverlap.harness.mbridge_logs import LogParseError, parse_log_file

    source = f"case {case} repeat {repeat}"
    if exp.gpu == "cpu":
        path = run_file(job_dir, case, repeat, ".json")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RunFailedError(f"{source}: no readable results at {path} ({exc})") from None
        return RunMetrics.from_dict(data, source)
    try:
        return parse_log_file(run_file(job_dir, case, repeat, ".log"))
    except LogParseError as exc:
        raise RunFailedError(f"{source}: {exc}") from None


def collect(plan_path: Path) -> dict:
    """Build and write the results of the experiment in `plan_path`'s job directory."""
    exp = Experiment.load(plan_path)
    if "machine" not in exp.environment:
        exp.environment["machine"] = machine()  # the first node of the allocation
    job_dir = plan_path.parent
    runs: dict[str, list[RunMetrics]] = {c.name: [] for c in exp.cases}
    for case, repeat in exp.run_order():
        runs[case].append(load_run(job_dir, exp, case, repeat))
    traces: dict[str, str | None] = {}
    if exp.profile:
        for record in exp.cases:
            traces[record.name] = str(trace_dir(job_dir, record.name))
    results = build_results(exp, runs, traces)
    write_outputs(results, Path(exp.results_json))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    from mbridge_epoverlap.harness.report import markdown_report

    parser = argparse.ArgumentParser(prog="python -m mbridge_epoverlap.harness.collect", description=__doc__)
    parser.add_argument("--plan", required=True, type=Path, help="plan.json of the experiment")
    args = parser.parse_args(argv)
    try:
        results = collect(args.plan)
    except (RunFailedError, OSError, ValueError) as exc:
        print(f"error: collecting results failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(markdown_report(results))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
