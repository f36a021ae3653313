"""The values of Megatron-Bridge's recipes that the validation, the launch environment and the dry run read.

A GPU job builds the recipe Megatron-Bridge's `run_script.py` would build and changes only what the user and
the A/B case set (`mbridge_job`). To validate that job before it is submitted, the harness starts from the
same recipe's values. They are the recipe's `ConfigContainer` seen through the run config's own keys
(`recipe_values`): every `model.*`, `comm_overlap.*` and `ddp.*` field the run config has and the recipe's
container has too, the batch shape, precision as the run config spells it (`model.bf16`/`model.fp16`, and
`ddp.grad_reduce_in_fp32` from the recipe's mixed-precision config, which overwrites DDP's), plus the
recipe's mixed-precision (FP8/FP4) settings and launch environment (`env_vars`) for the dry run and the
launch environment.

Megatron-Bridge is rarely importable where the harness runs, so the values come from fixtures extracted by
the real Megatron-Bridge (`scripts/extract_bridge_recipe_facts.py`), one per release the validator knows
(`--bridge_version`): `data/bridge_recipe_facts.json` from the 0.6.2 wheel, `data/bridge_recipe_facts_main.json`
from main's source (the environment `scripts/setup_bridge_main_venv.sh` builds). Each holds every performance
recipe and library recipe of the models the harness maps (`hf_configs.HF_MODELS`). A job for main is
validated against main's recipe, not 0.6.2's. `--check_with_bridge` builds the recipe with the
Megatron-Bridge at hand and compares the same projection field by field, so a fixture that no longer matches
is caught there.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from functools import cache
from pathlib import Path
from typing import Any

FACTS_FILE = Path(__file__).resolve().parent / "data" / "bridge_recipe_facts.json"
MAIN_FACTS_FILE = FACTS_FILE.with_name("bridge_recipe_facts_main.json")
SECTIONS = ("model", "comm_overlap", "ddp")
TRAIN_KEYS = ("train.global_batch_size", "train.micro_batch_size")
# Run-config keys that have no counterpart to read: an object Bridge builds itself, and the EP switches that
# Bridge's comm-overlap set-up writes onto the model from comm_overlap (the run config mirrors them the same way).
SKIPPED = frozenset({"comm_overlap.tp_comm_overlap_cfg", "model.overlap_moe_expert_parallel_comm",
                     "model.delay_wgrad_compute"})
# Mixed-precision fields kept for the dry run (FP8/FP4 recipes), as Megatron-Bridge names them.
MIXED_PRECISION_FIELDS = ("bf16", "fp16", "fp8", "fp8_recipe", "fp8_param", "fp8_param_gather",
                          "fp8_dot_product_attention", "fp4", "fp4_recipe", "grad_reduce_in_fp32")


def fact_keys() -> tuple[str, ...]:
    """The run-config dotted keys a recipe's values are read for."""
    from mbridge_epoverlap.config.container import RunConfig

    cfg = RunConfig()
    keys = [f"{section}.{f.name}" for section in SECTIONS for f in dataclasses.fields(getattr(cfg, section))]
    return tuple(key for key in keys if key not in SKIPPED) + TRAIN_KEYS


def plain(value: Any) -> Any:
    """A JSON value: enums by member name, tuples and sets as lists, dtypes and other objects as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(item) for item in value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


def graph_scope_names(model: Any) -> list[str]:
    """Every CUDA-graph scope of a model config, from Core 0.19's `cuda_graph_modules` and the older
    `cuda_graph_scope` alike (`full` is Core's default for "no module", as the run config's empty list)."""
    names: list[str] = []
    for value in (getattr(model, "cuda_graph_modules", None), getattr(model, "cuda_graph_scope", None)):
        if value is None:
            continue
        items = value.split(",") if isinstance(value, str) else list(value) \
            if isinstance(value, (list, tuple, set)) else [value]
        names += [str(getattr(item, "name", item)).rsplit(".", 1)[-1].strip() for item in items]
    return [name for name in dict.fromkeys(names) if name and name != "full"]


def _mixed_precision(container: Any) -> Any:
    precision = getattr(container, "mixed_precision", None)
    if isinstance(precision, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        precision = get_mixed_precision_config(precision)
    return precision


def recipe_values(container: Any) -> dict[str, Any]:
    """A Megatron-Bridge `ConfigContainer` seen through the run config's keys (runs where Bridge is installed).

    Returns a dict with `values` (dotted run-config key -> value), `mixed_precision` (the FP8/FP4 settings,
    or None), `env_vars` (the recipe's launch environment) and `comm_overlap` (whether the recipe has a
    comm-overlap config at all; without one Bridge's set-up does not run).
    """
    values: dict[str, Any] = {}
    for key in fact_keys():
        section, name = key.split(".", 1)
        owner = getattr(container, section, None)
        if owner is None:
            continue
        if key == "model.cuda_graph_scope":
            values[key] = graph_scope_names(owner)
        elif hasattr(owner, name):
            values[key] = plain(getattr(owner, name))
    if getattr(container, "model", None) is not None:
        from mbridge_epoverlap.config.model import provide_class

        values["model.provide_class"] = provide_class(container.model)
    precision = _mixed_precision(container)
    mixed = None
    if precision is not None:
        mixed = {name: plain(getattr(precision, name, None)) for name in MIXED_PRECISION_FIELDS}
        values["model.bf16"], values["model.fp16"] = bool(precision.bf16), bool(precision.fp16)
        if precision.grad_reduce_in_fp32 is not None:
            values["ddp.grad_reduce_in_fp32"] = bool(precision.grad_reduce_in_fp32)
    return {"values": dict(sorted(values.items())), "mixed_precision": mixed,
            "env_vars": {str(k): plain(v) for k, v in sorted((getattr(container, "env_vars", None) or {}).items())},
            "comm_overlap": getattr(container, "comm_overlap", None) is not None}


def run_config_values(cfg: Any, keys: Any) -> dict[str, Any]:
    """The run config's own values at `keys`, in the same plain form (for the field-by-field comparison)."""
    from mbridge_epoverlap.fields import get_path

    return {key: plain(get_path(cfg, key)) for key in keys}


@cache
def _load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def release_of(bridge_version: str | None) -> str:
    """The fixture release ("0.6" or "main") for a `--bridge_version` value (None: the newest release)."""
    from mbridge_epoverlap.config.versions import bridge_rules

    return bridge_rules(bridge_version).version


def facts_file(release: str | None = None) -> Path:
    """The fixture of a release ("0.6", "main"; None: the newest release), one per release the validator knows
    (`versions.KNOWN_BRIDGE`)."""
    return {"0.6": FACTS_FILE, "main": MAIN_FACTS_FILE}[release_of(release)]


def load_facts(path: Path | None = None, release: str | None = None) -> dict[str, Any]:
    """A fixture: `version` (Megatron-Bridge), `core_version`, `release`, for main `commit`, and `recipes`
    ("module.function" -> values); `path` or the fixture of `release` (None: the newest release)."""
    return _load(str(path or facts_file(release)))


def facts_label(release: str | None = None) -> str:
    """How the dry run names the release whose recipe values it uses ("Megatron-Bridge main (0.7.0 at 067f987)")."""
    facts = load_facts(release=release)
    if facts.get("release") == "main":
        commit = facts.get("commit", "")[:9]
        return f"Megatron-Bridge main ({facts['version']}{f' at {commit}' if commit else ''})"
    return f"Megatron-Bridge {facts['version']}"


def facts_for(module: str, function: str, path: Path | None = None,
              release: str | None = None) -> dict[str, Any] | None:
    """The fixture's values of one recipe, or None when the fixture does not hold it."""
    return load_facts(path, release)["recipes"].get(f"{module}.{function}")


def perf_recipe_names(path: Path | None = None, release: str | None = None) -> list[str]:
    """The performance recipe names a fixture holds (those of the models the harness maps), the ones the release
    cannot build included (`not_built`)."""
    prefix = "megatron.bridge.perf_recipes."
    facts = load_facts(path, release)
    return sorted(name.rsplit(".", 1)[1] for name in [*facts["recipes"], *facts.get("not_built", {}).keys()]
                  if name.startswith(prefix))


def not_built(module: str, function: str, release: str | None = None) -> str | None:
    """Why the release cannot build a recipe it has (the error its own code raises), or None."""
    return load_facts(release=release).get("not_built", {}).get(f"{module}.{function}")


def recipe_names_for(release: str | None) -> list[str]:
    """The performance recipe names the job's release has: the installed Megatron-Bridge's when it is that release,
    else the fixture's."""
    from mbridge_epoverlap.config.versions import installed_bridge_release
    from mbridge_epoverlap.harness.mbridge_job import installed_perf_recipe_names

    installed = installed_bridge_release()
    if installed is not None and release_of(installed) == release_of(release):
        names = installed_perf_recipe_names()
        if names:
            return names
    return perf_recipe_names(release=release)
