"""The floor plan (issue 12): ``contract/`` stands on nothing of ours, ``backends/`` stands on
``contract/`` and never on ``router/``, and the engine core knows no HTTP."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module each file under ``package/`` imports (absolute names, lazy imports included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def offenders(package: str, *forbidden: str) -> list[str]:
    return [f"{path}: {name}" for path, names in imported_modules(package).items() for name in sorted(names)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_the_package_lists_are_not_empty() -> None:
    assert len(imported_modules("backends")) > 10 and len(imported_modules("contract")) >= 4


def test_backends_import_nothing_from_the_router() -> None:
    assert offenders("backends", "router") == []


def test_the_contract_stands_on_nothing_of_ours() -> None:
    assert offenders("contract", "router", "backends", "bench", "tests") == []


def test_the_engine_knows_no_http() -> None:
    assert offenders("backends/engine", "contract", "aiohttp", "backends.app", "backends.http_errors") == []
