"""Which Megatron-Bridge recipe a GPU job builds, chosen as Megatron-Bridge's `run_script.py` chooses it.

By default a flat performance recipe, `megatron.bridge.perf_recipes.<family>.
{model}_{task}_{N}gpu_{gpu}_{precision}[_{variant}]_config`: the exact GPU count when it exists, else the
default count (the largest, or the smaller one Megatron-Bridge names for a few workloads). With
`--use_recipes` the library recipe `megatron.bridge.recipes.<family>.{model}_{task}_config`. The lookup
works on a list of names, so it is tested against a released wheel's names without importing it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.recipes.bridge_models import recipe_parts

# Megatron-Bridge's spelling of each -c value in recipe names.
PRECISION_NAMES = {"bf16": "bf16", "fp8_cs": "fp8cs", "fp8_ds": "fp8ds", "fp8_mx": "fp8mx", "fp8_sc": "fp8sc",
                   "nvfp4": "nvfp4"}
# Workloads whose default flat recipe is not the largest GPU count (scripts/performance/utils/utils.py).
DEFAULT_GPU_COUNTS = {
    ("nemotronh_56b", "pretrain", "b200", "fp8cs", None): 64,
    ("nemotronh_56b", "pretrain", "gb300", "fp8cs", None): 64,
    **{("qwen3_30b_a3b", "pretrain", gpu, precision, None): count
       for gpu, count in (("b200", 8), ("gb200", 8), ("gb300", 8), ("h100", 16)) for precision in ("bf16", "fp8cs")},
}


@dataclass(frozen=True)
class BridgeRecipe:
    """The recipe a GPU job builds.

    Attributes:
        module: the module that holds it (`megatron.bridge.perf_recipes.qwen`, `megatron.bridge.recipes.qwen`).
        function: the function name.
        kind: "performance" or "library".
        num_gpus: the GPU count a performance recipe was tuned for (None for library recipes).
    """

    module: str
    function: str
    kind: str
    num_gpus: int | None = None

    def describe(self) -> str:
        count = f", tuned for {self.num_gpus} GPUs" if self.num_gpus else ""
        return f"{self.module}.{self.function} ({self.kind} recipe{count})"


def precision_name(compute_dtype: str | None) -> str:
    dtype = (compute_dtype or "bf16").lower()
    return PRECISION_NAMES.get(dtype, dtype.replace("_", ""))


def variant_suffix(config_variant: str | None) -> str:
    """`_variant`, or "" for none (and for the retired v1/v2 labels, which name the canonical recipe)."""
    if config_variant is None or config_variant.lower() in ("v1", "v2"):
        return ""
    return f"_{config_variant.lower()}"


def perf_recipe_function(model: str, task: str, num_gpus: int, gpu: str, compute_dtype: str | None,
                         config_variant: str | None = None) -> str:
    return f"{model}_{task}_{num_gpus}gpu_{gpu}_{precision_name(compute_dtype)}{variant_suffix(config_variant)}_config"


def choose_perf_recipe(names: Iterable[str], *, family: str, model: str, task: str, gpu: str,
                       compute_dtype: str | None, num_gpus: int | None, config_variant: str | None = None
                       ) -> BridgeRecipe:
    """The flat performance recipe Megatron-Bridge's run_script.py picks among `names`.

    Raises:
        UsageError: no performance recipe for this model, task, GPU, precision and variant; the message
            names what the workload has (`available_configs`) and suggests `--use_recipes`.
    """
    names = list(names)
    precision = precision_name(compute_dtype)
    suffix = variant_suffix(config_variant)
    wanted_parts = (model, task, gpu, precision, suffix.lstrip("_") or "default")
    matches = sorted((int(parts["count"]), name) for name in names if (parts := recipe_parts(name))
                     and (parts["model"], parts["task"], parts["gpu"], parts["precision"], parts["variant"])
                     == wanted_parts)
    module = f"megatron.bridge.perf_recipes.{family}"
    if num_gpus is not None:
        exact = [name for count, name in matches if count == num_gpus]
        if exact:
            return BridgeRecipe(module, exact[0], "performance", num_gpus)
    if not matches:
        raise UsageError(f"no Megatron-Bridge performance recipe for {model}/{task}/{gpu}/{precision}"
                         f"/{config_variant or 'default'}; {available_configs(names, model, task, gpu, precision)}; "
                         "pick one of those with -g/-c/-cv/--task, or build the library recipe with --use_recipes")
    wanted = DEFAULT_GPU_COUNTS.get((model, task, gpu, precision, suffix.lstrip("_") or None))
    for count, name in matches if wanted is not None else ():
        if count == wanted:
            return BridgeRecipe(module, name, "performance", count)
    count, name = matches[-1]
    return BridgeRecipe(module, name, "performance", count)


# -c spelling of each precision in recipe names.
FLAG_PRECISION = {name: flag for flag, name in PRECISION_NAMES.items()}


def configs_of(names: Iterable[str], model: str) -> list[dict[str, str]]:
    """Every performance config of `model` among `names`, as `recipe_parts`."""
    return [parts for name in names if (parts := recipe_parts(name)) and parts["model"] == model]


def available_configs(names: Iterable[str], model: str, task: str, gpu: str, precision: str) -> str:
    """What the workload has, narrowed to the first part of the request it lacks (task, then GPU, then precision,
    then variant): the words of a usage error."""
    configs = configs_of(names, model)
    if not configs:
        return f"Megatron-Bridge has no performance recipe for workload {model!r}"
    tasks = sorted({c["task"] for c in configs})
    if task not in tasks:
        return f"{model} has --task {', '.join(tasks)}"
    configs = [c for c in configs if c["task"] == task]
    gpus = sorted({c["gpu"] for c in configs})
    if gpu not in gpus:
        return f"{model} {task} has -g {', '.join(gpus)}"
    configs = [c for c in configs if c["gpu"] == gpu]
    precisions = sorted({FLAG_PRECISION.get(c["precision"], c["precision"]) for c in configs})
    if precision not in {c["precision"] for c in configs}:
        return f"{model} {task} on {gpu} has -c {', '.join(precisions)}"
    found = sorted({c["variant"] for c in configs if c["precision"] == precision})
    return f"{model} {task} on {gpu} {precision} has -cv {', '.join(found)}"


def library_recipe(family: str, model: str, task: str) -> BridgeRecipe:
    """The library recipe `--use_recipes` builds (`{model}_peft_config` for peft)."""
    return BridgeRecipe(f"megatron.bridge.recipes.{family}", f"{model}_{task}_config", "library")
