"""scripts/gpu/carry.sh: the bundle cut into two transfers and rebuilt byte for byte on the
other side, where its install.sh (checksums first) runs; a damaged transfer is refused."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

CARRY = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "carry.sh"
FILES = ("vllm-0.24.0-trimmed.tar.xz.part-aa", "vllm-0.24.0-trimmed.tar.xz.part-ab", "vllm-deps-wheels.tar")

pytestmark = pytest.mark.skipif(shutil.which("dd") is None or shutil.which("bash") is None, reason="needs bash, dd")


def _bundle(tmp: Path) -> Path:
    b = tmp / "bundle"
    b.mkdir()
    sums = []
    for i, name in enumerate(FILES):  # sizes that straddle the cut below (1 MiB)
        data = hashlib.shake_256(name.encode()).digest(300_000 + 500_000 * i)
        (b / name).write_bytes(data)
        sums.append(f"{hashlib.sha256(data).hexdigest()}  {name}")
    (b / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    # the bundle's install.sh, as far as this test needs it: checksums of the files in its folder
    (b / "install.sh").write_text('set -e\ncd "$1"\nsha256sum -c --quiet SHA256SUMS\necho installed\n')
    return b


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CARRY), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_two_transfers_rebuild_the_bundle_and_run_its_installer(tmp_path):
    b = _bundle(tmp_path)
    out = tmp_path / "carry"
    r = _run("pack", str(b), str(out), "1")
    assert r.returncode == 0, r.stderr
    assert (out / "1" / "stream.1").stat().st_size == 1 << 20
    total = sum((b / f).stat().st_size for f in FILES)
    assert (out / "2" / "stream.2").stat().st_size == total - (1 << 20)
    r = _run("install", str(out / "1"), str(out / "2"), env={"SITE": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr
    assert "installed" in r.stdout


def test_a_damaged_transfer_is_refused(tmp_path):
    b = _bundle(tmp_path)
    out = tmp_path / "carry"
    assert _run("pack", str(b), str(out), "1").returncode == 0
    s2 = out / "2" / "stream.2"
    data = bytearray(s2.read_bytes())
    data[12345] ^= 1  # one bit of the second transfer
    s2.write_bytes(bytes(data))
    r = _run("install", str(out / "1"), str(out / "2"), env={"SITE": str(tmp_path / "site")})
    assert r.returncode != 0 and "installed" not in r.stdout
