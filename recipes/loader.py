"""Finding recipes: by name from this package (`RECIPES`), or from a Python file a user gives.

`load_recipe("qwen3_30b_a3b", "sft")`, `load_recipe("my_recipes.py:my_moe")`, or
`load_recipe("path/to/recipe.py")` (the file's single recipe function, or one named `recipe`).

The recipe-file contract: a public function `FUNCTION(task: str = "pretrain") -> RunConfig`, called
with the task ("pretrain" or "sft"). `RECIPE_FILE_CONTRACT` says it in the words error messages use.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.sizes import size_problems
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.recipes import FAMILIES, RECIPES

RECIPE_FILE_CONTRACT = ('a recipe file holds a function FUNCTION(task="pretrain") that returns a RunConfig '
                        "(see `mbridge-epoverlap validate --help`, section recipe files)")


def recipe_names() -> list[str]:
    return list(RECIPES)


def family_of(name: str) -> str | None:
    return next((family for family, names in FAMILIES.items() if name in names), None)


def load_recipe(name_or_path: str, task: str = "pretrain") -> RunConfig:
    """Build the RunConfig of a recipe.

    Raises:
        UsageError: unknown name (listing the known ones), unreadable file, or a file without a
            recipe function.
    """
    if name_or_path in RECIPES:
        cfg = RECIPES[name_or_path](task)
    else:
        cfg = _from_file(name_or_path, task)
    if not isinstance(cfg, RunConfig):
        raise UsageError(f"recipe {name_or_path!r} returned {type(cfg).__name__}, expected a RunConfig")
    return cfg


def _from_file(spec: str, task: str) -> RunConfig:
    path_text, _, function_name = spec.partition(":")
    path = Path(path_text)
    if path.suffix == ".py" and not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "not found"
        raise UsageError(f"recipe file {path} {what}; check the path, or use a built-in recipe: {', '.join(RECIPES)}")
    if path.suffix != ".py":
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
        chosen = function_name
    elif "recipe" in functions:
        chosen = "recipe"
    elif len(functions) == 1:
        chosen = next(iter(functions))
    else:
        raise UsageError(f"recipe file {path} has {len(functions)} public functions {sorted(functions)}; "
                         f"name one as {path}:FUNCTION")
    return _call_recipe(functions[chosen], path, chosen, task)


def _call_recipe(fn: object, path: Path, name: str, task: str) -> RunConfig:
    """Call a user's recipe function; its mistakes become one-line usage errors naming the contract."""
    import traceback

    where = f"{path}:{name}"
    try:
        inspect.signature(fn).bind(task)  # type: ignore[arg-type]
    except TypeError:
        signature = inspect.signature(fn)  # type: ignore[arg-type]
        raise UsageError(f"recipe {where}{signature} cannot be called with the task; {RECIPE_FILE_CONTRACT}") from None
    try:
        cfg = fn(task)  # type: ignore[operator]
    except UsageError:
        raise
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        line = f" (line {frames[-1].lineno})" if frames else ""
        raise UsageError(f"recipe {where} raised {type(exc).__name__}: {exc}{line}; fix the recipe file") from None
    if not isinstance(cfg, RunConfig):
        raise UsageError(f"recipe {where} returned {type(cfg).__name__}, not a RunConfig; {RECIPE_FILE_CONTRACT}")
    problems = size_problems(cfg)
    if problems:
        raise UsageError(f"recipe {where}: " + "; ".join(problems))
    return cfg
