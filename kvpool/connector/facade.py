"""KVPoolConnector: vLLM's V1 connector, a thin facade over the scheduler and worker sides.
"""

from __future__ import annotations

from typing import Any

import kvpool.connector.vllm_compat as compat
from kvpool.connector.stats import KVPoolPromMetrics, KVPoolStats
from kvpool.connector.params import KVPoolMetadata
from kvpool.connector.scheduler import KVPoolScheduler
from kvpool.connector.settings import BackendFactory, ConnectorSettings, CopierFactory, connect_backend
from kvpool.connector.worker import KVPoolWorker


# -- the facade -----------------------------------------------------------------------------


class KVPoolConnector(compat.KVConnectorBase_V1):
    """vLLM builds it as KVPoolConnector(vllm_config, role, kv_cache_config). A wrapping
    connector (kvpool.connector.wrap.WrappingConnector) may also pass `extra` (its own settings
    removed from kv_connector_extra_config) and the two factories."""

    takes_extra_config = True  # capability flags a wrapper reads (kvpool.connector.wrap)
    takes_factories = True

    def __init__(self, vllm_config, role, kv_cache_config=None, *, extra: dict[str, Any] | None = None,  # noqa: ANN001
                 backend_factory: BackendFactory = connect_backend, copier_factory: CopierFactory | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        if extra is None:
            extra = self._kv_transfer_config.kv_connector_extra_config
        settings = ConnectorSettings.from_extra(extra)
        self._scheduler: KVPoolScheduler | None = None
        self._worker: KVPoolWorker | None = None
        if role == compat.KVConnectorRole.SCHEDULER:
            self._scheduler = KVPoolScheduler(vllm_config, settings, backend_factory, kv_cache_config)
        else:
            self._worker = KVPoolWorker(vllm_config, settings, backend_factory, copier_factory)

    @property
    def worker(self) -> KVPoolWorker | None:
        return self._worker

    # what vLLM asks of the connector class (kvpool.connector.vllm_compat: the versions)
    @classmethod
    def kv_cache_access(cls, kv_transfer_config):  # noqa: ANN001, ANN206
        """vLLM 0.34: the workers reach the KV cache in process only (the host copier's
        numpy views, the CUDA copier's copies on the engine's device): no registration with
        an RDMA engine, nothing exported to another process (the pool daemon never maps it)."""
        return compat.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:  # noqa: ANN001
        """vLLM 0.34: no. kvpool keys blocks by the prompt's tokens (its own chain,
        kvpool.connector.params), never by vLLM's block hashes, and moves the target model's
        KV-cache group alone; vLLM then keeps EAGLE's drop of a hit's last block."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:  # noqa: ANN001
        """vLLM 0.34: yes: unregister_kv_caches ends every copy before the KV memory is
        released and refuses new ones until restore_kv_caches; the tensors keep their
        addresses across the sleep, so nothing is registered anew."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """No (vLLM 0.32, 0.34; their default is the producer role, which kvpool's kv_both
        is): the pool is a cache, a store dropped at a preemption is a later miss, so vLLM
        need not drop a preempted request's in-flight output for it."""
        return False

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        return self._scheduler.request_finished(request, block_ids)

    def get_external_cache_hit_sources(self, request, num_external_tokens):  # noqa: ANN001, ANN201
        return self._scheduler.hit_sources(request, num_external_tokens)

    # worker side
    def register_kv_caches(self, kv_caches):  # noqa: ANN001, ANN201
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata):  # noqa: ANN001, ANN201
        """vLLM 0.32 and 0.34 call it before every forward; start_load_kv only where the
        step has a synchronous load. A preempted request's stores end here, before the
        forward can write into its freed blocks."""
        if self._worker is not None and isinstance(kv_connector_metadata, KVPoolMetadata):
            self._worker.drain(kv_connector_metadata.drain)

    def unregister_kv_caches(self):  # noqa: ANN201
        if self._worker is not None:
            self._worker.release()

    def restore_kv_caches(self):  # noqa: ANN201
        if self._worker is not None:
            self._worker.restore()

    def shutdown(self):  # noqa: ANN201
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def start_load_kv(self, forward_context, **kwargs):  # noqa: ANN001, ANN201
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name):  # noqa: ANN001, ANN201
        self._worker.wait_for_load()  # the whole load, before the first layer reads a block

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):  # noqa: ANN001, ANN201
        return None  # blocks are published whole in wait_for_save, after every layer wrote them

    def wait_for_save(self):  # noqa: ANN201
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._worker.save(meta)

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
        if self._worker is None:
            return None, None
        return (self._worker.finished_sending(set(finished_req_ids)) or None), (self._worker.finished_receiving() or None)

    def get_block_ids_with_load_errors(self):  # noqa: ANN201
        return self._worker.take_failed() if self._worker is not None else set()

    def update_connector_output(self, connector_output):  # noqa: ANN001, ANN201
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """vLLM's reset of the external cache (the scheduler's connector): everything this
        engine's namespace published leaves the pool for every replica
        (kvpool.connector.scheduler.KVPoolScheduler.reset); False: retry."""
        return self._scheduler.reset() if self._scheduler is not None else True

    def get_kv_connector_stats(self):  # noqa: ANN201
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.take_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):  # noqa: ANN001, ANN206
        return KVPoolStats(data=dict(data) if data else None)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206
        """kvpool's counters on the replica's own /metrics (kvpool.connector.stats.KVPoolPromMetrics)."""
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
