"""The two distributions, built as wheels and installed into clean virtual environments.

  kvpool  (packaging/kvpool)  the pool and its connector; top-level name `kvpool` only;
                              installed alone, it brings none of the gate's dependencies
                              and its command and modules work.
  kvgate  (pyproject.toml)    the gate; top-level name `kvgate` only (its harness, faults and
                              fixtures inside it); installed with kvpool, `kvgate` starts, the
                              scenario catalog ships with it, the pytest plugin is registered
                              through its entry point, and no generic name is importable.

Wheels are built as a user's pip builds them (an isolated build environment from the
package index); the environments install from the index and the built wheels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATE_ONLY = ("pytest", "requests", "hypothesis", "matplotlib", "simpy", "tqdm")  # the gate's, not the pool's


def run(*args: str | Path, timeout: int = 900, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}  # nothing of ours
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


SOURCES = ("kvpool", "kvgate", "harness", "faults", "fixtures", "packaging", "pyproject.toml", "README.md")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Built from a copy of the sources (links kept as links), so no build directory is left in
    # the tree and none from an earlier build can slip a stale file into the wheels.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in SOURCES:
        if (ROOT / name).is_dir() and not (ROOT / name).is_symlink():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, src / "packaging" / "kvpool", src)
    found = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(found) == {"kvpool", "kvgate"}, sorted(out.iterdir())
    return found


def top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))}


def members(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))


def test_each_wheel_installs_one_top_level_name_of_its_own(wheels):
    assert top_level(wheels["kvpool"]) == {"kvpool"}
    assert top_level(wheels["kvgate"]) == {"kvgate"}
    gate = members(wheels["kvgate"])
    for path in ("kvgate/harness/cli.py", "kvgate/faults/schedule.py", "kvgate/fixtures/tiny_model.py",
                 "kvgate/fixtures/scenarios/cross-replica-hit.json", "kvgate/fixtures/plan/mix.json"):
        assert path in gate, path
    assert not any(n.startswith(("kvgate/suites", "kvgate/reports", "kvgate/kvpool")) for n in gate)
    pool = members(wheels["kvpool"])
    assert {"kvpool/connector/facade.py", "kvpool/pool/daemon.py", "kvpool/gpu/transfer.py"} <= pool
    eps = entry_points(wheels["kvgate"])
    assert "[pytest11]" in eps and "kvgate.harness.plugin = kvgate.harness.plugin" in eps, eps
    assert "kvgate = kvgate.harness.cli:main" in eps, eps
    assert "kvpool = kvpool.cli:main" in entry_points(wheels["kvpool"])


def _venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)  # no system site-packages
    return where / "bin"


def _installed(bin_: Path) -> set[str]:
    listed = run(bin_ / "python", "-m", "pip", "list", "--format=freeze").stdout
    return {line.split("==")[0].lower() for line in listed.splitlines() if "==" in line}


def test_the_pool_alone_installs_without_the_gate(wheels, tmp_path):
    bin_ = _venv(tmp_path / "pool")
    run(bin_ / "python", "-m", "pip", "install", "-q", wheels["kvpool"])
    installed = _installed(bin_)
    assert "kvpool" in installed and "kvgate" not in installed
    assert not installed & set(GATE_ONLY), sorted(installed & set(GATE_ONLY))
    assert "usage: kvpool" in run(bin_ / "kvpool", "--help").stdout
    run(bin_ / "python", "-c", "import kvpool.pool.daemon, kvpool.client.pool_client, kvpool.client.transfer, "
        "kvpool.pool.cli, kvpool.tier.registry, kvpool.connector.history; import kvpool.connector as c; "
        "assert c.__all__ == ['KVPoolConnector']", cwd=tmp_path)


def test_the_gate_installs_its_command_and_no_generic_name(wheels, tmp_path):
    bin_ = _venv(tmp_path / "gate")
    run(bin_ / "python", "-m", "pip", "install", "-q", "--find-links", wheels["kvpool"].parent, wheels["kvgate"])
    installed = _installed(bin_)
    assert {"kvgate", "kvpool", *GATE_ONLY} <= installed, sorted(installed)
    assert "usage: kvgate" in run(bin_ / "kvgate", "--help", cwd=tmp_path).stdout
    listed = run(bin_ / "kvgate", "scenarios", cwd=tmp_path).stdout  # the catalog shipped in kvgate.fixtures
    assert "cross-replica-hit" in listed, listed
    probe = ("import importlib.util as u, kvgate.harness.gate, kvgate.faults.schedule, kvgate.fixtures;"
             "print(sorted(n for n in ('harness', 'faults', 'fixtures', 'reports', 'suites') if u.find_spec(n)))")
    assert run(bin_ / "python", "-c", probe, cwd=tmp_path).stdout.strip() == "[]"
    assert "--kvgate" in run(bin_ / "python", "-m", "pytest", "--help", cwd=tmp_path).stdout
