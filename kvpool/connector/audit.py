"""Audit mode: a V1 connector that wraps any other V1 connector and records digests.

    kv_connector="AuditConnector", kv_connector_module_path="kvpool.connector.audit",
    kv_connector_extra_config={"audit_inner": "kvpool.connector:KVPoolConnector",
                               "history_dir": ..., "replica": ..., <the inner's own keys>}

The inner connector (ours, a fault-injecting wrapper around ours, or e.g. vLLM's
ExampleConnector or OffloadingConnector) does all the work; the wrapper
(kvpool.connector.wrap.WrappingConnector) only watches, through the public hooks:

  scheduler side  learns, per request, which blocks the inner connector will load (from
                  get_num_new_matched_tokens / update_state_after_alloc) and which prompt
                  blocks each step completes; it sends that, next to the inner metadata,
                  in AuditMetadata. Each answer the inner connector gives to
                  get_num_new_matched_tokens is an `audit_match` record (local and
                  external tokens): what it claimed, for any connector.
  worker side     after the inner wait_for_save of a step (the step's KV is final; on GPU
                  after a full device sync) it digests
                    * "produced": every block the step completed, as the producer has it;
                    * "installed": every block the inner connector loaded this step, as the
                      consumer has it (blocks the inner reports failed are marked so).
                  and at the first wait_for_layer_load of a step, when the engine is about
                  to read the first layer, "seen": the loaded blocks as attention will
                  read them (a copy that is not ordered before attention shows up here).
Records go to the history as `audit` events keyed by the block's token-chain hash (no
salt, no namespace), so the gate can match a consumer's block with the producer's, and
carry the block's pool key (the chain seeded by the request's cache_salt, as kvpool keys
it) to find the pool's committed copy. Every worker record carries the worker's pid and
its step (counted at each bind_connector_metadata), and so does `audit_load_errors` (what
get_block_ids_with_load_errors told the engine): a failed block is matched to the install
of the very same step. The digest is XXH3-128 over the block's bytes in layer
order, the byte order of a pool page, so it equals the pool's page digest directly.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvpool.connector import vllm_compat as compat
from kvpool.connector.params import request_tag, salt_root, request_inputs
from kvpool.pool.copy import digest_segments
from kvpool.connector.history import HistoryWriter
from kvpool.connector.wrap import WrappingConnector


@dataclasses.dataclass
class AuditBlocks:
    req_id: str
    tag: str
    first_block: int
    block_ids: list[int]
    hashes: list[str]  # token-chain hashes, hex
    keys: list[str] = dataclasses.field(default_factory=list)  # the same blocks' pool keys (salted chain), hex


@dataclasses.dataclass
class AuditMetadata(compat.KVConnectorMetadata):
    inner: Any = None
    loaded: list[AuditBlocks] = dataclasses.field(default_factory=list)
    produced: list[AuditBlocks] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    tag: str
    n_prompt: int
    hashes: list[str]
    keys: list[str]
    block_ids: list[int] = dataclasses.field(default_factory=list)
    load: tuple[int, int] | None = None


class AuditConnector(WrappingConnector):
    INNER_KEY = "audit_inner"

    def __init__(self, vllm_config, role, kv_cache_config=None, *, extra: dict[str, Any] | None = None):  # noqa: ANN001
        super().__init__(vllm_config, role, kv_cache_config, extra=extra)
        self.history = HistoryWriter(self.history_dir, self.replica, f"audit-{self.role_name}")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.device = compat.device_type(vllm_config)
        self._reqs: dict[str, _Req] = {}
        self._layers: list = []
        self._seen_pending = False
        self._step = 0  # the worker's step, counted at each bind: the records of one step share it
        self._pid = os.getpid()

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        result = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        pending = self._reqs.get(request.request_id)
        if pending is not None and pending.load is not None:
            # Asked again while a load it was allocated for was never scheduled: vLLM dropped
            # that asynchronous load (it failed whole) and freed its blocks.
            pending.load = None
        if request.request_id not in self._reqs:
            tokens = list(request.prompt_token_ids or [])
            B = self.block_size
            full = tokens[: (len(tokens) // B) * B]
            inputs, _ = request_inputs(request, B)  # what the pool's keys take (adapter, multimodal items)
            hashes = [h.hex() for h in inputs.hashes(full, B)]
            keys = [h.hex() for h in inputs.hashes(full, B, salt_root(request))]
            self._reqs[request.request_id] = _Req(request_tag(request), len(tokens), hashes, keys)
        external = result[0] if isinstance(result, tuple) else result
        if external is not None:  # what the inner connector claimed (None: it asks to be asked again)
            self.history.write("audit_match", req=request.request_id, tag=self._reqs[request.request_id].tag,
                               local_tokens=int(num_computed_tokens), external_tokens=int(external),
                               load_async=bool(result[1]) if isinstance(result, tuple) else False,
                               prompt_tokens=len(request.prompt_token_ids or []))
        return result

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        self._inner.update_state_after_alloc(request, blocks, num_external_tokens)
        st = self._reqs.get(request.request_id)
        if st is not None and num_external_tokens > 0:
            b0 = request.num_computed_tokens // self.block_size
            st.load = (b0, b0 + num_external_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        meta = AuditMetadata(inner=self._inner.build_connector_meta(scheduler_output))
        B = self.block_size
        computed = compat.scheduled_requests(scheduler_output, self._reqs)
        for rid, ncomp in computed.items():
            st = self._reqs[rid]
            if st.load is not None:
                # What vLLM counts as computed when it schedules the request: all of a
                # synchronous load; of an asynchronous one, the blocks before the first
                # that failed (reported in an earlier step; the rest is recomputed now).
                b0, b1 = st.load[0], min(st.load[1], ncomp // B)
                meta.loaded.append(AuditBlocks(rid, st.tag, b0, st.block_ids[b0:b1], st.hashes[b0:b1],
                                               st.keys[b0:b1]))
                st.load = None
            # Blocks this step completes: from the first block not yet complete before it
            # (ncomp already counts loaded and locally cached tokens) to the last full one.
            start = ncomp // B
            done = min(min(ncomp + scheduler_output.num_scheduled_tokens.get(rid, 0), st.n_prompt) // B,
                       len(st.block_ids), len(st.hashes))
            if done > start:
                meta.produced.append(AuditBlocks(rid, st.tag, start, st.block_ids[start:done], st.hashes[start:done],
                                                 st.keys[start:done]))
        return meta

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        self._reqs.pop(request.request_id, None)
        return self._inner.request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):  # noqa: ANN001, ANN201
        self._inner.register_kv_caches(kv_caches)
        self._layers = [kv_caches[n] for n in sorted(kv_caches, key=compat.layer_index)]

    def bind_connector_metadata(self, connector_metadata):  # noqa: ANN001, ANN201
        self._step += 1
        super().bind_connector_metadata(connector_metadata)
        self._seen_pending = bool(connector_metadata.loaded)

    def inner_metadata(self, connector_metadata):  # noqa: ANN001, ANN201
        return connector_metadata.inner

    def wait_for_layer_load(self, layer_name):  # noqa: ANN001, ANN201
        out = self._inner.wait_for_layer_load(layer_name)
        if self._seen_pending and self.has_connector_metadata():
            self._seen_pending = False
            self._record("seen", self._get_connector_metadata().loaded, full_sync=False)
        return out

    def wait_for_save(self):  # noqa: ANN201
        self._inner.wait_for_save()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not (meta.loaded or meta.produced):
            return
        # Failed loads are only known from get_block_ids_with_load_errors, which vLLM calls
        # after this; the checkers take them from the connector's load records.
        self._record("installed", meta.loaded, full_sync=True)
        self._record("produced", meta.produced, full_sync=True)

    def _record(self, kind: str, runs: list[AuditBlocks], full_sync: bool) -> None:
        """full_sync: the step's final bytes (every stream done); otherwise what the engine's
        own stream is ordered after, which is what its next kernel reads."""
        if not runs:
            return
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize() if full_sync else torch.cuda.current_stream().synchronize()
        for run in runs:
            digests = [self._digest(b) for b in run.block_ids]
            self.history.write("audit", kind=kind, req=run.req_id, tag=run.tag, first_block=run.first_block,
                               block_ids=run.block_ids, hashes=run.hashes, keys=run.keys, digests=digests,
                               step=self._step, pid=self._pid)

    def _digest(self, block_id: int) -> str:
        import torch

        segments = []
        for layer in self._layers:
            block = layer[block_id]
            if block.device.type != "cpu":
                block = block.cpu()
            segments.append(block.contiguous().view(torch.uint8).numpy())
        return digest_segments(segments).hex()

    def get_block_ids_with_load_errors(self):  # noqa: ANN201
        failed = self._inner.get_block_ids_with_load_errors()
        if failed:
            self.history.write("audit_load_errors", block_ids=sorted(failed), step=self._step, pid=self._pid)
        return failed
