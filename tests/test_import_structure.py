"""The package's import graph: calls run one way.

Read from the source (nothing is imported): the imports a module makes when it is loaded,
leaving out those inside functions (made when called) and under ``if TYPE_CHECKING:``. No
circle may run through them, and the cache imports neither the runtime, the metrics nor the
plugin at all (they build on it; metrics subscribe to it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sglang_hybrid.replay.shared_data import REPO_ROOT

PACKAGE = "sglang_hybrid"
# Where each package's source lives (the kernels are importable as sglang_hybrid.kernels).
SOURCE_ROOTS = {PACKAGE: REPO_ROOT / PACKAGE, f"{PACKAGE}.kernels": REPO_ROOT / "kernels"}
CACHE_MAY_NOT_IMPORT = (f"{PACKAGE}.runtime", f"{PACKAGE}.metrics", f"{PACKAGE}.plugin")


def _modules() -> dict[str, Path]:
    modules = {}
    for package, root in SOURCE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            modules.setdefault(name, path)
    return modules


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, node: ast.AST) -> list[str]:
    """The package modules an import statement of ``module`` loads."""
    is_package = MODULES[module].name == "__init__.py"
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    # ``from package import name`` loads the submodule when ``name`` is one.
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _imports(module: str, *, load_time_only: bool) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if load_time_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if load_time_only and isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update(name for name in _imported(module, child) if name.startswith(PACKAGE))
            visit(child)

    visit(tree)
    # Importing a module loads the packages above it first, but for the importer's own
    # packages: those are loading already (a package that imports its submodules).
    own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    loaded = set()
    for name in found:
        parts = name.split(".")
        loaded.add(name)
        loaded.update(".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) not in own_packages)
    return {name for name in loaded if name in MODULES and name != module}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return circles


def test_the_graph_is_read_from_the_source():
    assert f"{PACKAGE}.cache.semantic_cache" in MODULES and f"{PACKAGE}.kernels" in MODULES
    assert f"{PACKAGE}.cache.planning" in _imports(f"{PACKAGE}.cache.semantic_cache", load_time_only=True)
    # A relative import, a package, a package loaded above a module, an import under
    # TYPE_CHECKING and one inside a function.
    assert f"{PACKAGE}.cache" in _imports(f"{PACKAGE}.plugin", load_time_only=True)
    policies = _imports(f"{PACKAGE}.replay.policies", load_time_only=True)
    assert {f"{PACKAGE}.replay.cost_model", f"{PACKAGE}.replay.policies.semantic"} <= policies
    assert f"{PACKAGE}.harness.pools" not in _imports(f"{PACKAGE}.replay.policies.semantic", load_time_only=True)
    assert f"{PACKAGE}.harness.pools" in _imports(f"{PACKAGE}.replay.policies.semantic", load_time_only=False)
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_package_modules():
    graph = {module: _imports(module, load_time_only=True) for module in MODULES}
    assert _circles(graph) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(f"{PACKAGE}.cache")))
def test_the_cache_imports_no_runtime_metrics_or_plugin(module):
    imported = _imports(module, load_time_only=False)
    assert not {name for name in imported if name.startswith(CACHE_MAY_NOT_IMPORT)}
