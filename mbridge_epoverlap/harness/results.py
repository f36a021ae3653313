"""The results JSON of an A/B: per-case medians, stable-window means, speedups and health checks.

Layout (extra keys beyond these are informational)::

    {"recipe", "task", "gpu", "num_gpus", "environment",
     "cases": [{"name", "overrides", "step_times_s", "stable_window", "stable_mean_s", "relative",
                "losses", "finite_loss", "skipped_iters", "nan_iters", "peak_mem_bytes",
                "tflops_per_gpu"}, ...]}

`step_times_s` are per-iteration medians across repeats; `relative` is the baseline's (first case's)
stable mean over this case's; `losses` are the first repeat's, one per iteration (null where not finite).
Runs of the reference runtime add `comm_wait_s` (the training thread's time in communication steps per
iteration: the exposed communication) and `comm_cpu_s` (CPU time of the other threads per iteration),
stable-window means, median over repeats; `schedule`, `schedule_time_s` and `stage_costs_s` (the schedule
it ran, its time per iteration and the mean cost of each of its steps, same statistics); `comm_hidden` and
`comm_hidden_worst_rank` (the share of the collectives' time hidden, over all ranks and on the rank that hid
least, from each rank's own account, same statistics); and `predicted`:
the simulator's step time, exposed communication and hidden share for those stage costs, its error against
the measurement, and, where the error exceeds 15 %, the stage whose stall the model gets most wrong
(`schedule.predict`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mbridge_epoverlap.harness.experiment import CaseRecord, Experiment
from mbridge_epoverlap.harness.stats import (
    all_finite,
    loss_mismatches,
    max_abs_diff,
    median_by_iteration,
    window_mean,
)
from mbridge_epoverlap.runtime.metrics import RunMetrics, float_or_none

REQUIRED_CASE_KEYS = ("name", "overrides", "step_times_s", "stable_window", "stable_mean_s", "relative", "losses",
                      "finite_loss", "skipped_iters", "nan_iters", "peak_mem_bytes", "tflops_per_gpu")


def build_results(exp: Experiment, runs: dict[str, list[RunMetrics]],
                  traces: dict[str, str | None] | None = None) -> dict[str, Any]:
    """Aggregate the runs of every case (in `exp.cases` order; the first case is the baseline)."""
    traces = traces or {}
    cases = [_case(exp, record, runs[record.name], traces.get(record.name)) for record in exp.cases]
    base = cases[0]
    for case in cases:
        case["relative"] = (base["stable_mean_s"] / case["stable_mean_s"]
                            if base["stable_mean_s"] and case["stable_mean_s"] else None)
    base_losses = runs[exp.cases[0].name][0].losses
    for record, case in zip(exp.cases[1:], cases[1:], strict=True):
        losses = runs[record.name][0].losses
        mismatches = loss_mismatches(base_losses, losses)
        case["loss_match_baseline"] = not mismatches
        case["loss_mismatch_iters"] = mismatches
        case["loss_max_abs_diff"] = max_abs_diff(base_losses, losses)
    base["loss_match_baseline"] = None
    for case in cases:
        case["predicted"] = _prediction(case)
    if any(case.get("trace_dir") for case in cases):  # a profiled A/B: the analyzer reads every case's traces
        from mbridge_epoverlap.harness.trace_figures import add_trace_figures

        add_trace_figures({"max_steps": exp.max_steps, "cases": cases})
    return {
        "recipe": exp.recipe,
        "task": exp.task,
        "gpu": exp.gpu,
        "num_gpus": exp.num_gpus,
        "gpus_per_node": exp.gpus_per_node,
        "environment": exp.environment,
        "ab": exp.ab,
        "executor": exp.executor,
        "max_steps": exp.max_steps,
        "repeats": exp.repeats,
        "stable_window": exp.window.to_list(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "warnings": list(exp.warnings),
        "cases": cases,
    }


def _case(exp: Experiment, record: CaseRecord, runs: list[RunMetrics], trace_dir: str | None) -> dict[str, Any]:
    iterations, medians = median_by_iteration(runs)
    stable = window_mean(iterations, medians, exp.window)
    first = runs[0]
    repeat_means = [window_mean(r.iteration_numbers(), r.step_times_s, exp.window) for r in runs]
    tflops, source = _tflops(exp, record, runs, stable)
    peaks = [r.peak_mem_bytes for r in runs if r.peak_mem_bytes is not None]
    return {
        "name": record.name,
        "overrides": list(record.overrides),
        "iterations": iterations,
        "step_times_s": medians,
        "stable_window": exp.window.to_list(),
        "stable_mean_s": stable,
        "repeat_stable_means_s": repeat_means,
        "relative": None,
        "losses": [float_or_none(x) for x in first.losses],
        "losses_repeat_consistent": all(not loss_mismatches(first.losses, r.losses) for r in runs[1:]),
        "finite_loss": all(all_finite(r.losses) for r in runs),
        "skipped_iters": max(r.skipped_iters for r in runs),
        "nan_iters": max(r.nan_iters for r in runs),
        "peak_mem_bytes": max(peaks) if peaks else None,
        "tflops_per_gpu": tflops,
        "tflops_source": source,
        "repeats": len(runs),
        "launch_env": dict(record.launch_env),
        "trace_dir": trace_dir,
        "comm_wait_s": _window_median(exp, runs, "comm_step_s"),
        "comm_cpu_s": _window_median(exp, runs, "comm_cpu_s"),
        "schedule": first.schedule,
        "schedule_time_s": _window_median(exp, runs, "schedule_s"),
        "stage_costs_s": _stage_costs(exp, runs),
        **_hidden(exp, runs),
    }


def _hidden(exp: Experiment, runs: list[RunMetrics]) -> dict[str, float]:
    """`comm_hidden` / `comm_hidden_worst_rank`: median over repeats of the share of the collectives' time hidden
    in the stable window, over all ranks and on the rank that hid least (absent without per-rank figures)."""
    shares = [s for s in (r.hidden_share(exp.window.start, exp.window.end) for r in runs) if s is not None]
    if not shares:
        return {}
    return {"comm_hidden": statistics.median(s[0] for s in shares),
            "comm_hidden_worst_rank": statistics.median(s[1] for s in shares)}


def _stage_costs(exp: Experiment, runs: list[RunMetrics]) -> dict[str, float] | None:
    """Per range name, the median over repeats of the stable-window mean cost of one occurrence."""
    names = sorted({name for run in runs for name in (run.stage_s or {})})
    if not names:
        return None
    out = {}
    for name in names:
        means = [window_mean(run.iteration_numbers()[: len(run.stage_s[name])], run.stage_s[name], exp.window)
                 for run in runs if run.stage_s and name in run.stage_s]
        means = [m for m in means if m is not None]
        if means:
            out[name] = statistics.median(means)
    return out or None


def _prediction(case: dict[str, Any]) -> dict[str, Any] | None:
    """The simulator's step time for the case's own stage costs, beside the measured one (None without costs)."""
    from mbridge_epoverlap.schedule.predict import TOLERANCE, predict

    costs, schedule, measured = case.get("stage_costs_s"), case.get("schedule"), case.get("stable_mean_s")
    if not costs or not schedule or not measured or case.get("schedule_time_s") is None:
        return None
    pred = predict(schedule, costs, measured_hidden=case.get("comm_hidden"))
    # Gradient reduction and the optimizer run outside the schedule; the simulator models the schedule only.
    outside = measured - case["schedule_time_s"]
    step = pred.schedule_s + outside
    error = step / measured - 1.0
    out: dict[str, Any] = {
        "step_s": step, "error": error, "within_tolerance": abs(error) <= TOLERANCE,
        "schedule_s": pred.schedule_s, "schedule_error": pred.schedule_s / case["schedule_time_s"] - 1.0,
        "exposed_comm_s": pred.exposed_comm_s, "comm_s": pred.comm_s, "hidden_fraction": pred.hidden_fraction,
        "hidden_upper_bound": pred.hidden_upper_bound, "measured_hidden_fraction": pred.measured_hidden_fraction,
        "stalls_s": pred.stalls_s, "measured_stalls_s": pred.measured_stalls_s, "largest_gap": None,
    }
    gap = pred.largest_gap()
    if gap is not None and not out["within_tolerance"]:
        out["largest_gap"] = {"stall": gap[0], "measured_s": gap[1], "predicted_s": gap[2]}
    return out


def _window_median(exp: Experiment, runs: list[RunMetrics], attribute: str) -> float | None:
    """Median over repeats of the stable-window mean of a per-iteration series (None where no run has it)."""
    means = []
    for run in runs:
        series = getattr(run, attribute)
        if series:
            mean = window_mean(run.iteration_numbers()[: len(series)], series, exp.window)
            if mean is not None:
                means.append(mean)
    return statistics.median(means) if means else None


def _tflops(exp: Experiment, record: CaseRecord, runs: list[RunMetrics],
            stable: float | None) -> tuple[float | None, str | None]:
    """Trainer-printed per-step values in the window, else the model estimate at the stable-window mean (the
    same window the comparison uses), else the trainer's single figure."""
    per_step = [r for r in runs if r.tflops_per_step]
    if per_step:
        values = []
        for r in per_step:
            its = r.iteration_numbers()[: len(r.tflops_per_step or [])]
            mean = window_mean(its, r.tflops_per_step or [], exp.window)
            if mean is not None:
                values.append(mean)
        if values:
            return statistics.median(values), "trainer"
    if record.model_flops_per_iteration and stable and exp.num_gpus:
        return record.model_flops_per_iteration / stable / exp.num_gpus / 1e12, "model_flops_estimate"
    reported = [r.tflops_per_gpu for r in runs if r.tflops_per_gpu is not None and math.isfinite(r.tflops_per_gpu)]
    if reported:
        return statistics.median(reported), "trainer"
    return None, None


def _umask() -> int:
    """The process's umask (reading it means setting it; it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same directory and rename it into place.

    A reader sees the old file or the complete new one, never a half-written one; on failure the
    temporary file is removed and `path` is untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        # mkstemp makes the file private (0600); results are ordinary files, so give them the user's umask.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("w") as fh:
            json.dump(data, fh, indent=2, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())

    atomic_write(path, write)


def sibling(path: Path, suffix: str) -> Path:
    """`results.json` -> `results.md`, `results.png`."""
    return path.with_suffix(suffix)


def write_outputs(results: dict[str, Any], path: Path) -> dict[str, Path]:
    """The results JSON, its markdown table and its chart, side by side; returns their paths.

    The markdown and chart are written first, the JSON last, so a present JSON means a complete set.
    """
    from mbridge_epoverlap.harness.chart import write_chart
    from mbridge_epoverlap.harness.report import markdown_report

    md_path, png_path = sibling(path, ".md"), sibling(path, ".png")
    text = markdown_report(results)
    atomic_write(md_path, lambda tmp: tmp.write_text(text))
    atomic_write(png_path, lambda tmp: write_chart(results, tmp))
    write_json(path, _json_safe(results))
    return {"json": path, "markdown": md_path, "chart": png_path}


def _json_safe(value: Any) -> Any:
    """Replace non-finite floats by null anywhere in the structure (strict JSON)."""
    if isinstance(value, float):
        return float_or_none(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
