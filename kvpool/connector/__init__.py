"""kvpool's vLLM V1 KV connector.

Load it with
    KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute" | "fail",
                     kv_connector_extra_config={"pool": "unix:/run/.../pool.sock", "token": ..., ...})

KVPoolConnector is a thin facade over two objects, one per role (vLLM runs them in
different processes on CPU):

  KVPoolScheduler  get_num_new_matched_tokens: hash the prompt's complete blocks, look up
                   the longest pooled run beyond the local prefix-cache hit, report its
                   tokens (never the last prompt token: one token is always computed).
                   The lookup runs on a thread of its own: the call waits for its answer
                   at most `lookup_sync_s` (`lookup_poll_s` while the pool is being slow,
                   and at the calls after the first), else answers None (vLLM asks again at a later step, the request
                   waits, the others run); a lookup that fails or passes
                   `lookup_timeout_s` is a miss (recompute), and after a timeout the
                   pool is not asked for `pool_backoff_s` (doubling while it stays slow).
                   build_connector_meta: tell the worker which blocks to load (whole
                   blocks, by engine block id) and which newly completed prompt blocks to
                   publish (every chunk of a chunked prefill contributes its complete
                   blocks; the tail inside an incomplete block is never published).
                   Loads are synchronous (the request's first step waits for its load)
                   or asynchronous (`load_mode`: vLLM holds the request until the
                   worker reports its load finished, and no step computes on blocks
                   that failed). The default, "auto", loads asynchronously where the
                   engine schedules asynchronously: there vLLM has already scheduled
                   the request's next step when a synchronous load's failure reaches
                   the scheduler, and that step's token, sampled on the failed blocks,
                   is kept (vLLM 0.24 on CUDA).
  KVPoolWorker     register_kv_caches: verify the engine's KV layout against the one the
                   namespace declares (kvpool.connector.vllm_compat); the copier is picked by device:
                   kvpool.connector.copier.HostCopier on CPU, kvpool.connector.gpu_copier.CudaCopier on CUDA.
                   start_load_kv: lease, copy whole blocks into the KV
                   tensors, digest the installed bytes, release; a block that cannot be
                   installed (any MissCause) is reported by get_block_ids_with_load_errors
                   together with every block after it; an asynchronous load is reported
                   by get_finished (finished_recving) once it is installed, its failed
                   blocks no later than that. wait_for_save: publish the blocks
                   this step completed (two-phase, digests re-verified by the pool).

Nothing the pool holds and no failure of the pool raises out of a hook (an exception in
one ends vLLM's engine core): the probe reads one snapshot of the client's session and
segment and validates what it reads (kvpool.client.pool_client.PoolClient.probe); a lookup that fails
is a miss with its cause; a load that cannot install a block (a page of another length,
bad bytes, a page outside the segment, a pool that failed or restarted under it) is a
failed load of that block and every block after it, reported by
get_block_ids_with_load_errors, counted as a miss with its cause and recorded
(kvpool.client.transfer.load, kvpool.connector.copier, kvpool.connector.gpu_copier); a store that fails is recorded and
the request is reported finished; a preempted request's stores still queued are dropped,
not waited for. What still raises is this process's own mistake (a programming error).

Metadata is typed in both directions (KVPoolMetadata scheduler -> worker). Every lookup,
load and publish is appended to the history (kvpool.connector.history) when `history_dir` is set,
with the request's tag (`kv_transfer_params={"kvpool": {"tag": ...}}`) so a test or the
gate can follow one request across processes.

Modules:
  settings     ConnectorSettings, the namespace, the backend and copier each role opens.
  params       KVPoolMetadata, RequestParams, the inputs of a request's block chain.
  scheduler    KVPoolScheduler.        worker    KVPoolWorker.
  facade       KVPoolConnector (imported from here on first use, so the package's other
               modules load without vLLM).
  copier, gpu_copier   the worker's copy engines on CPU and on CUDA (kvpool.gpu).
  stats        kvpool's counters in vLLM's KV-connector stats.
  identity     which checkpoint a namespace names.
  history      the JSON-lines history of lookups, loads, publishes and audits.
  vllm_compat  the one place that knows vLLM's version differences.
  wrap, audit  a connector that wraps another; the audit connector built on it.
  http         the HTTP check of kvpool's request parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.connector.facade import KVPoolConnector

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    # vLLM loads `kv_connector_module_path` and takes the class by name: the facade (and
    # vLLM with it) is imported then, not when a sibling module is.
    if name == "KVPoolConnector":
        from kvpool.connector.facade import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
