"""The import contracts (pyproject.toml, [tool.importlinter]) hold, and the check can fail.

  test_the_contracts_hold          `lint-imports` on this tree: every contract KEPT.
  test_a_planted_* (three)         negative controls: the packages copied to a temporary
                                   directory with one violation planted each, and the contract
                                   it breaks named BROKEN (the others KEPT):
                                     a cycle in kvpool (keys -> connector, which imports keys)
                                       -> no-cycles and kvpool-layers;
                                     kvpool importing the harness -> kvpool-alone (and,
                                       through it, faults-below-harness and both layers);
                                     the renderer importing a command (harness.report.render ->
                                       harness.plan, which imports it) -> no-cycles and
                                       harness-layers.
  test_no_import_by_literal_name_crosses_a_boundary
                                   what import-linter cannot see: importlib.import_module /
                                   __import__ with a literal name, in kvpool (not harness,
                                   faults, fixtures, reports) and faults (not harness,
                                   reports, fixtures); with its own planted control.

import-linter counts imports inside functions as any other; a name built at run time is
seen by neither check.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvpool", "harness", "faults", "fixtures")
CONTRACTS = ("kvpool-alone", "faults-below-harness", "no-cycles", "kvpool-layers", "harness-layers")
NAMES = {  # contract id -> the name lint-imports reports it by (pyproject.toml)
    "kvpool-alone": "kvpool imports nothing of the harness, the faults or the fixtures",
    "faults-below-harness": "the faults wrap kvpool and import nothing of the harness or the fixtures",
    "no-cycles": "no import cycles among the modules and folders of any package",
    "kvpool-layers": "kvpool's layers, each importing only those below it",
    "harness-layers": "the harness's rooms, each importing only those below it",
}

def lint_imports(tree: Path) -> tuple[int, str]:
    """Run lint-imports on `tree` (its pyproject.toml, its packages first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "--no-cache", "--no-logo"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def verdicts(output: str) -> dict[str, str]:
    """contract id -> "KEPT" / "BROKEN", from lint-imports' summary lines."""
    out = {}
    for cid, name in NAMES.items():
        for line in output.splitlines():
            if line.startswith(name + " "):
                out[cid] = line.rsplit(" ", 1)[-1]
    return out


def test_the_contracts_hold():
    rc, output = lint_imports(ROOT)
    assert rc == 0, output
    assert verdicts(output) == {c: "KEPT" for c in CONTRACTS}, output


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The packages' Python files and pyproject.toml, copied."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg,
                        ignore=lambda d, names: [n for n in names if n == "__pycache__"
                                                 or (Path(d, n).is_file() and not n.endswith(".py"))])
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(copy: Path, module: str, line: str) -> None:
    path = copy / (module.replace(".", "/") + ".py")
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


def broken(copy: Path) -> tuple[set[str], str]:
    rc, output = lint_imports(copy)
    v = verdicts(output)
    assert set(v) == set(CONTRACTS), output  # every contract was checked
    assert (rc != 0) == ("BROKEN" in v.values()), output
    return {c for c, r in v.items() if r == "BROKEN"}, output


def test_a_planted_cycle_in_kvpool_breaks_no_cycles_and_the_layers(copy):
    plant(copy, "kvpool.keys", "import kvpool.connector  # planted: connector imports keys")
    found, output = broken(copy)
    assert found == {"no-cycles", "kvpool-layers"}, output
    assert "kvpool.keys -> kvpool.connector" in output, output


def test_a_planted_import_of_the_harness_breaks_kvpool_alone(copy):
    plant(copy, "kvpool.digest", "import harness.gate  # planted")
    found, output = broken(copy)
    # The same import is also one of the harness by the faults (faults -> kvpool.digest ->
    # harness.gate) and a way up the layers through the harness: those contracts see it too.
    assert found == {"kvpool-alone", "faults-below-harness", "kvpool-layers", "harness-layers"}, output
    assert "kvpool.digest -> harness.gate" in output, output


def test_a_planted_cycle_in_the_harness_breaks_no_cycles_and_its_layers(copy):
    plant(copy, "harness.report.render", "from harness.plan import plan  # planted: plan imports the renderer")
    found, output = broken(copy)
    assert found == {"no-cycles", "harness-layers"}, output
    assert "harness.report.render -> harness.plan" in output, output


# -- imports by literal name (importlib), which import-linter does not see ------------------------

RULES = {
    "kvpool": ("harness", "faults", "reports", "fixtures"),
    "faults": ("harness", "reports", "fixtures"),
}


def imported_by_name(path: Path) -> list[tuple[int, str]]:
    """Every importlib.import_module / __import__ call with a literal name in a file."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for path in sorted((root / package).rglob("*.py"))
            for line, module in imported_by_name(path) if module.split(".")[0] in forbidden]


@pytest.mark.parametrize("package", sorted(RULES))
def test_no_import_by_literal_name_crosses_a_boundary(package):
    assert violations(package, RULES[package]) == []


def test_the_walk_sees_imports_by_literal_name(tmp_path):
    """The check can fail: a planted package with each kind of import by name is caught."""
    pkg = tmp_path / "kvpool"
    pkg.mkdir()
    (pkg / "a.py").write_text("import importlib\nimportlib.import_module('harness.report.render')\n")
    (pkg / "b.py").write_text("def f():\n    return __import__('faults.backend')\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('kvpool.keys')\n")
    assert violations("kvpool", RULES["kvpool"], tmp_path) == [
        "kvpool/a.py:2 imports harness.report.render", "kvpool/b.py:2 imports faults.backend"]
