"""Local executor: run every case with the reference runtime on this machine, interleaved."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_epoverlap.errors import RunFailedError
from mbridge_epoverlap.harness.cases import Case
from mbridge_epoverlap.harness.experiment import Experiment
from mbridge_epoverlap.harness.results import build_results
from mbridge_epoverlap.runtime.metrics import RunMetrics

Progress = Callable[[str], None]


def _runtime() -> Callable[..., Any]:
    from mbridge_epoverlap.runtime.launch import run_local  # torch: imported only when cases run

    return run_local


@dataclass
class LocalExecutor:
    """Runs cases in CPU processes through `mbridge_epoverlap.runtime.launch.run_local`.

    Attributes:
        timeout_s: limit per run (the runtime kills its ranks past it).
        emulate_link_gbps: shape the ranks' links to this rate (None: loopback as is).
        trace_root: where profiled runs write traces (one folder per case).
        progress: receives one line per event (stderr in the CLI).
    """

    timeout_s: float
    emulate_link_gbps: float | None = None
    trace_root: Path | None = None
    progress: Progress = lambda line: None

    def run(self, exp: Experiment, cases: list[Case]) -> dict[str, Any]:
        """Run `exp.repeats` interleaved rounds of every case (then the profiled runs) and aggregate.

        Raises:
            RunFailedError: a run failed; the message names the case and repeat.
        """
        run_local = _runtime()
        by_name = {case.name: case for case in cases}
        order = exp.run_order()
        runs: dict[str, list[RunMetrics]] = {case.name: [] for case in cases}
        position = {record.name: i for i, record in enumerate(exp.cases, start=1)}
        for index, (name, repeat) in enumerate(order, start=1):
            tag = (f"{name} (case {position[name]}/{len(cases)}, repeat {repeat}/{exp.repeats}, "
                   f"run {index}/{len(order)})")
            self.progress(f"[run] {tag}: starting")
            metrics = self._run_one(run_local, by_name[name], exp.max_steps, tag, profile_dir=None)
            runs[name].append(metrics)
            self.progress(f"[run] {tag}: done, {_step_summary(metrics, exp.window)}"
                          + (f", last loss {metrics.losses[-1]:.6g}" if metrics.losses else ""))
        traces: dict[str, str | None] = {}
        if exp.profile:
            root = self.trace_root or Path("traces")
            for case in cases:
                tag = f"{case.name} (profiled run, not timed)"
                self.progress(f"[run] {tag}: starting")
                profiled = self._run_one(run_local, case, exp.max_steps, tag, profile_dir=root / case.name)
                traces[case.name] = profiled.trace_dir or str(root / case.name)
        return build_results(exp, runs, traces)

    def _run_one(self, run_local: Callable[..., Any], case: Case, max_steps: int, tag: str,
                 profile_dir: Path | None) -> RunMetrics:
        def forward(line: str) -> None:
            # The runtime's per-iteration lines come from rank 0; the table reports the slowest rank.
            self.progress(f"  {case.name}: {line.replace(' | step ', ' | rank 0 step ', 1)}")

        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
        # The case's launch environment is in `case.cfg.env_vars`; run_local puts it in each rank's
        # environment when it starts the rank, which is when CUDA_DEVICE_MAX_CONNECTIONS must be there.
        try:
            result = run_local(case.cfg, max_steps=max_steps, profile_dir=profile_dir,
                               emulate_link_gbps=self.emulate_link_gbps, timeout_s=self.timeout_s, progress=forward)
        except RunFailedError as exc:
            raise RunFailedError(f"{tag} failed: {exc}") from None
        except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
            # The runtime promises RunFailedError; anything else from it is still a failed run.
            raise RunFailedError(f"{tag} failed: {type(exc).__name__}: {exc}") from None
        return result


def _step_summary(metrics: RunMetrics, window: Any) -> str:
    """The figure the results table shows for one run: the slowest rank's stable-window mean step time."""
    from mbridge_epoverlap.harness.stats import window_mean

    mean = window_mean(metrics.iteration_numbers(), metrics.step_times_s, window) if window is not None else None
    if mean is None:
        return f"median step {statistics.median(metrics.step_times_s):.4f} s (slowest rank)"
    return f"stable-window mean step {mean:.4f} s (slowest rank, iterations {window}, as the table computes it)"
