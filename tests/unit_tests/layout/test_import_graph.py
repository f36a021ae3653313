"""The layout's rules, checked on the source: no import circle, nothing imported from a higher layer, no
private name used across modules, and no folder of the package that a newcomer cannot take in at once."""

from __future__ import annotations

import ast

import pytest

from tests.unit_tests.layout import import_graph as graph

MAX_MODULES_PER_FOLDER = 11  # "about ten"


@pytest.fixture(scope="module")
def found() -> list[graph.Edge]:
    return graph.edges(graph.modules())


def _show(edges: list[graph.Edge]) -> str:
    return "\n".join(f"{e.importer}:{e.line} -> {e.imported} {', '.join(e.names)}" for e in edges)


def test_no_import_circle(found):
    assert graph.circles(found) == []


def test_nothing_is_imported_from_a_higher_layer(found):
    bad = graph.upward(found)
    assert not bad, _show(bad)


def test_no_private_name_is_imported_across_modules(found):
    bad = graph.private_imports(found)
    assert not bad, _show(bad)


def test_the_checker_sees_each_kind_of_violation(tmp_path, monkeypatch):
    # A tiny tree with one of each: a circle a <-> b, an upward import low -> high, a private name.
    pkg = tmp_path / "mbridge_epoverlap"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from mbridge_epoverlap.low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from mbridge_epoverlap.low.a import _hidden\n")
    (pkg / "errors.py").write_text("from mbridge_epoverlap.low import a\n")
    for top in ("benchmarks", "scripts", "recipes"):
        (tmp_path / top).mkdir()
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    edges = graph.edges(graph.modules())
    assert graph.circles(edges) == [["mbridge_epoverlap.low.a", "mbridge_epoverlap.low.b"]]
    assert [(e.importer, e.imported) for e in graph.upward(edges)] == [("mbridge_epoverlap.errors",
                                                                         "mbridge_epoverlap.low.a")]
    assert [e.names for e in graph.private_imports(edges)] == [("_hidden",)]


def _package_folders():
    # The serving rooms and the process supervisor; config/ and harness/ are older and not split yet.
    root = graph.ROOT / graph.PACKAGE
    return sorted([*(root / "serving").rglob("__init__.py"), *(root / "launch").glob("__init__.py")])


@pytest.mark.parametrize("init", _package_folders(), ids=lambda p: str(p.parent.relative_to(graph.ROOT)))
def test_each_package_is_small_and_maps_its_modules(init):
    folder = init.parent
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder} holds {len(modules)} modules"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    if folder.name != "serving":  # each room says what each of its modules holds
        missing = [m for m in modules + [p.name for p in folder.iterdir() if (p / "__init__.py").exists()]
                   if f"`{m}`" not in doc]
        assert not missing, f"{init} does not map {missing}"


def _project_imports():
    """Every `from mbridge_epoverlap... import name` and `python -m mbridge_epoverlap...` in the scanned files."""
    import re

    found = set()
    for path in [*graph.project_files(), *(graph.ROOT / "tests").rglob("*.py")]:
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(graph.PACKAGE):
                found.update((node.module, alias.name) for alias in node.names)
        found.update((m, None) for m in re.findall(r"-m[\"', ]+(mbridge_epoverlap(?:\.\w+)+)", text))
    return sorted(found, key=str)


def test_every_import_of_the_package_resolves():
    # A module moved without its importers updated fails here, not only when a slow test reaches it.
    import importlib

    missing = []
    for module, name in _project_imports():
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        if name is not None and name != "*" and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, "\n".join(missing)
