"""The import contracts (pyproject.toml, [tool.importlinter]) hold, and the check can fail.

  test_the_contracts_hold          `lint-imports` on this tree: every contract KEPT.
  test_every_part_of_kvpool_has_its_contract
                                   each folder of kvpool is the container of a layers contract.
  test_a_planted_* (four)          negative controls: the packages copied to a temporary
                                   directory with one violation planted each, and the contract
                                   it breaks named BROKEN (the others KEPT):
                                     a cycle between kvpool's parts (pool.keys -> connector,
                                       which imports the pool) -> no-cycles and kvpool-parts;
                                     a cycle inside a part (tier.record -> tier.registry)
                                       -> no-cycles and kvpool-tier;
                                     kvpool importing the harness -> kvpool-alone (and,
                                       through it, faults-below-harness and the layers);
                                     the renderer importing a command (kvgate.harness.report.render ->
                                       kvgate.harness.plan, which imports it) -> no-cycles and
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
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvpool", "kvgate")  # kvgate/ links to harness/, faults/ and fixtures/; a copy follows the links
NAMES = {c["id"]: c["name"] for c in  # contract id -> the name lint-imports reports it by
         tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
CONTRACTS = tuple(NAMES)


def test_every_part_of_kvpool_has_its_contract():
    """Each folder of kvpool is a container of a layers contract, and the parts themselves are."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    containers = {c for k in contracts if k["type"] == "layers" for c in k["containers"]}
    parts = {f"kvpool.{d.name}" for d in (ROOT / "kvpool").iterdir() if (d / "__init__.py").exists()}
    assert parts and parts | {"kvpool", "kvgate.harness"} <= containers, sorted(parts - containers)

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


def test_a_planted_cycle_between_kvpool_parts_breaks_no_cycles_and_the_parts(copy):
    plant(copy, "kvpool.pool.keys", "import kvpool.connector  # planted: the connector imports the pool")
    found, output = broken(copy)
    # Through the connector, the pool's keys now reach every part and most modules: the parts'
    # own layers see it too; the harness's and the faults' contracts do not.
    assert {"no-cycles", "kvpool-parts"} <= found, output
    assert not found & {"kvpool-alone", "faults-below-harness", "harness-layers"}, output
    assert "kvpool.pool.keys -> kvpool.connector" in output, output


def test_a_planted_cycle_inside_a_part_breaks_no_cycles_and_its_layers(copy):
    plant(copy, "kvpool.tier.record", "import kvpool.tier.registry  # planted: the registry imports the record")
    found, output = broken(copy)
    assert found == {"no-cycles", "kvpool-tier"}, output
    assert "kvpool.tier.record -> kvpool.tier.registry" in output, output


def test_a_planted_import_of_the_harness_breaks_kvpool_alone(copy):
    plant(copy, "kvpool.pool.digest", "import kvgate.harness.gate  # planted")
    found, output = broken(copy)
    # The same import is also one of the harness by the faults (faults -> kvpool.pool.digest ->
    # kvgate.harness.gate) and, through the harness, a way up kvpool's and the harness's layers.
    assert {"kvpool-alone", "faults-below-harness", "kvpool-parts", "harness-layers"} <= found, output
    assert "kvpool.pool.digest -> kvgate.harness.gate" in output, output


def test_a_planted_cycle_in_the_harness_breaks_no_cycles_and_its_layers(copy):
    plant(copy, "kvgate.harness.report.render", "from kvgate.harness.plan import plan  # planted: plan imports the renderer")
    found, output = broken(copy)
    assert found == {"no-cycles", "harness-layers"}, output
    assert "kvgate.harness.report.render -> kvgate.harness.plan" in output, output


# -- imports by literal name (importlib), which import-linter does not see ------------------------

RULES = {  # the folder checked -> the names (and their descendants) it must not import by name
    "kvpool": ("kvgate", "harness", "faults", "reports", "fixtures"),
    "faults": ("kvgate.harness", "kvgate.fixtures", "harness", "reports", "fixtures"),
}


def _under(module: str, names: tuple[str, ...]) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


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
            for line, module in imported_by_name(path) if _under(module, forbidden)]


@pytest.mark.parametrize("package", sorted(RULES))
def test_no_import_by_literal_name_crosses_a_boundary(package):
    assert violations(package, RULES[package]) == []


def test_the_walk_sees_imports_by_literal_name(tmp_path):
    """The check can fail: a planted package with each kind of import by name is caught."""
    pkg = tmp_path / "kvpool"
    pkg.mkdir()
    (pkg / "a.py").write_text("import importlib\nimportlib.import_module('kvgate.harness.report.render')\n")
    (pkg / "b.py").write_text("def f():\n    return __import__('kvgate.faults.backend')\n")
    (pkg / "c.py").write_text("import importlib\nimportlib.import_module('kvpool.pool.keys')\n")
    assert violations("kvpool", RULES["kvpool"], tmp_path) == [
        "kvpool/a.py:2 imports kvgate.harness.report.render", "kvpool/b.py:2 imports kvgate.faults.backend"]


# -- names: no generic top-level name imported, no private name taken across parts --------------

SOURCES = ("kvpool", "harness", "faults", "fixtures", "suites", "scripts", "conftest.py")
GENERIC = ("harness", "faults", "fixtures")  # installed only as kvgate.harness, kvgate.faults, kvgate.fixtures


def _imports(path: Path):
    """(line, module, names) of every import statement of a file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module, tuple(a.name for a in node.names)


def _files(root: Path):
    for src in SOURCES:
        p = root / src
        yield from ([p] if p.is_file() else sorted(p.rglob("*.py")) if p.is_dir() else [])


def generic_imports(root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{line} imports {mod}" for p in _files(root)
            for line, mod, _ in _imports(p) if _under(mod, GENERIC)]


def _owner(path: Path, root: Path) -> str:
    """The part of kvpool a file belongs to (kvpool.pool, ...), or its top-level folder."""
    parts = path.relative_to(root).parts
    return ".".join(parts[:2]) if parts[0] == "kvpool" and len(parts) > 2 else parts[0]


def private_imports(root: Path = ROOT) -> list[str]:
    """`from kvpool.<part>.<module> import _name` in a file of the product or the gate outside
    that part (a unit test may reach a private helper of what it tests)."""
    out = []
    for p in _files(root):
        if p.relative_to(root).parts[0] == "suites":
            continue
        for line, mod, names in _imports(p):
            if not mod.startswith("kvpool."):
                continue
            part = ".".join(mod.split(".")[:2])
            out += [f"{p.relative_to(root)}:{line} takes {mod}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and _owner(p, root) != part]
    return out


def test_nothing_imports_a_generic_top_level_name():
    assert generic_imports() == []


def test_no_private_name_is_taken_from_another_part_of_kvpool():
    assert private_imports() == []


def test_both_name_checks_can_fail(tmp_path):
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "t.py").write_text("from harness.gate import x\nimport faults.pool\n"
                                              "from kvpool.connector.params import _tag\n")
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "f.py").write_text("from kvpool.connector.params import _tag\n")
    (tmp_path / "kvpool" / "connector").mkdir(parents=True)
    (tmp_path / "kvpool" / "connector" / "a.py").write_text("from kvpool.connector.params import _own_part\n"
                                                            "from kvpool.pool.keys import _other_part\n")
    assert generic_imports(tmp_path) == ["suites/t.py:1 imports harness.gate", "suites/t.py:2 imports faults.pool"]
    assert private_imports(tmp_path) == ["kvpool/connector/a.py:2 takes kvpool.pool.keys._other_part",
                                         "faults/f.py:1 takes kvpool.connector.params._tag"]
