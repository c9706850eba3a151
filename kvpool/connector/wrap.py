"""A V1 connector that wraps another V1 connector: the base of kvpool.connector.audit's
AuditConnector and of any wrapper built outside kvpool (fault injection, instrumentation).

    kv_connector="<Wrapper>", kv_connector_module_path="<its module>",
    kv_connector_extra_config={"<INNER_KEY>": "module:Class", <the wrapper's OWN_KEYS>,
                               <the inner connector's own settings>}

  WrappingConnector(vllm_config, role, kv_cache_config, *, extra=None)
        builds the inner connector named by `extra[INNER_KEY]` (default DEFAULT_INNER) and
        delegates every hook to it. The wrapper's OWN_KEYS are taken out of the extra
        config (into `self.own`) before the inner connector sees it; `history_dir` and
        `replica` are read by the wrapper and passed on.
  Capability flags of a connector class, read when it is the inner one:
        takes_extra_config   it accepts `extra=` (the extra config without the keys of the
                             wrappers around it); without it the inner connector reads
                             vLLM's config itself and must ignore keys it does not know,
                             as vLLM's own connectors do.
        takes_factories      it accepts `backend_factory=` / `copier_factory=`
                             (kvpool.connector: how kvpool builds its pool backend and its
                             copy engine); a wrapper passes its own through `inner_kwargs`.
  A subclass overrides the hooks it watches or changes and calls the inner connector's.
  The hooks newer vLLM versions added (FORWARDED: the worker's metadata back to the
  scheduler, new-request and push-work notices, handshakes, sleep mode's unregister and
  restore, ...) reach the inner connector where this vLLM has them, and so do its
  requires_kv_delivery and the class-level questions (get_required_kvcache_layout; vLLM
  0.34's kv_cache_access, supports_lookahead_block_hashes, supports_sleep_mode: the inner
  class is named in the same extra config, through every wrapper's key).
Contract: a wrapper never changes what the inner connector does unless that is its job,
and everything it does not override reaches the inner connector unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvpool.connector import vllm_compat as compat

SHARED_KEYS = ("history_dir", "replica")  # read by wrappers, kept for the inner connector


def load_class(path: str, setting: str = "inner connector") -> type:
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{setting} must be 'module:Class', got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except AttributeError as exc:
        raise ValueError(f"{setting}: module {module!r} has no {name!r}") from exc


class WrappingConnector(compat.KVConnectorBase_V1):
    INNER_KEY = "inner"
    OWN_KEYS: tuple[str, ...] = ()
    DEFAULT_INNER = "kvpool.connector:KVPoolConnector"
    takes_extra_config = True

    def __init__(self, vllm_config, role, kv_cache_config=None, *, extra: dict[str, Any] | None = None):  # noqa: ANN001
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {} if extra is None else extra)
        inner_path = str(extra.pop(self.INNER_KEY, self.DEFAULT_INNER))
        self.own: dict[str, Any] = {k: extra.pop(k) for k in self.OWN_KEYS if k in extra}
        self.replica = str(extra.get("replica", "replica"))
        self.history_dir = extra.get("history_dir")
        self.role_name = "scheduler" if role == compat.KVConnectorRole.SCHEDULER else "worker"
        self.inner_class = load_class(inner_path, self.INNER_KEY)
        kwargs: dict[str, Any] = {}
        if getattr(self.inner_class, "takes_extra_config", False):
            kwargs["extra"] = extra
        kwargs.update(self.inner_kwargs(self.inner_class))
        self._inner = self.inner_class(vllm_config, role, kv_cache_config, **kwargs)

    def inner_kwargs(self, inner_class: type) -> dict[str, Any]:
        """More keyword arguments for the inner connector (read its capability flags)."""
        return {}

    @property
    def inner(self):  # noqa: ANN201
        return self._inner

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        return self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        return self._inner.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        return self._inner.request_finished(request, block_ids)

    def update_connector_output(self, connector_output):  # noqa: ANN001, ANN201
        return self._inner.update_connector_output(connector_output)

    def take_events(self):  # noqa: ANN201
        return self._inner.take_events()

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):  # noqa: ANN001, ANN201
        return self._inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata):  # noqa: ANN001, ANN201
        super().bind_connector_metadata(connector_metadata)
        self._inner.bind_connector_metadata(self.inner_metadata(connector_metadata))

    def inner_metadata(self, connector_metadata):  # noqa: ANN001, ANN201
        """The inner connector's part of this wrapper's metadata (the same object unless
        the wrapper's build_connector_meta wraps it)."""
        return connector_metadata

    def clear_connector_metadata(self):  # noqa: ANN201
        super().clear_connector_metadata()
        self._inner.clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs):  # noqa: ANN001, ANN201
        return self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):  # noqa: ANN001, ANN201
        return self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):  # noqa: ANN001, ANN201
        return self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):  # noqa: ANN201
        return self._inner.wait_for_save()

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
        sending, receiving = self._inner.get_finished(finished_req_ids)
        return self.finished_filter(sending, receiving, finished_req_ids)

    def get_transfer_results(self, finished_req_ids):  # noqa: ANN001, ANN201
        """vLLM 0.32's poll of completed transfers: the inner connector's own results (its
        failed receives included), their finished sets through finished_filter."""
        results = self._inner.get_transfer_results(finished_req_ids)
        sending, receiving = self.finished_filter(set(results.finished_sending) or None,
                                                  set(results.finished_recving) or None, finished_req_ids)
        results.finished_sending, results.finished_recving = set(sending or ()), set(receiving or ())
        return results

    def finished_filter(self, sending, receiving, finished_req_ids):  # noqa: ANN001, ANN201
        """What a wrapper changes of the inner connector's finished transfers (sending and
        receiving ids, or None): unchanged here."""
        return sending, receiving

    def get_block_ids_with_load_errors(self):  # noqa: ANN201
        return self._inner.get_block_ids_with_load_errors()

    def shutdown(self):  # noqa: ANN201
        shutdown = getattr(self._inner, "shutdown", None)
        return shutdown() if shutdown is not None else None

    def handle_preemptions(self, kv_connector_metadata):  # noqa: ANN001, ANN201
        handle = getattr(self._inner, "handle_preemptions", None)
        return handle(self.inner_metadata(kv_connector_metadata)) if handle is not None else None

    def get_kv_connector_stats(self):  # noqa: ANN201
        stats = getattr(self._inner, "get_kv_connector_stats", None)
        return stats() if stats is not None else None

    def reset_cache(self):  # noqa: ANN201
        reset = getattr(self._inner, "reset_cache", None)
        return reset() if reset is not None else None

    @property
    def requires_kv_delivery(self) -> bool:
        """The inner connector's (vLLM 0.32, 0.34): whether vLLM must drop a preempted
        request's in-flight output for it."""
        return bool(getattr(self._inner, "requires_kv_delivery", False))

    @classmethod
    def _inner_class(cls, vllm_config) -> type:  # noqa: ANN001
        return cls._inner_class_of(vllm_config.kv_transfer_config)

    @classmethod
    def _inner_class_of(cls, kv_transfer_config) -> type:  # noqa: ANN001
        extra = dict(kv_transfer_config.kv_connector_extra_config or {})
        return load_class(str(extra.get(cls.INNER_KEY, cls.DEFAULT_INNER)), cls.INNER_KEY)

    # vLLM 0.34 asks these of the connector class: the inner class's answers
    @classmethod
    def kv_cache_access(cls, kv_transfer_config):  # noqa: ANN001, ANN206
        return cls._inner_class_of(kv_transfer_config).kv_cache_access(kv_transfer_config)

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config) -> bool:  # noqa: ANN001
        return cls._inner_class_of(kv_transfer_config).supports_lookahead_block_hashes(kv_transfer_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:  # noqa: ANN001
        return cls._inner_class_of(kv_transfer_config).supports_sleep_mode(kv_transfer_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):  # noqa: ANN001, ANN206
        required = getattr(cls._inner_class(vllm_config), "get_required_kvcache_layout", None)
        return required(vllm_config) if required is not None else None

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206
        build = getattr(cls._inner_class(vllm_config), "build_prom_metrics", None)
        return build(vllm_config, metric_types, labelnames, per_engine_labelvalues) if build is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):  # noqa: ANN001, ANN206
        """vLLM's logger rebuilds the stats from their data alone (no config reaches it):
        kvpool's own shape is kvpool's; any other inner connector's stats are not logged
        through a wrapper."""
        from kvpool.connector.stats import KVPoolStats, is_kvpool_data

        return KVPoolStats(data=dict(data)) if data and is_kvpool_data(data) else None


FORWARDED = ("on_new_request", "build_connector_worker_meta", "has_pending_push_work", "has_pending_block_frees",
             "get_kv_connector_kv_cache_events", "get_handshake_metadata", "set_xfer_handshake_metadata",
             "set_host_xfer_buffer_ops", "bind_kv_cache_manager", "bind_gpu_block_pool", "get_finished_count",
             "finish_forward", "reset_capture_state", "get_loaded_kv_cache_group_ids",
             "get_external_cache_hit_sources", "register_finished_partial_tail", "get_mem_pool_context",
             "unregister_kv_caches", "restore_kv_caches", "may_load_async")


def _forward(name: str):  # noqa: ANN202
    def hook(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return getattr(self._inner, name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"The inner connector's {name}."
    return hook


for _name in FORWARDED:  # only the hooks this vLLM's connector base has
    if hasattr(compat.KVConnectorBase_V1, _name) and _name not in WrappingConnector.__dict__:
        setattr(WrappingConnector, _name, _forward(_name))
