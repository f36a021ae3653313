"""`--check_with_bridge`: the GPU job's ConfigContainer built and validated by the real Megatron-Bridge, on a CPU.

For each case, in the Python that has Megatron-Bridge (this one, or `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON`,
e.g. the environment `scripts/setup_bridge_venv.sh` builds): build the recipe the job would build, apply
the case's changes exactly as the job does (`mbridge_job.apply_changes`), read it through the run config's
keys (`recipe_facts.recipe_values`) and run Bridge's own `runtime_config_update` under the target GPU's mock
(`config.bridge_cpu`); for `--bridge_version main` in the Python with Megatron-Bridge main
(`MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON`). The outcome says whether every setting exists, has the right type and
survives Bridge's and Core's validation, which overlap, delayed wgrad, dispatcher and flex backend Bridge ends with,
and every field where the job Bridge builds differs from the run config the harness validated (which starts
from the recipe facts of the released wheel). The harness compares those with what the A/B case says it
runs, so a disagreement is reported before anything is submitted.

Recipes load their Hugging Face config with `AutoBridge.from_hf_pretrained`; the check writes it into a
private offline cache from the project's recipe (`hf_configs`: Qwen3 MoE and DeepSeek-V3, the families
Megatron-Bridge has recipes for). Many jobs are checked in one child process (`run_checks`): importing
Megatron-Bridge is most of the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PYTHON_VAR = "MBRIDGE_EPOVERLAP_BRIDGE_PYTHON"
MAIN_PYTHON_VAR = "MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON"  # Megatron-Bridge main (scripts/setup_bridge_main_venv.sh)


@dataclass(frozen=True)
class BridgeOutcome:
    """What Megatron-Bridge made of one case.

    `fields` holds each run-config key where the job Bridge builds (before its runtime update) differs from the
    config the harness validated: key -> (harness value, Megatron-Bridge value).
    """

    case: str
    ok: bool
    error: str | None
    overlap: bool | None = None
    delay_wgrad: bool | None = None
    dispatcher: str | None = None
    backend: str | None = None
    fields: dict[str, list[Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckJob:
    """One job to check: the recipe choice (`mbridge_job.choose_recipe`'s arguments), the GPU, and its cases."""

    choose: dict[str, Any]
    cases: list[Any]
    gpu: str
    num_gpus: int
    max_steps: int
    te_version: str | None
    project_recipe: Any


def _check_case(recipe: Any, case: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    from megatron.bridge.training.config import runtime_config_update

    from mbridge_epoverlap.config.bridge_cpu import target_gpu
    from mbridge_epoverlap.harness.mbridge_job import apply_changes, bridge_recipe
    from mbridge_epoverlap.harness.recipe_facts import recipe_values

    with target_gpu(request["gpu"]):
        cfg = bridge_recipe(recipe)
        missing = apply_changes(cfg, case["changes"], max_steps=request["max_steps"])
        if missing:
            raise LookupError(f"this Megatron-Bridge has no setting for {', '.join(missing)}")
        theirs = recipe_values(cfg)["values"]
        fields = {key: [value, theirs[key]] for key, value in case["expected"].items()
                  if key in theirs and theirs[key] != value}
        runtime_config_update(cfg)
    model = cfg.model
    return {"case": case["name"], "ok": True, "error": None, "fields": fields,
            "overlap": bool(model.overlap_moe_expert_parallel_comm), "delay_wgrad": bool(model.delay_wgrad_compute),
            "dispatcher": model.moe_token_dispatcher_type,
            "backend": model.moe_flex_dispatcher_backend if model.moe_token_dispatcher_type == "flex" else None}


def check_job_in_bridge(request: dict[str, Any]) -> dict[str, Any]:
    """Run in the Python that has Megatron-Bridge: build, change and validate every case of one job."""
    import importlib

    from mbridge_epoverlap.config.bridge_cpu import set_te_version
    from mbridge_epoverlap.errors import UsageError
    from mbridge_epoverlap.harness.hf_configs import pinned_revisions, write_hf_cache
    from mbridge_epoverlap.harness.mbridge_job import choose_recipe

    set_te_version(request.get("te_version") or "2.12.0")
    try:
        recipe = choose_recipe(**request["choose"])
    except (LookupError, UsageError) as exc:  # no such recipe: what the job itself would stop with
        return {"recipe": None, "error": str(exc), "outcomes": []}
    try:
        importlib.import_module(recipe.module)  # imports the library recipes too, which pin the model revisions
    except ImportError as exc:  # a family without a library package (glm_moe_dsa): what the job would stop with
        return {"recipe": None, "error": f"{recipe.describe()}: {exc}", "outcomes": []}
    for model_id, config, code in request["hf_models"]:
        write_hf_cache(Path(os.environ["HF_HOME"]), model_id, config, pinned_revisions(model_id), code)
    outcomes = []
    for case in request["cases"]:
        saved = dict(os.environ)
        os.environ["WORLD_SIZE"] = str(request["num_gpus"])
        try:
            outcomes.append(_check_case(recipe, case, request))
        except Exception as exc:  # noqa: BLE001 - whatever Bridge raises is the answer, reported with its type
            outcomes.append({"case": case["name"], "ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]})
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return {"recipe": recipe.describe(), "error": None, "outcomes": outcomes}


def check_in_bridge(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run in the Python that has Megatron-Bridge: every job of `requests`, in order."""
    from mbridge_epoverlap.config.bridge_cpu import install_fake_te

    install_fake_te()
    return [check_job_in_bridge(request) for request in requests]


def bridge_python(release: str | None = None) -> str | None:
    """The interpreter that has the Megatron-Bridge release `release` (None: the newest release): this one when it
    has that release, else `MBRIDGE_EPOVERLAP_BRIDGE_PYTHON` (a release) or `MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON`
    (main), else None."""
    from mbridge_epoverlap.config.bridge_cpu import bridge_available
    from mbridge_epoverlap.config.versions import installed_bridge_release
    from mbridge_epoverlap.harness.recipe_facts import release_of

    wanted = release_of(release)
    if bridge_available() and release_of(installed_bridge_release()) == wanted:
        return sys.executable
    return os.environ.get(MAIN_PYTHON_VAR if wanted == "main" else PYTHON_VAR) or None


def _request(job: CheckJob) -> dict[str, Any]:
    """The child's request for one job; the harness's view of each case comes along to be compared."""
    from mbridge_epoverlap.config.overrides import apply_overrides
    from mbridge_epoverlap.gpus import gpu_facts
    from mbridge_epoverlap.harness.hf_configs import hf_models
    from mbridge_epoverlap.harness.recipe_facts import fact_keys, run_config_values

    recipe = job.project_recipe
    if gpu_facts(job.gpu).compute_capability is None:
        raise RuntimeError(f"--check_with_bridge mocks the target GPU, but the catalog does not know the compute "
                           f"capability of {job.gpu} (mbridge_epoverlap/gpus.py); it cannot be checked here")
    from mbridge_epoverlap.harness.hf_configs import HF_MODELS

    models = hf_models(recipe.recipe, recipe.model)
    if recipe.recipe not in HF_MODELS:
        raise RuntimeError(f"Megatron-Bridge has no recipe for {recipe.recipe!r}, so --check_with_bridge has nothing "
                           f"to build; the recipes it checks: {', '.join(sorted(HF_MODELS))}")
    cases = [{"name": case.name, "changes": case.changes,
              "expected": run_config_values(apply_overrides(recipe.copy(), case.overrides), fact_keys())}
             for case in job.cases]
    return {"choose": job.choose, "cases": cases, "gpu": job.gpu, "num_gpus": job.num_gpus,
            "max_steps": job.max_steps, "te_version": job.te_version, "hf_models": models}


def run_checks(jobs: list[CheckJob], *, timeout_s: float = 1800.0, release: str | None = None
               ) -> list[tuple[str | None, str | None, list[BridgeOutcome]]]:
    """Check every job with the real Megatron-Bridge in one child process: for each, the recipe it chose (None
    with the reason when it builds none) and each case's outcome.

    Raises:
        RuntimeError: no Megatron-Bridge to check with, a GPU or recipe it cannot check, or the child failed.
    """
    requests = [_request(job) for job in jobs]
    python = bridge_python(release)
    if python is None:
        if release_of_main(release):
            raise RuntimeError(f"--check_with_bridge --bridge_version main needs Megatron-Bridge main: set "
                               f"{MAIN_PYTHON_VAR} to a Python that has it (scripts/setup_bridge_main_venv.sh "
                               "builds one)")
        raise RuntimeError(f"--check_with_bridge needs Megatron-Bridge: install it here, or set {PYTHON_VAR} to a "
                           "Python that has it (scripts/setup_bridge_venv.sh builds one)")
    with tempfile.TemporaryDirectory(prefix="mbridge-check-") as home:
        env = dict(os.environ, HF_HOME=home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        proc = subprocess.run([python, "-m", "mbridge_epoverlap.harness.bridge_check"], input=json.dumps(requests),
                              capture_output=True, text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"the Megatron-Bridge check failed to run: {proc.stderr.strip()[-1500:]}")
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    return [(answer["recipe"], answer["error"], [BridgeOutcome(**item) for item in answer["outcomes"]])
            for answer in answers]


def release_of_main(release: str | None) -> bool:
    from mbridge_epoverlap.harness.recipe_facts import release_of

    return release_of(release) == "main"


def run_check(choose: dict[str, Any], cases: list[Any], *, gpu: str, num_gpus: int, max_steps: int,
              te_version: str | None, project_recipe: Any, release: str | None = None
              ) -> tuple[str, list[BridgeOutcome]]:
    """Check one job's cases (`run_checks` for one job): the recipe Bridge chose and each case's outcome.

    Raises:
        RuntimeError: as `run_checks`, and when Megatron-Bridge builds no recipe for the job.
    """
    ((recipe, error, outcomes),) = run_checks([CheckJob(choose, cases, gpu, num_gpus, max_steps, te_version,
                                                        project_recipe)], release=release)
    if recipe is None:
        raise RuntimeError(f"Megatron-Bridge builds no recipe for this job: {error}")
    return recipe, outcomes


def disagreements(cases: list[Any], outcomes: list[BridgeOutcome]) -> list[str]:
    """Where Megatron-Bridge's outcome differs from what the A/B case says it runs (one line each): a rejection,
    a different effective overlap, delayed wgrad, dispatcher or backend, or a field of the job that differs
    from the config the harness validated."""
    lines = []
    for case, outcome in zip(cases, outcomes, strict=True):
        if not outcome.ok:
            lines.append(f"case {case.name}: Megatron-Bridge rejects the job: {outcome.error}")
            continue
        m = case.cfg.model
        ours = {"overlap": case.cfg.comm_overlap.effective_overlap(m),
                "delay_wgrad": case.cfg.comm_overlap.effective_delay_wgrad(m),
                "dispatcher": m.moe_token_dispatcher_type,
                "backend": m.moe_flex_dispatcher_backend if m.moe_token_dispatcher_type == "flex" else None}
        theirs = {key: getattr(outcome, key) for key in ours}
        if ours != theirs:
            diff = ", ".join(f"{key}: case {ours[key]!r}, Megatron-Bridge {theirs[key]!r}" for key in ours
                             if ours[key] != theirs[key])
            lines.append(f"case {case.name}: Megatron-Bridge runs it differently ({diff})")
        if outcome.fields:
            diff = ", ".join(f"{key}: validated {ours_value!r}, Megatron-Bridge {theirs_value!r}"
                             for key, (ours_value, theirs_value) in sorted(outcome.fields.items()))
            lines.append(f"case {case.name}: the job Megatron-Bridge builds is not the config validated here ({diff})")
    return lines


def _main() -> int:
    import contextlib

    request = json.loads(sys.stdin.read())
    with contextlib.redirect_stdout(sys.stderr):  # the libraries log to stdout; it carries the answer only
        outcomes = check_in_bridge(request)
    print(json.dumps(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
