"""The shape of the product code (docs/architecture.md, "Code map"): small files, small
classes, short constructors, layers that import downwards only, and no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("node", "protocol", "verification")  # each imports only those after it
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 300
MAX_INIT_PARAMS = 6


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = (path, ast.parse(path.read_text(), str(path)))
    return found


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The product modules ``name`` imports, anywhere in it (a function's own imports and
    those for type checking included)."""
    package = name if MODULES[name][0].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


def test_no_product_file_is_over_the_line_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path, _ in MODULES.values()
        if (n := path.read_text().count("\n")) > MAX_FILE_LINES
    }
    assert not long, long


def test_no_class_is_over_the_line_limit_and_no_constructor_takes_more_than_six() -> None:
    big, wide = {}, {}
    for name, (_, tree) in MODULES.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            where = f"{name}.{node.name}"
            if (lines := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                big[where] = lines
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    count = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
                    count += (a.vararg is not None) + (a.kwarg is not None)
                    if count > MAX_INIT_PARAMS:
                        wide[where] = count
    assert not big, big
    assert not wide, wide


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer: str) -> None:
    above = set(LAYERS[: LAYERS.index(layer)])
    upward = {
        name: sorted(t for t in _imports(name, tree) if t.split(".")[0] in above)
        for name, (_, tree) in MODULES.items()
        if name.split(".")[0] == layer
    }
    upward = {k: v for k, v in upward.items() if v}
    assert not upward, upward


def test_no_modules_import_each_other_in_a_cycle() -> None:
    graph = {name: _imports(name, tree) for name, (_, tree) in MODULES.items()}
    # a package's __init__ that hands names on is not a module of its own here
    faces = {n for n, (p, t) in MODULES.items() if p.name == "__init__.py"}
    graph = {n: {t for t in ts if t not in faces} for n, ts in graph.items() if n not in faces}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles
