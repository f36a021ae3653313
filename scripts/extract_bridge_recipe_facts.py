#!/usr/bin/env python3
"""Build every Megatron-Bridge recipe of the models the harness maps and write the values the harness reads.

Runs in a Python 3.12 environment with Megatron-Bridge: the released one (`scripts/setup_bridge_venv.sh`) or
main built from its source (`scripts/setup_bridge_main_venv.sh`), on a CPU and offline: Transformer Engine is
faked and each target GPU mocked (`config.bridge_cpu`), and each model's `config.json` is written from the
project's recipe into a private Hugging Face cache (`harness.hf_configs`). For each project recipe in
`hf_configs.HF_MODELS`, it builds every flat performance recipe of that model (under its GPU's mock; without a
GPU where the catalog does not know its compute capability) and its library recipes, and records
`recipe_facts.recipe_values` of each. The output (sorted, one recipe a line, no paths or dates: the same
release gives the same file) is the fixture the harness validates GPU jobs against where Megatron-Bridge is
not importable, one per release:

    PYTHONPATH=. $MBRIDGE_EPOVERLAP_BRIDGE_PYTHON scripts/extract_bridge_recipe_facts.py \\
        mbridge_epoverlap/harness/data/bridge_recipe_facts.json
    PYTHONPATH=. $MBRIDGE_EPOVERLAP_BRIDGE_MAIN_PYTHON scripts/extract_bridge_recipe_facts.py \\
        mbridge_epoverlap/harness/data/bridge_recipe_facts_main.json

(`OUT --models qwen3_30b_a3b` builds the recipes of those project recipes only.)

The fixture names its release (`release`: "0.6" or "main", what `--bridge_version` picks it by) and, for main,
the commit it was built from (`commit`, from the environment's SOURCES file), so a rebuild from a newer main
shows up in the diff.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

LIBRARY_TASKS = ("pretrain", "sft", "peft")
_GPU = re.compile(r"_\d+gpu_([a-z0-9]+)_")


def extract(models: list[str] | None = None) -> dict[str, Any]:
    from mbridge_epoverlap.config.bridge_cpu import install_fake_te, set_te_version, target_gpu

    install_fake_te()
    home = Path(tempfile.mkdtemp(prefix="mbridge-facts-"))
    os.environ.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WORLD_SIZE="1")
    set_te_version("2.12.0")
    import megatron.bridge
    import megatron.core

    from mbridge_epoverlap.gpus import gpu_facts
    from mbridge_epoverlap.harness.hf_configs import (
        HF_MODELS,
        hf_models,
        pinned_revisions,
        write_hf_cache,
    )
    from mbridge_epoverlap.harness.mbridge_job import installed_perf_recipe_names
    from mbridge_epoverlap.harness.recipe_facts import recipe_values
    from mbridge_epoverlap.recipes.loader import family_of

    perf_names = installed_perf_recipe_names()
    recipes: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name in sorted(models or HF_MODELS):
        family = family_of(name)
        perf = importlib.import_module(f"megatron.bridge.perf_recipes.{family}")
        try:
            library = importlib.import_module(f"megatron.bridge.recipes.{family}")
        except ImportError:  # a perf family without a library package of that name (glm_moe_dsa)
            library = None
        for model_id, config, code in hf_models(name):
            write_hf_cache(home, model_id, config, pinned_revisions(model_id), code)
        builds = [(perf, function, _GPU.search(function).group(1)) for function in perf_names
                  if _workload_of(function) == name and hasattr(perf, function)]
        builds += [(library, f"{name}_{task}_config", None) for task in LIBRARY_TASKS
                   if library is not None and hasattr(library, f"{name}_{task}_config")]
        for module, function, gpu in builds:
            # A GPU whose compute capability the catalog does not know is built without one: Megatron-Bridge
            # then keeps the flex backend the recipe asks for instead of gating it on a made-up architecture.
            known = gpu is not None and gpu_facts(gpu).compute_capability is not None
            try:
                with target_gpu(gpu if known else None):
                    container = getattr(module, function)()
            except Exception as exc:  # noqa: BLE001 - a recipe this release cannot build is left out, and said
                failed[f"{module.__name__}.{function}"] = _first_line(f"{type(exc).__name__}: {exc}")
                continue
            recipes[f"{module.__name__}.{function}"] = recipe_values(container)
    for name, error in failed.items():
        print(f"not built: {name}: {error}", file=sys.stderr)
    from mbridge_epoverlap.config.versions import bridge_release_of, bridge_rules

    release = bridge_rules(bridge_release_of(megatron.bridge.__version__)).version
    head = {"version": megatron.bridge.__version__, "core_version": megatron.core.__version__, "release": release}
    commit = _source_commit("bridge")
    if release == "main" and commit:
        head["commit"] = commit
    # What this release cannot build on any machine is kept with its error, so a job asking for it is told why.
    return {**head, "not_built": dict(sorted(failed.items())), "recipes": dict(sorted(recipes.items()))}


def _first_line(text: str) -> str:
    """The error's first line, without the paths of this machine (the fixture is the same wherever it is built)."""
    line = text.strip().splitlines()[0] if text.strip() else text
    return re.sub(r"'?/[^' ]*/(site-packages|src)/", "'", line)[:300]


def _workload_of(function: str) -> str | None:
    """The workload of a flat perf recipe name (`qwen3_30b_a3b` of `qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config`):
    a prefix test would take `qwen3_vl_30b_a3b`'s recipes for another workload's."""
    from mbridge_epoverlap.recipes.bridge_models import recipe_parts

    parts = recipe_parts(function)
    return parts["model"] if parts else None


def _source_commit(name: str) -> str | None:
    """The commit of a source tree the environment was built from (`setup_bridge_main_venv.sh` records them)."""
    sources = Path(sys.prefix) / "SOURCES"
    if not sources.exists():
        return None
    for line in sources.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return parts[1]
    return None


def render(facts: dict[str, Any]) -> str:
    """The fixture's text: one recipe a line, keys sorted (small diffs when a release changes a recipe)."""
    head = {key: value for key, value in facts.items() if key != "recipes"}
    lines = [f" {json.dumps(key)}: {json.dumps(value)}," for key, value in sorted(head.items())]
    items = [f"  {json.dumps(name)}: {json.dumps(values, sort_keys=True)}"
             for name, values in sorted(facts["recipes"].items())]
    lines += [' "recipes": {', ",\n".join(items)]
    return "{\n" + "\n".join(lines) + "\n }\n}\n"


def main(argv: list[str]) -> int:
    # --models NAME[,NAME]: only those project recipes (a quick check of the generator against a fixture)
    models = None
    if len(argv) == 3 and argv[1] == "--models":
        models = argv[2].split(",")
        argv = argv[:1]
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with contextlib.redirect_stdout(sys.stderr):  # the libraries log to stdout
        facts = extract(models)
    Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[0]).write_text(render(facts), encoding="utf-8")
    print(f"{len(facts['recipes'])} recipes of Megatron-Bridge {facts['version']} ({facts['release']}) written to "
          f"{argv[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
