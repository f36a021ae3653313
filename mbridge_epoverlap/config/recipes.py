"""Finding recipes: by name from the installed package, or from a Python file a user gives.

`load_recipe("qwen3_30b_a3b", "sft")`, `load_recipe("my_recipes.py:my_moe")`, or
`load_recipe("path/to/recipe.py")` (the file's single recipe function, or one named `recipe`).
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.errors import UsageError


def recipe_names() -> list[str]:
    from mbridge_epoverlap.recipes import RECIPES

    return list(RECIPES)


def family_of(name: str) -> str | None:
    from mbridge_epoverlap.recipes import FAMILIES

    return next((family for family, names in FAMILIES.items() if name in names), None)


def load_recipe(name_or_path: str, task: str = "pretrain") -> RunConfig:
    """Build the RunConfig of a recipe.

    Raises:
        UsageError: unknown name (listing the known ones), unreadable file, or a file without a
            recipe function.
    """
    from mbridge_epoverlap.recipes import RECIPES

    if name_or_path in RECIPES:
        cfg = RECIPES[name_or_path](task)
    else:
        cfg = _from_file(name_or_path, task)
    if not isinstance(cfg, RunConfig):
        raise UsageError(f"recipe {name_or_path!r} returned {type(cfg).__name__}, expected a RunConfig")
    return cfg


def _from_file(spec: str, task: str) -> RunConfig:
    from mbridge_epoverlap.recipes import RECIPES

    path_text, _, function_name = spec.partition(":")
    path = Path(path_text)
    if path.suffix != ".py" or not path.is_file():
        raise UsageError(f"unknown recipe {spec!r}; known recipes: {', '.join(RECIPES)} "
                         "(or give a path to a .py file, optionally FILE.py:FUNCTION)")
    module_spec = importlib.util.spec_from_file_location(f"_user_recipe_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"cannot load recipe file {path}")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise UsageError(f"recipe file {path} failed to import: {type(exc).__name__}: {exc}") from None
    functions = {
        name: fn for name, fn in inspect.getmembers(module, inspect.isfunction)
        if fn.__module__ == module.__name__ and not name.startswith("_")
    }
    if function_name:
        if function_name not in functions:
            raise UsageError(f"recipe file {path} has no function {function_name!r}; it has {sorted(functions)}")
        return functions[function_name](task)
    if "recipe" in functions:
        return functions["recipe"](task)
    if len(functions) == 1:
        return next(iter(functions.values()))(task)
    raise UsageError(f"recipe file {path} has {len(functions)} public functions {sorted(functions)}; "
                     f"name one as {path}:FUNCTION")
