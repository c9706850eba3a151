"""The system under test knows nothing of its nemesis: kvpool imports nothing from the
harness, the faults, the reports or the fixtures, at module level or inside a function
(importlib with a literal name included); and the faults import nothing from the harness
or the reports (the nemesis wraps the system, the harness drives both)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = {
    "kvpool": ("harness", "faults", "reports", "fixtures"),
    "faults": ("harness", "reports", "fixtures"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports: import statements anywhere in it, and calls of
    importlib.import_module / __import__ with a literal name."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(RULES))
def test_layering(package):
    assert violations(package, RULES[package]) == []


def test_the_walk_sees_imports_inside_functions_and_by_name(tmp_path):
    """The check can fail: a planted package with each kind of import is caught."""
    pkg = tmp_path / "kvpool"
    pkg.mkdir()
    (pkg / "a.py").write_text("import harness.gate\n")
    (pkg / "b.py").write_text("def f():\n    from faults.backend import FaultyBackend\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('harness.report.render')\n")
    (pkg / "d.py").write_text("from kvpool import keys\nimport fixturesque\n")
    assert violations("kvpool", RULES["kvpool"], tmp_path) == [
        "kvpool/a.py:1 imports harness.gate", "kvpool/b.py:2 imports faults.backend",
        "kvpool/c.py:2 imports harness.report.render"]
