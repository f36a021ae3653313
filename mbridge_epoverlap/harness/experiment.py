"""An experiment: the cases, their run order and everything the report needs, as plain data.

The same object drives the local executor, is written as `plan.json` for a Slurm job (whose last step
builds the report from it on the cluster), and describes `--from_logs` reports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mbridge_epoverlap.harness.stats import Window


@dataclass
class CaseRecord:
    """One case as the report sees it.

    Attributes:
        name: case name (e.g. ep_overlap_on).
        overrides: dotted overrides that make this case differ from the others.
        launch_env: variables the runs were launched with.
        config_path: the resolved YAML of this case (Slurm jobs), if written.
        model_flops_per_iteration: for TFLOP/s when the trainer reports none.
    """

    name: str
    overrides: list[str] = field(default_factory=list)
    launch_env: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None
    model_flops_per_iteration: float | None = None


@dataclass
class Experiment:
    """Cases, repeats and the report's context."""

    recipe: str
    task: str
    gpu: str
    num_gpus: int | None
    gpus_per_node: int | None
    environment: dict[str, Any]
    cases: list[CaseRecord]
    repeats: int
    max_steps: int
    window: Window
    results_json: str
    ab: str | None = None
    executor: str = "local"
    profile: bool = False
    warnings: list[str] = field(default_factory=list)

    def run_order(self) -> list[tuple[str, int]]:
        """(case, repeat) pairs interleaved A B C A B C ..., so slow drift hits every case alike."""
        return [(case.name, repeat) for repeat in range(1, self.repeats + 1) for case in self.cases]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["window"] = self.window.to_list()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experiment:
        data = dict(data)
        data["window"] = Window(*data["window"])
        data["cases"] = [CaseRecord(**c) for c in data["cases"]]
        return cls(**data)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Experiment:
        return cls.from_dict(json.loads(path.read_text()))
