"""The worker side of the connector: the KV layout checked at registration, loads into the KV
tensors (sync or async) and the publish of completed blocks, through the copier.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from kvpool.connector import vllm_compat as compat
from kvpool.client.backend import PoolBackend
from kvpool.connector.copier import HostCopier
from kvpool.pool.copy import prefault
from kvpool.errors import MissCause
from kvpool.connector.history import HistoryWriter
from kvpool.pool.metrics import ClientMetrics
from kvpool.tier.registry import open_tier
from kvpool.connector.stats import KVPoolStats, StatsCollector
from kvpool.connector.params import BlockRun, KVPoolMetadata
from kvpool.connector.settings import BackendFactory, ConnectorSettings, Copier, CopierFactory, connect_backend, namespace_for


# -- worker side ----------------------------------------------------------------------------


class KVCachesReleased(RuntimeError):
    """A copy was asked for while the engine's KV caches are unregistered (vLLM's sleep mode,
    between unregister_kv_caches and restore_kv_caches): their memory may be unmapped."""



class KVPoolWorker:
    """The worker half. Copies run on the copier's thread (kvpool.connector.copier), overlapped
    with the engine; the ordering the engine relies on is enforced here:

      loads   submitted in start_load_kv; wait_for_layer_load (before the first
              attention reads a block) and wait_for_save wait for them.
      stores  submitted in wait_for_save, after the step's forward wrote the KV. A
              finished request's blocks stay allocated (request_finished said so) until
              a get_finished sees its stores done and reports it in finished_sending
              (get_finished never waits: a request whose stores still run is reported
              at a later call); a preempted request's stores are drained before the
              next forward can write into its freed blocks: in handle_preemptions (vLLM
              0.32, 0.34: before every forward, whether or not the step loads) and in
              start_load_kv (vLLM 0.24, where it runs before every forward).
      sleep   unregister_kv_caches (vLLM 0.34's sleep, before the KV memory is released):
              every copy in flight is over (stores still queued are dropped: the KV they
              would read is being discarded) and any later copy raises KVCachesReleased
              until restore_kv_caches (after wake-up; the tensors keep their addresses).
    """

    def __init__(self, vllm_config, settings: ConnectorSettings,  # noqa: ANN001
                 backend_factory: BackendFactory = connect_backend,
                 copier_factory: CopierFactory | None = None) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.device = compat.device_type(vllm_config)
        self.ns = namespace_for(vllm_config, settings, tp_rank=compat.tp_rank())
        self.history = HistoryWriter(settings.history_dir, settings.replica, "worker")
        self.metrics = ClientMetrics()
        self.backend = backend_factory(settings, "worker", self.history, self.metrics)
        self.copier = (copier_factory or default_copier)(settings, self.backend, self.history, self.metrics,
                                                         self.device)
        if settings.tier and self.device == "cuda":
            raise ValueError("the network tier (setting 'tier') is served on the CPU copier only, so far")
        self.tier = open_tier(settings.tier, settings.tier_auth(), settings.tier_timeout_s) if settings.tier else None
        self.stats = StatsCollector()  # this interval's loads and publishes (vLLM's connector stats)
        self._loading: list = []
        self._receiving: dict[str, list] = {}  # req id -> its asynchronous loads' futures
        self._sending: dict[str, list] = {}  # req id -> its store futures
        self._finishing: dict[str, list] = {}  # finished by the scheduler, stores still running
        self._released = False  # between unregister_kv_caches and restore_kv_caches

    @property
    def _wait_s(self) -> float:  # a copy is bounded by the client's own timeouts; this is the backstop
        return self.settings.load_deadline_s + 4 * self.settings.timeout_s

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Verify every layer's KV tensor against the namespace's layout and hand them to
        the copier: on CPU as byte arrays (each block contiguous), on CUDA the tensors
        themselves with the layout's block dimension (kvpool.connector.gpu_copier.CudaCopier)."""
        import torch

        names = sorted(kv_caches, key=compat.layer_index)
        ns = self.ns
        want = compat.expected_block_shape(self.device, ns.num_kv_heads, ns.block_size, ns.head_size)
        block_dim = compat.block_dim(self.device)
        layers = []
        for name in names:
            t = kv_caches[name]
            per_block = tuple(s for k, s in enumerate(t.shape) if k != block_dim)
            if per_block != want or str(t.dtype).removeprefix("torch.") != ns.kv_dtype:
                raise compat.LayoutMismatch(
                    f"{name}: KV tensor {tuple(t.shape)} {t.dtype}, namespace declares per-block {want} {ns.kv_dtype}")
            if self.device == "cuda":
                if t.device.type != "cuda":
                    raise compat.LayoutMismatch(f"{name}: on {t.device}; the engine runs on CUDA")
                layers.append(t)  # any strides: the GPU engine copies a block's contiguous runs
                continue
            if not t[0].is_contiguous():
                raise compat.LayoutMismatch(f"{name}: one block of the KV tensor is not contiguous")
            if t.device.type != "cpu":
                raise compat.LayoutMismatch(f"{name}: on {t.device}; the host copier needs CPU tensors")
            layers.append(t.view(torch.uint8).numpy())
        if len(layers) != ns.num_layers:
            raise compat.LayoutMismatch(f"{len(layers)} KV tensors registered, namespace declares {ns.num_layers} layers")
        faulted: dict[str, Any] = {}
        if self.device == "cuda":
            self.copier.register(layers, ns=ns, block_dim=block_dim)
        else:
            if self.settings.prefault_kv:
                t0 = time.monotonic()
                faulted = {"prefault": sorted({prefault(layer) for layer in layers}),
                           "prefault_s": round(time.monotonic() - t0, 4)}
            self.copier.register(layers)
        self.history.write("register", layers=names, shape=list(kv_caches[names[0]].shape),
                           block_bytes=self.copier.block_bytes, ns=ns.as_dict(), **faulted)

    def drain(self, req_ids: list[str]) -> None:
        """The stores of these (preempted) requests are over before the next forward (each
        request's: queued ones dropped, the running one waited for); the ones drained
        already return at once."""
        for rid in req_ids:
            self._drain(rid)

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        self.drain(meta.drain)
        for run in meta.loads:
            self._loading.append(self._load(run))
        for run in meta.async_loads:
            self._receiving.setdefault(run.req_id, []).append(self._load(run))

    def _drain(self, rid: str) -> None:
        """A preempted request's blocks are free: its stores must be over before the next
        forward writes into them. Those still queued are cancelled (they never read the
        blocks; on a stalled pool they would queue behind other requests' stores past the
        backstop, and the wait would end the engine); the one running is waited for, its
        calls bounded by the client's timeouts."""
        self._drop_and_wait(self._sending, rid, "preempted before its store started: its blocks are free")

    def _drop_and_wait(self, table: dict[str, list], rid: str, reason: str) -> None:
        sending = table.get(rid, [])
        drop = getattr(self.copier, "drop_unstarted", None)  # the host copier's; the CUDA copier's are ordered
        dropped = drop(sending) if drop is not None and sending else []
        if dropped:
            sending = table[rid] = [f for f in sending if not f.cancelled()]
            self.history.write("publish_dropped", req=rid, stores=len(dropped), reason=reason)
        self.copier.wait(sending, self._wait_s)

    def release(self) -> None:
        """vLLM's unregister_kv_caches (sleep): no copy touches the KV caches from here until
        restore(). Stores still queued are dropped, the running ones and every load waited
        for (each bounded by the client's timeouts)."""
        reason = "the KV caches are being released (sleep) before its store started"
        for table in (self._sending, self._finishing):
            for rid in list(table):
                self._drop_and_wait(table, rid, reason)
        loading = self._loading + [f for futures in self._receiving.values() for f in futures]
        self.copier.wait(loading, self._wait_s)
        self._released = True
        self.history.write("kv_caches_released", sending=len(self._sending), finishing=len(self._finishing))

    def restore(self) -> None:
        """vLLM's restore_kv_caches (wake-up): the tensors registered are backed again, at
        the same addresses (vLLM keeps the KV cache's virtual reservation across a sleep)."""
        self._released = False
        self.history.write("kv_caches_restored")

    def close(self) -> None:
        """vLLM's shutdown: stores still queued are dropped and the running copies waited for
        (as release() does: a stalled pool does not hold the exit past the client's
        timeouts), then the copier's threads, the pool connection, the tier's, the history.
        A copy that outlives its bound raises, after everything is closed."""
        try:
            self.release()
        finally:
            self.copier.close()
            self.backend.close()
            if self.tier is not None:
                self.tier.close()
            self.history.close()

    def _load(self, run: BlockRun) -> Future:
        if self._released:
            raise KVCachesReleased(f"a load for {run.req_id} while the KV caches are unregistered")
        if run.source == "tier":
            if self.tier is None:
                raise ValueError(f"a load from the tier for {run.req_id}, and no tier is configured on the worker")
            future = self.copier.tier_load(self.tier, self.ns, run, self.settings.tier_deadline_s)
        else:
            future = self.copier.load(self.ns, run, self.settings.load_deadline_s)
        future.add_done_callback(lambda f, n=len(run.block_ids), src=run.source: self._note_load(f, n, src))
        return future

    def _note_load(self, future: Future, wanted: int, source: str) -> None:
        """A finished load's measurement, for vLLM's connector stats (kvpool.connector.stats): the
        replica's /metrics, and the scheduler's tier rule for tier loads."""
        if future.cancelled():
            return
        exc = future.exception()
        res = None if exc is not None else future.result()
        if res is None:  # raised, or its deadline passed before it started
            loaded, seconds = 0, 0.0
            cause = (MissCause.TRANSPORT_ERROR if exc is not None else MissCause.TIMEOUT).value
        else:
            loaded, seconds = int(res.loaded), float(getattr(res, "seconds", 0.0))
            cause = res.miss.cause.value if res.miss else None
        self.stats.load(source, wanted, loaded, seconds, loaded * self.copier.block_bytes, cause)

    def _note_store(self, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        res = future.result()
        committed = int(getattr(res, "committed", 0) or 0) if res is not None else 0
        if committed:
            self.stats.published(committed, committed * self.copier.block_bytes)

    def take_stats(self) -> KVPoolStats | None:
        return self.stats.take()

    def wait_for_load(self) -> None:
        if self._loading:
            loading, self._loading = self._loading, []
            self.copier.wait(loading, self._wait_s)

    def save(self, meta: KVPoolMetadata) -> None:
        """Publish the blocks this step completed. A request whose load failed in this step
        had the rest of its prompt computed on the failed blocks (vLLM schedules it in the
        same step as the load, and rolls the request back only afterwards): nothing this
        step computed for it is published; its recompute publishes those blocks later."""
        self.wait_for_load()
        if self._released and meta.stores:
            raise KVCachesReleased(f"{len(meta.stores)} stores while the KV caches are unregistered")
        failed = set(self.copier.failed)
        on_failed = {run.req_id for run in meta.loads if failed.intersection(run.block_ids)}
        for run in meta.stores:
            # The scheduler keeps a request with stores in its metadata from freeing its blocks
            # until finished_sending reports it: it is reported even if nothing is published.
            sending = self._sending.setdefault(run.req_id, [])
            if run.req_id in on_failed:
                self.history.write("publish_withheld", req=run.req_id, tag=run.tag, first_block=run.first_block,
                                   blocks=len(run.block_ids), reason="computed in the step of a failed load")
                continue
            keep = []  # never publish a block whose load failed, nor anything after it
            for i, b in enumerate(run.block_ids):
                if b in failed:
                    break
                keep.append(i)
            if keep:
                tier = self.tier is not None and self.settings.tier_publish
                store = self.copier.store(self.ns, run, keep)
                store.add_done_callback(self._note_store)
                sending.append(store)
                if tier:
                    sending.append(self.copier.tier_store(self.tier, self.ns, run, keep))
                # in the step, before its outputs reach the engine: once the request's response is
                # back, a reader of the history knows which of its publishes are still to land
                # (each store ends with its record: `publish`, `tier_publish`, or a drop)
                self.history.write("store_queued", req=run.req_id, tag=run.tag, first_block=run.first_block,
                                   blocks=len(keep), tier=tier)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests the scheduler finished (now or at an earlier call) whose stores are all
        done: their blocks may go. Never waits: the others are reported at a later call."""
        for rid in finished_req_ids:
            futures = self._sending.pop(rid, None)
            if futures is not None:  # None: no store was handed over, the scheduler freed it already
                self._finishing[rid] = futures
        done = {rid for rid, futures in self._finishing.items() if all(f.done() for f in futures)}
        for rid in done:
            self.copier.wait(self._finishing.pop(rid), 0.0)  # all done: raises what a job raised, if any
        return done

    def finished_receiving(self) -> set[str]:
        """Requests whose asynchronous loads are installed (or failed): vLLM may schedule
        them. A load's failed blocks are in the copier's `.failed` before it settles, so
        they reach get_block_ids_with_load_errors no later than the request's report."""
        done = {rid for rid, futures in self._receiving.items() if all(self.copier.load_settled(f) for f in futures)}
        for rid in done:
            self.copier.wait(self._receiving.pop(rid), 0.0)  # settled: raises what a job raised, if any
        return done

    def take_failed(self) -> set[int]:
        return self.copier.take_failed()


def transfer_config(settings: ConnectorSettings):  # noqa: ANN201 - a kvpool.gpu.config.TransferConfig
    """The GPU engine's settings from the connector's (gpu_chunk_mib, gpu_sketch,
    gpu_install_direct): what every CUDA copier of a replica is built with, kvpool's and a
    wrapper's alike."""
    from kvpool.gpu.config import TransferConfig

    return TransferConfig(sketch_impl=settings.gpu_sketch, install_direct=settings.gpu_install_direct,
                          **({"chunk_bytes": settings.gpu_chunk_mib << 20} if settings.gpu_chunk_mib else {}))


def default_copier(settings: ConnectorSettings, backend: PoolBackend, history: HistoryWriter,
                   metrics: ClientMetrics, device: str = "cpu") -> Copier:
    """The default CopierFactory, by device: HostCopier on CPU, CudaCopier on CUDA."""
    if device == "cuda":
        from kvpool.connector.gpu_copier import CudaCopier

        return CudaCopier(backend, history, metrics, config=transfer_config(settings))
    return HostCopier(backend, history, metrics)
