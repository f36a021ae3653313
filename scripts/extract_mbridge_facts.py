#!/usr/bin/env python3
"""Read facts from a released Megatron-Bridge wheel without importing it: recipe names and config fields.

The wheel is pure Python (`pip download --no-deps --python-version 3.12 --only-binary=:all: megatron-bridge`).
The output JSON is the test fixture of the recipe lookup and of the job entry's field names:

    version          the wheel's version
    perf_recipes     family -> flat performance recipe function names (`megatron.bridge.perf_recipes.<family>`)
    recipes          family -> library recipe names a family exports (`megatron.bridge.recipes.<family>.__all__`)
    config_fields    config class -> its dataclass field names (ConfigContainer and the sections the job writes)

Usage: python scripts/extract_mbridge_facts.py megatron_bridge-X-py3-none-any.whl OUT.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import PurePosixPath

_DEF = re.compile(r"^def ([A-Za-z0-9_]+_config)\(", re.MULTILINE)
CONFIG_CLASSES = {
    "megatron/bridge/training/config.py": ("ConfigContainer", "TrainingConfig", "ProfilingConfig", "LoggerConfig",
                                           "TokenizerConfig", "DistributedDataParallelConfig"),
    "megatron/bridge/training/comm_overlap.py": ("CommOverlapConfig",),
}


def _family_names(archive: zipfile.ZipFile, package: str, keep: re.Pattern | None = None) -> dict[str, list[str]]:
    found: dict[str, set[str]] = {}
    for name in archive.namelist():
        path = PurePosixPath(name)
        if not name.startswith(package) or path.suffix != ".py" or len(path.parts) < 5:
            continue
        family = path.parts[3]
        if family.startswith("_"):
            continue
        for function in _DEF.findall(archive.read(name).decode("utf-8", errors="replace")):
            if not function.startswith("_") and (keep is None or keep.search(function)):
                found.setdefault(family, set()).add(function)
    return {family: sorted(names) for family, names in sorted(found.items())}


def _exported(archive: zipfile.ZipFile, package: str, keep: re.Pattern) -> dict[str, list[str]]:
    """family -> the names a family package exports in `__all__` that match `keep`."""
    found = {}
    for name in archive.namelist():
        path = PurePosixPath(name)
        if not name.startswith(package) or path.name != "__init__.py" or len(path.parts) != 5:
            continue
        for node in ast.parse(archive.read(name).decode()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                names = sorted(n for n in ast.literal_eval(node.value) if keep.search(n))
                if names:
                    found[path.parts[3]] = names
    return dict(sorted(found.items()))


def _fields(source: str, classes: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            out[node.name] = [item.target.id for item in node.body
                              if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    return out


def extract(wheel: str) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        info = archive.read("megatron/bridge/package_info.py").decode()
        version = ".".join(re.search(rf"^{n} = (\d+)", info, re.MULTILINE).group(1)
                           for n in ("MAJOR", "MINOR", "PATCH"))
        fields: dict[str, list[str]] = {}
        for path, classes in CONFIG_CLASSES.items():
            fields.update(_fields(archive.read(path).decode(), classes))
        return {
            "version": version,
            "perf_recipes": _family_names(archive, "megatron/bridge/perf_recipes/"),
            "recipes": _exported(archive, "megatron/bridge/recipes/",
                                 re.compile(r"_(pretrain|sft|peft|finetune)_config$")),
            "config_fields": dict(sorted(fields.items())),
        }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    facts = extract(argv[0])
    with open(argv[1], "w", encoding="utf-8") as out:
        json.dump(facts, out, indent=1, sort_keys=False)
        out.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
