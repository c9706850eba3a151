"""The worker's copy engine is picked by device, with the fault wrappers where a
fault-control file is set; constructing them touches no GPU."""

from __future__ import annotations

import pytest

from kvpool import vllm_compat as compat
from kvpool.connector import ConnectorSettings, _copier
from kvpool.copier import HostCopier
from kvpool.history import HistoryWriter
from kvpool.metrics import ClientMetrics


class _NoBackend:
    """Constructors do not talk to the pool; any call would be a bug here."""

    def __getattr__(self, name: str):  # noqa: ANN204
        raise AssertionError(f"the copier called backend.{name} while being constructed")


def _make(device: str, faults_file: str = ""):  # noqa: ANN202
    settings = ConnectorSettings(pool="unix:/nonexistent", faults_file=faults_file)
    return _copier(settings, _NoBackend(), HistoryWriter(None, "r", "worker"), ClientMetrics(), device)


def test_cpu_picks_the_host_copier_and_its_fault_wrapper(tmp_path):
    from faults.copier import FaultyCopier

    assert type(_make("cpu")) is HostCopier
    wrapped = _make("cpu", str(tmp_path / "faults.json"))
    assert isinstance(wrapped, FaultyCopier) and type(wrapped.inner) is HostCopier


def test_cuda_picks_the_cuda_copier_and_its_controlled_twin(tmp_path):
    pytest.importorskip("torch")
    from faults.gpu_live import ControlledCudaCopier
    from kvpool.gpu_copier import CudaCopier

    assert type(_make("cuda")) is CudaCopier
    assert type(_make("cuda", str(tmp_path / "faults.json"))) is ControlledCudaCopier


def test_block_dim_and_layouts():
    assert compat.block_dim("cpu") == 0 and compat.block_dim("cuda") == 0
    assert compat.expected_block_shape("cuda", 8, 16, 128) == (2, 16, 8, 128)
    with pytest.raises(compat.LayoutMismatch):
        compat.block_dim("tpu")
