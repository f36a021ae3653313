"""A static import graph of the project's Python files (every `import`, also inside functions and under
`TYPE_CHECKING`), and the three properties the layout keeps: no circle, nothing imported from a higher
layer, no private name imported across modules.

Run as a script it prints what it finds: `python -m tests.unit_tests.layout.import_graph`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "mbridge_epoverlap"
SCANNED = (PACKAGE, "benchmarks", "scripts")

# Lowest first: a module may import its own layer and the layers below it. A prefix names a package or a
# module; the longest matching prefix decides.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mbridge_epoverlap.errors", "mbridge_epoverlap.envvars", "mbridge_epoverlap.fields",
     "mbridge_epoverlap.arg_types", "mbridge_epoverlap.cli_io", "mbridge_epoverlap.machine",
     "mbridge_epoverlap.memory"),
    ("mbridge_epoverlap.gpus",),
    # The process supervisor needs nothing but the errors; the M2N benchmark (comm) starts its ranks with it.
    ("mbridge_epoverlap.launch",),
    ("mbridge_epoverlap.config",),
    ("mbridge_epoverlap.recipes",),
    ("mbridge_epoverlap.comm",),
    ("mbridge_epoverlap.schedule",),
    ("mbridge_epoverlap.moe",),
    ("mbridge_epoverlap.profiling",),
    ("mbridge_epoverlap.runtime",),
    ("mbridge_epoverlap.serving.model", "mbridge_epoverlap.serving.planning", "mbridge_epoverlap.serving.decoding"),
    ("mbridge_epoverlap.serving.workers",),
    ("mbridge_epoverlap.serving.elastic",),
    ("mbridge_epoverlap.serving.engine",),
    # The server is below the commands: `serve --http` starts it, it reads no command module.
    # The OpenAI API's fields and answers (`serving.api`) share the server's layer: they read its text codec.
    ("mbridge_epoverlap.serving.frontend", "mbridge_epoverlap.serving.api"),
    ("mbridge_epoverlap.serving.cli",),
    ("mbridge_epoverlap.harness",),
    # Command modules: a command may use every layer (`*/cli.py` wires flags to the layers below it).
    ("mbridge_epoverlap.cli", "mbridge_epoverlap.config.cli", "mbridge_epoverlap.profiling.cli",
     "mbridge_epoverlap.schedule.cli", "mbridge_epoverlap.comm.cli", "mbridge_epoverlap.serving", "mbridge_epoverlap"),
    ("benchmarks", "scripts"),
)


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    names: tuple[str, ...]
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> Iterator[Path]:
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "recipes" in path.parts and top == PACKAGE:
                continue  # mbridge_epoverlap/recipes is a link to recipes/; scanned under its package name
            yield path
    yield from sorted((ROOT / "recipes").rglob("*.py"))


def _name_of(path: Path) -> str:
    name = module_name(path)
    return PACKAGE + "." + name if name.split(".")[0] == "recipes" else name


def modules() -> dict[str, Path]:
    return {_name_of(p): p for p in project_files()}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(known: dict[str, Path]) -> list[Edge]:
    out: list[Edge] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: dict[str, str] = {}  # local name -> project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _known_prefix(alias.name, known)
                    if target:
                        out.append(Edge(name, target, (), node.lineno))
                        if alias.asname:
                            bound[alias.asname] = target
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in known:  # `from package import module`
                        out.append(Edge(name, full, (), node.lineno))
                        bound[alias.asname or alias.name] = full
                    else:
                        target = _known_prefix(base, known)
                        if target:
                            out.append(Edge(name, target, (alias.name,), node.lineno))
        # `module._name` on a bound module is a private name used across modules too.
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                out.append(Edge(name, bound[node.value.id], (node.attr,), node.lineno))
    return out


def _known_prefix(dotted: str, known: dict[str, Path]) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in known:
            return candidate
    return None


def layer_of(module: str) -> int:
    best, best_len = len(LAYERS), -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def circles(graph_edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in graph_edges:
        if e.importer != e.imported and not _is_parent(e.imported, e.importer):
            graph.setdefault(e.importer, set()).add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_parent(package: str, module: str) -> bool:
    """A package's `__init__` runs before its modules: importing it from inside is no circle of modules."""
    return module.startswith(package + ".")


def upward(graph_edges: list[Edge]) -> list[Edge]:
    return [e for e in graph_edges if layer_of(e.imported) > layer_of(e.importer)]


def private_imports(graph_edges: list[Edge]) -> list[Edge]:
    return [e for e in graph_edges if e.importer != e.imported
            and any(n.startswith("_") and not n.startswith("__") for n in e.names)]


def report() -> dict[str, list]:
    known = modules()
    found = edges(known)
    return {"circles": circles(found), "upward": upward(found), "private": private_imports(found)}


if __name__ == "__main__":
    for kind, items in report().items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print("  ", item if not isinstance(item, Edge) else f"{item.importer}:{item.line} -> {item.imported} "
                  f"{', '.join(item.names)}")
