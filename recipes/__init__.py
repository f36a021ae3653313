"""Recipes: Python functions `name(task="pretrain") -> RunConfig`, one per workload.

Installed as `mbridge_epoverlap.recipes`; found by name (`-mr qwen3_30b_a3b`) through
`mbridge_epoverlap.recipes.loader.load_recipe`, which also loads a recipe from a file path.
`mbridge_epoverlap.recipes.cpu_case.cpu_overlap_case` shrinks one for the CPU EP-overlap A/B.
The workloads of Megatron-Bridge's perf recipes that the project does not write out by hand (GPT-OSS, Kimi K2,
DeepSeek-V4, Qwen3-Next, Nemotron 3, the Qwen VL MoEs, GLM-5) take their recipe from Bridge's (`bridge_models`).
"""

from mbridge_epoverlap.recipes.bridge_models import WORKLOADS, recipe_functions
from mbridge_epoverlap.recipes.dbrx import dbrx
from mbridge_epoverlap.recipes.deepseek import deepseek_v3
from mbridge_epoverlap.recipes.mixtral import mixtral_8x22b
from mbridge_epoverlap.recipes.qwen3 import qwen3_30b_a3b, qwen3_235b_a22b

RECIPES = {
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "qwen3_235b_a22b": qwen3_235b_a22b,
    "deepseek_v3": deepseek_v3,
    "mixtral_8x22b": mixtral_8x22b,
    "dbrx": dbrx,
    **recipe_functions(),
}

# Model families as run_script.py's -m/--model_family_name names them (Megatron-Bridge's `perf_recipes/` folders,
# and the project's own Mixtral and DBRX, which Megatron-Bridge has no recipe for).
FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen": ("qwen3_30b_a3b", "qwen3_235b_a22b"),
    "deepseek": ("deepseek_v3",),
    "mixtral": ("mixtral_8x22b",),
    "dbrx": ("dbrx",),
}
for _workload in WORKLOADS:
    FAMILIES[_workload.family] = (*FAMILIES.get(_workload.family, ()), _workload.name)

DEFAULT_RECIPE = "qwen3_30b_a3b"

__all__ = ["DEFAULT_RECIPE", "FAMILIES", "RECIPES", "dbrx", "deepseek_v3", "mixtral_8x22b", "qwen3_235b_a22b",
           "qwen3_30b_a3b"]
