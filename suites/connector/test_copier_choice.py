"""How a replica's connector is assembled: kvpool picks its copy engine by device, and a
fault-control file wraps kvpool from outside (kvgate.faults.connector through kvpool's factories),
under the audit; constructing them touches no GPU and no pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpool.connector import vllm_compat as compat
from kvpool.connector.settings import ConnectorSettings
from kvpool.connector.facade import KVPoolConnector
from kvpool.connector.worker import default_copier
from kvpool.connector.copier import HostCopier
from kvpool.connector.history import HistoryWriter
from kvpool.pool.metrics import ClientMetrics


class _NoBackend:
    """Constructors do not talk to the pool; any call would be a bug here."""

    def __getattr__(self, name: str):  # noqa: ANN204
        raise AssertionError(f"the copier called backend.{name} while being constructed")


def _default(device: str):  # noqa: ANN202
    settings = ConnectorSettings(pool="unix:/nonexistent")
    return default_copier(settings, _NoBackend(), HistoryWriter(None, "r", "worker"), ClientMetrics(), device)


def test_kvpool_picks_the_host_copier_on_cpu():
    assert type(_default("cpu")) is HostCopier


def test_kvpool_picks_the_cuda_copier_on_cuda():
    pytest.importorskip("torch")
    from kvpool.connector.gpu_copier import CudaCopier

    assert type(_default("cuda")) is CudaCopier


def _vllm_config(tmp_path, extra: dict, device: str = "cpu"):  # noqa: ANN202
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type=device),
                           kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


@pytest.fixture(scope="module")
def pool():
    from kvgate.harness.system.pool import thread_pool

    d = thread_pool(page_size=4096, num_pages=8)
    yield d
    d.stop_thread()


def _chain(tmp_path, pool, device: str = "cpu", faults: bool = True, **more):  # noqa: ANN001, ANN003, ANN202
    """The worker side of AuditConnector(FaultConnector(KVPoolConnector)) as the harness
    configures a replica (kvgate.harness.system.cluster.connector_config)."""
    from kvgate.harness.system.cluster import CONNECTOR, connector_config
    from kvpool.connector.wrap import load_class

    extra = {"pool": f"unix:{pool.unix_path}", "token": "tok", "replica": "R", "history_dir": str(tmp_path / "h"),
             **more}
    config = connector_config(CONNECTOR, extra, "recompute", audit=True,
                              faults_file=str(tmp_path / "faults.json") if faults else "")
    cls = load_class(f"{config['kv_connector_module_path']}:{config['kv_connector']}")
    vllm_config = _vllm_config(tmp_path, config["kv_connector_extra_config"], device)
    return cls(vllm_config, compat.KVConnectorRole.WORKER, None)


def test_the_fault_connector_wraps_kvpools_backend_and_copier_from_outside(tmp_path, pool):
    from kvgate.faults.backend import FaultyBackend
    from kvgate.faults.connector import FaultConnector
    from kvgate.faults.copier import FaultyCopier
    from kvpool.connector.audit import AuditConnector

    audit = _chain(tmp_path, pool)
    assert type(audit) is AuditConnector and type(audit.inner) is FaultConnector
    kvpool = audit.inner.inner
    assert type(kvpool) is KVPoolConnector
    worker = kvpool.worker
    assert isinstance(worker.backend, FaultyBackend) and isinstance(worker.copier, FaultyCopier)
    assert type(worker.copier.inner) is HostCopier
    # each wrapper's own settings were taken out before kvpool read its settings
    assert worker.settings.replica == "R" and audit.inner.own == {"faults_file": str(tmp_path / "faults.json")}


def test_without_a_fault_file_kvpool_runs_its_own_parts(tmp_path, pool):
    from kvpool.connector.audit import AuditConnector
    from kvpool.client.pool_client import PoolClient

    audit = _chain(tmp_path, pool, faults=False)
    assert type(audit) is AuditConnector and type(audit.inner) is KVPoolConnector
    assert type(audit.inner.worker.backend) is PoolClient and type(audit.inner.worker.copier) is HostCopier


def test_on_cuda_the_fault_connector_builds_the_controlled_twin(tmp_path, pool):
    pytest.importorskip("torch")
    from kvgate.faults.gpu_live import ControlledCudaCopier

    assert type(_chain(tmp_path, pool, "cuda").inner.inner.worker.copier) is ControlledCudaCopier


def test_the_cuda_copier_takes_the_engines_chunk_sketch_and_install_from_the_settings():
    pytest.importorskip("torch")
    settings = ConnectorSettings.from_extra({"pool": "unix:/x", "gpu_chunk_mib": 512, "gpu_sketch": "int8-mm",
                                             "gpu_install_direct": False})
    copier = default_copier(settings, _NoBackend(), HistoryWriter(None, "r", "worker"), ClientMetrics(), "cuda")
    assert (copier.config.chunk_bytes, copier.config.sketch_impl, copier.config.install_direct) == \
        (512 << 20, "int8-mm", False)
    default = _default("cuda").config
    assert (default.chunk_bytes, default.sketch_impl, default.install_direct) == (128 << 20, "auto", True)
    for bad, match in (({"gpu_sketch": "fast"}, "gpu_sketch must be one of"),
                       ({"gpu_install_direct": "yes"}, "gpu_install_direct must be"),
                       ({"gpu_install_direct": 1}, "gpu_install_direct must be"),
                       ({"gpu_chunk_mib": -1}, "gpu_chunk_mib must be"), ({"gpu_chunk_mib": 4097}, "from 0 to 4096"), ({"gpu_chunk_mib": True}, "gpu_chunk_mib must be"),
                       ({"gpu_chunk_mib": "512"}, "gpu_chunk_mib must be")):
        with pytest.raises(ValueError, match=match):
            ConnectorSettings.from_extra({"pool": "unix:/x", **bad})


def test_the_fault_connectors_cuda_copier_takes_the_replicas_engine_settings(tmp_path, pool):
    pytest.importorskip("torch")
    copier = _chain(tmp_path, pool, "cuda", gpu_chunk_mib=256, gpu_sketch="float64-mm").inner.inner.worker.copier
    assert (copier.config.chunk_bytes, copier.config.sketch_impl) == (256 << 20, "float64-mm")


def test_kvpool_refuses_a_wrappers_setting_it_does_not_know(tmp_path):
    with pytest.raises(ValueError, match="unknown kvpool connector settings"):
        ConnectorSettings.from_extra({"pool": "unix:/x", "faults_file": "f"})


def test_block_dim_and_layouts():
    assert compat.block_dim("cpu") == 0 and compat.block_dim("cuda") == 0
    assert compat.expected_block_shape("cuda", 8, 16, 128) == (2, 16, 8, 128)
    with pytest.raises(compat.LayoutMismatch):
        compat.block_dim("tpu")
