"""The floor plan, checked on the source: the import graph of ``router/`` (every import, those under
``TYPE_CHECKING`` and inside functions included) has no cycle, in particular no pair of modules that
import each other; the data path points down (front -> proxy -> upstream); the proxy and the P/D
hand-off do not take the app's ``RouterState``; no module reaches into another's private names;
``contract/`` stands on nothing of ours, ``backends/`` on ``contract/`` and never on ``router/``, and the
engine core knows no HTTP."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the proxy's side of the data path (below the fronts, above the upstream client)
PROXY_MODULES = ("router.proxy", "router.pd", "router.attempt", "router.routes", "router.exchange")


def _modules(package: str) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imported(path: Path) -> Iterator[str]:
    """Every module name ``path`` imports (``from a.b import c`` gives ``a.b.c`` and ``a.b``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a name resolved to its nearest module)."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for imported in _imported(path):
            target = imported
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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


def _imports_of(graph: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    return {name: deps for name, deps in graph.items() if name == prefix or name.startswith(prefix + ".")}


def _offending(graph: dict[str, set[str]], importers: str | tuple[str, ...],
               forbidden: tuple[str, ...]) -> list[str]:
    names = (importers,) if isinstance(importers, str) else importers
    bad = []
    for name in names:
        for module, deps in _imports_of(graph, name).items():
            bad += [f"{module} -> {dep}" for dep in sorted(deps)
                    if any(dep == f or dep.startswith(f + ".") for f in forbidden)]
    return bad


def test_the_checker_sees_a_pair() -> None:
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_router_modules_import_no_cycle_and_no_pair() -> None:
    assert _cycles(_graph("router")) == []


def test_upstream_imports_nothing_of_the_fronts_or_the_proxy() -> None:
    assert _offending(_graph("router"), "router.upstream", ("router.front",) + PROXY_MODULES) == []


def test_the_proxy_imports_nothing_of_the_fronts() -> None:
    assert _offending(_graph("router"), PROXY_MODULES, ("router.front",)) == []


def test_the_data_path_is_given_its_collaborators_not_the_app_state() -> None:
    assert _offending(_graph("router"), PROXY_MODULES, ("router.state", "router.app")) == []


def _private_reaches(path: Path) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls`` and ``_name`` is nothing this module
    defines: a reach into another module's privates."""
    tree = ast.parse(path.read_text())
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            own.add(node.value)  # __slots__ entries
    reaches = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr not in own and node.attr != "_replace"  # namedtuple's public API
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return reaches


def test_no_router_module_reaches_into_another_ones_privates() -> None:
    assert [r for path in _modules("router").values() for r in _private_reaches(path)] == []


def _offenders(package: str, *forbidden: str) -> list[str]:
    """``module -> name`` for every import under ``package/`` of a module in ``forbidden`` (or below it)."""
    return sorted(f"{module} -> {name}" for module, path in _modules(package).items()
                  for name in set(_imported(path)) if any(name == f or name.startswith(f + ".") for f in forbidden))


def test_the_package_lists_are_not_empty() -> None:
    assert len(_modules("backends")) > 10 and len(_modules("contract")) >= 4 and len(_modules("router")) > 20


def test_backends_import_nothing_from_router() -> None:
    assert _offenders("backends", "router") == []


def test_the_contract_stands_on_nothing_of_ours() -> None:
    assert _offenders("contract", "router", "backends", "bench", "tests") == []


def test_rendering_stands_on_the_contract_alone() -> None:
    """``rendering/`` (render, derender, tokenizers, templates) is shared by the router and the
    backends: it imports neither of them."""
    assert len(_modules("rendering")) >= 3
    assert _offenders("rendering", "router", "backends", "bench", "tests") == []


def test_the_engine_knows_no_http() -> None:
    assert _offenders("backends/engine", "contract", "aiohttp", "backends.app", "backends.http_errors") == []


@pytest.mark.parametrize("package", ["contract", "rendering", "backends"])
def test_the_other_packages_import_no_cycle_either(package: str) -> None:
    assert _cycles(_graph(package)) == []


def test_no_module_of_ours_is_named_like_a_standard_library_module() -> None:
    """A module called ``inspect`` or ``queue`` reads as the standard library's to a newcomer (and
    shadows it for a script run from its folder): name modules for what they hold."""
    named = [str(path.relative_to(ROOT)) for package in ("router", "contract", "rendering", "backends")
             for path in _modules(package).values() if path.stem in sys.stdlib_module_names]
    assert named == []
