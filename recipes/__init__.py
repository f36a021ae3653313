"""Recipes: Python functions `name(task="pretrain") -> RunConfig`, one per workload.

Installed as `mbridge_epoverlap.recipes`; found by name (`-mr qwen3_30b_a3b`) through
`mbridge_epoverlap.recipes.loader.load_recipe`, which also loads a recipe from a file path.
`mbridge_epoverlap.recipes.cpu_case.cpu_overlap_case` shrinks one for the CPU EP-overlap A/B.
"""

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
}

# Model families as run_script.py's -m/--model_family_name names them.
FAMILIES = {
    "qwen": ("qwen3_30b_a3b", "qwen3_235b_a22b"),
    "deepseek": ("deepseek_v3",),
    "mixtral": ("mixtral_8x22b",),
    "dbrx": ("dbrx",),
}

DEFAULT_RECIPE = "qwen3_30b_a3b"

__all__ = ["DEFAULT_RECIPE", "FAMILIES", "RECIPES", *RECIPES]
