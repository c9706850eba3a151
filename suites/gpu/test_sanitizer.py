"""The ordering scenarios under PyTorch's CUDA stream sanitizer, in subprocesses with
TORCH_CUDA_SANITIZER=1 (harness/scenarios/gpu_sanitized.py): the engine runs clean and byte-exact,
and the sanitizer flags every negative control (each scenario with its edge dropped)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvgate.harness.scenarios.gpu_transfer import Scenario  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

ROOT = Path(__file__).resolve().parents[2]


def sanitized(mode: str, seed: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "kvgate.harness.scenarios.gpu_sanitized", "--mode", mode, "--seed", str(seed % 2**31)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_sanitizer_is_silent_on_the_engine_and_flags_every_control(test_seed):
    ordered = sanitized("ordered", test_seed)
    out = ordered.stdout + ordered.stderr
    print(out[-6000:])
    assert ordered.returncode == 0, out[-6000:]
    assert "CSAN" not in ordered.stdout, out[-6000:]
    for s in Scenario:
        assert f"SCENARIO {s.value} valid=True" in ordered.stdout, f"{s.value} did not run clean:\n{out[-6000:]}"
    control = sanitized("control", test_seed)
    out = control.stdout + control.stderr
    print(out[-6000:])
    for s in Scenario:
        assert f"CSAN-FLAGGED {s.value}:" in control.stdout, f"the sanitizer missed the {s.value} control:\n{out[-6000:]}"
    assert "CSAN detected a possible data race" in control.stdout
    assert control.returncode == 0, out[-6000:]
