"""vLLM 0.34's own scheduler and CPU connector plumbing around kvpool's connector, without a
model: the way vLLM's connector unit tests drive a connector (tests/v1/kv_connector/unit),
one engine step at a time.

  Replica(model_dir, pool_path, history_dir, name, num_blocks, load_mode, connector=...)
        one engine of the tiny model (kvgate.fixtures.tiny_model) on CPU: a VllmConfig with
        the connector; the KV cache layout resolved by vLLM's resolve_kv_cache_layout from
        the CPU attention backend's own layouts; the KVCacheConfig from vLLM's planner
        (get_kv_cache_config_from_groups); vLLM's Scheduler, whose connector is built by
        vLLM's factory; the worker's connector through ensure_kv_transfer_initialized (the
        TP group mocked, as vLLM's tests do) and vLLM's CPU ActiveKVConnector
        (vllm.v1.worker.cpu.kv_connector) around the KV tensors vLLM's allocate_kv_cache
        makes, which hands them to register_kv_caches.
  Replica.add(rid, tokens, max_tokens, **request fields) -> vllm.v1.request.Request
  Replica.step() -> SchedulerOutput
        one EngineCore step: schedule(); pre_forward (handle_preemptions, the metadata bound,
        a synchronous load started); the forward, whose attention layers run under vLLM's
        maybe_transfer_kv_layer (wait_for_layer_load before the layer, save_kv_layer after)
        and write each scheduled token's KV (`kv_row`); finish_forward; post_forward (an
        asynchronous load started after the forward, wait_for_save, get_transfer_results,
        the load errors, the stats); update_from_output. A step that schedules nothing runs
        the plumbing's no_forward, as the engine does while transfers are pending.
  Replica.run_until_idle(max_steps)    steps until the scheduler holds no request; with
                                       async_scheduling (vLLM's AsyncScheduler), each step is
                                       scheduled before the previous one's output is back, as
                                       EngineCore's batch queue of two does.
  Replica.prefix_stats / .finished     what the engine core reported: vLLM's connector
                                       prefix-cache stats per step; each finished request's
                                       kv_transfer_params.
  Replica.close()                      the worker connector's shutdown, vLLM's own way.

The model: the KV of a token at position p is a seeded function of the prompt's tokens up
to p and of the layer (`kv_row`), so a block's bytes are known from its tokens alone
(`expected_page`: a pool page, the block of every layer in layer order) and a block installed
by a load can be checked against what the producer computed. `Replica.events` records the
order of the connector's hooks and of the forward ("forward:<layer>"), and `Replica.checks`
what each attention layer found in the loaded blocks when it ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock, patch

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.cpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.utils import allocate_kv_cache

B = 32  # tokens per block: the CPU attention backend's kernel blocks are multiples of 32
SAMPLED = 11  # the token every decode step "samples" (not the tiny model's EOS, 2)
HOOKS = ("handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
         "wait_for_save", "get_finished", "clear_connector_metadata", "unregister_kv_caches", "restore_kv_caches")

init_none_hash(sha256)


def kv_row(layer: int, prefix: list[int], heads: int, head_size: int) -> torch.Tensor:
    """The (K, V) of the last token of `prefix` at `layer`: [2, heads, head_size] bf16."""
    digest = hashlib.blake2b(np.asarray(prefix, np.int64).tobytes() + bytes([layer]), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randn(2, heads, head_size, generator=g).to(torch.bfloat16)


def halves(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's KV tensor (or of one block), as the CPU attention backend views
    them: [..., heads, block_size * 2, head_size] split in two along the token axis."""
    *lead, heads, block_size, twice = block.shape
    view = block.view(*lead, heads, block_size * 2, twice // 2)
    return view[..., :block_size, :], view[..., block_size:, :]


@dataclasses.dataclass
class Geometry:
    layers: list[str]
    heads: int
    head_size: int

    def block(self, layer: int, tokens: list[int], j: int) -> torch.Tensor:
        """Block j of `tokens` at `layer`, as the forward writes it: [heads, B, 2 * head_size]."""
        out = torch.zeros(self.heads, B, 2 * self.head_size, dtype=torch.bfloat16)
        k, v = halves(out)
        for s in range(B):
            row = kv_row(layer, tokens[: j * B + s + 1], self.heads, self.head_size)
            k[:, s, :], v[:, s, :] = row[0], row[1]
        return out

    def expected_page(self, tokens: list[int], j: int) -> bytes:
        """The pool page of block j of `tokens`: the block of every layer, in layer order."""
        return b"".join(self.block(i, tokens, j).view(torch.uint8).numpy().tobytes() for i in range(len(self.layers)))


def vllm_config(model_dir: str, extra: dict[str, Any], connector: str = "KVPoolConnector",
                module: str = "kvpool.connector", max_batched: int = 512, long_prefill: int = 0,
                async_scheduling: bool = False) -> VllmConfig:
    mc = ModelConfig(model=model_dir, dtype="bfloat16", seed=0)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=2048,
                         enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=async_scheduling,
                         long_prefill_token_threshold=long_prefill)
    cc = CacheConfig(block_size=B, cache_dtype="auto", enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector=connector, kv_connector_module_path=module, kv_role="kv_both",
                          kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    return VllmConfig(scheduler_config=sc, model_config=mc, cache_config=cc, kv_transfer_config=kt,
                      device_config=DeviceConfig("cpu"))


class Replica:
    def __init__(self, model_dir: str, pool_path: str, history_dir: str, name: str, *, num_blocks: int = 64,
                 load_mode: str = "sync", connector: str = "KVPoolConnector", module: str = "kvpool.connector",
                 max_batched: int = 512, long_prefill: int = 0, async_scheduling: bool = False,
                 **settings: Any) -> None:
        extra = {"pool": f"unix:{pool_path}", "token": "tok", "replica": name, "history_dir": history_dir,
                 "load_mode": load_mode, **settings}
        self.vc = vc = vllm_config(model_dir, extra, connector, module, max_batched, long_prefill, async_scheduling)
        mc, pc = vc.model_config, vc.parallel_config
        self.geo = Geometry([f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(pc))],
                            mc.get_num_kv_heads(pc), mc.get_head_size())
        spec = FullAttentionSpec(block_size=B, num_kv_heads=self.geo.heads, head_size=self.geo.head_size,
                                 dtype=torch.bfloat16)
        supported = [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]
        layout = resolve_kv_cache_layout(vc, [supported], [spec])
        vc.cache_config.kv_cache_layout = layout.name  # as the engine core records it
        self.kv_cache_config = get_kv_cache_config_from_groups(
            vc, [KVCacheGroupSpec(list(self.geo.layers), spec)], num_blocks * spec.page_size_bytes * len(self.geo.layers))
        vc.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        scheduler_cls = AsyncScheduler if vc.scheduler_config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(vllm_config=vc, kv_cache_config=self.kv_cache_config, log_stats=True,
                                   structured_output_manager=StructuredOutputManager(vc), block_size=B)
        tp = MagicMock()
        tp.broadcast_object.side_effect = lambda value, src=0: value
        tp.rank_in_group, tp.world_size = 0, 1
        with patch("vllm.distributed.parallel_state.get_tp_group", return_value=tp):
            ensure_kv_transfer_initialized(vc, self.kv_cache_config)
        self.worker = get_kv_transfer_group()
        self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout, [B])
        self.events: list[str] = []
        self.checks: list[tuple[str, str, bool]] = []  # (request, layer, its loaded blocks were installed)
        self._spy()
        for name in self.geo.layers:  # what bind_kv_cache_to_layers gives the attention layers
            vc.compilation_config.static_forward_context[name] = SimpleNamespace(kv_cache=self.kv[name])
        self.active = ActiveKVConnector(vc, self.kv)  # register_kv_caches
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.loaded: dict[str, int] = {}  # request -> tokens vLLM had computed when it was first scheduled
        self.expect_installed: set[str] = set()  # requests whose external blocks a layer must find installed
        self.prefix_stats: list = []  # vLLM's connector prefix-cache stats, as each step reported them
        self.finished: dict[str, dict | None] = {}  # finished request -> its kv_transfer_params
        self._attend = maybe_transfer_kv_layer(self._attention)

    def _spy(self) -> None:
        for hook in HOOKS:
            inner = getattr(self.worker, hook, None)
            if inner is None:
                continue

            def spied(*args, _inner=inner, _hook=hook, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.events.append(_hook)
                return _inner(*args, **kwargs)

            setattr(self.worker, hook, spied)

    # -- requests --------------------------------------------------------------------------
    def add(self, rid: str, tokens: list[int], max_tokens: int = 2, **fields: Any) -> Request:
        kv_params = fields.pop("kv_transfer_params", None)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields.pop("sampling", {}))
        sp.update_from_generation_config({}, 2)
        req = Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(B, sha256), **fields)
        req.kv_transfer_params = kv_params
        self.scheduler.add_request(req)
        return req

    # -- one engine step -------------------------------------------------------------------
    def step(self) -> SchedulerOutput:
        so, out = self.launch()
        self._collect(self.scheduler.update_from_output(so, out))
        return so

    def launch(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """schedule() and the step's execution, without update_from_output (an engine with
        async scheduling schedules the next step before it)."""
        so = self.scheduler.schedule()
        for rid, n in so.num_scheduled_tokens.items():  # the scheduler's tokens; in flight: SAMPLED
            req = self.scheduler.requests[rid]
            toks = list(req.all_token_ids)
            self.tokens[rid] = toks + [SAMPLED] * (req.num_computed_tokens + n - len(toks))
            self.prompt_len[rid] = req.num_prompt_tokens
        for nr in so.scheduled_new_reqs:  # a resumed request comes back in full, as a new one
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            self.loaded.setdefault(nr.req_id, nr.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                self.blocks[rid].extend(cached.new_block_ids[i][0])
        if so.total_num_scheduled_tokens == 0:
            return so, self.active.no_forward(so)
        self.active.pre_forward(so)
        computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        self._step = [(rid, computed[rid], n) for rid, n in so.num_scheduled_tokens.items()]
        with set_forward_context({name: object() for name in self.geo.layers}, self.vc,
                                 slot_mapping={name: torch.zeros(0) for name in self.geo.layers}):
            for name in self.geo.layers:
                self._attend(name)  # positional, as vLLM passes it
        self.active.finish_forward()
        kvo = self.active.post_forward(so.finished_req_ids)
        sampled = [[SAMPLED] if start + n >= self.prompt_len[rid] else [] for rid, start, n in self._step]
        return so, ModelRunnerOutput(req_ids=[rid for rid, _, _ in self._step], sampled_token_ids=sampled,
                                     kv_connector_output=kvo)

    def _collect(self, outputs: dict) -> None:
        """What the engine core hands the front end: the connector's prefix-cache stats and
        each finished request's kv_transfer_params (kvpool's attribution)."""
        for eco in outputs.values():
            stats = getattr(eco, "scheduler_stats", None)
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                self.prefix_stats.append(stats.connector_prefix_cache_stats)
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.kv_transfer_params

    def _attention(self, layer_name: str) -> None:
        """One attention layer: vLLM's decorator has called wait_for_layer_load; the layer
        reads the request's earlier blocks (checked here for requests whose prefix was
        loaded) and writes the KV of the tokens scheduled this step."""
        self.events.append(f"forward:{layer_name}")
        layer = self.geo.layers.index(layer_name)
        cache = self.kv[layer_name]
        k, v = halves(cache)
        for rid, start, n in self._step:
            toks, ids = self.tokens[rid], self.blocks[rid]
            if rid in self.expect_installed and start == self.loaded.get(rid) and start:
                ok = all(torch.equal(cache[ids[j]], self.geo.block(layer, toks, j)) for j in range(start // B))
                self.checks.append((rid, layer_name, ok))
            for p in range(start, start + n):
                row = kv_row(layer, toks[: p + 1], self.geo.heads, self.geo.head_size)
                k[ids[p // B], :, p % B, :], v[ids[p // B], :, p % B, :] = row[0], row[1]

    def run_until_idle(self, max_steps: int = 400) -> list[SchedulerOutput]:
        outs: list[SchedulerOutput] = []
        in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        depth = 2 if self.vc.scheduler_config.async_scheduling else 1  # EngineCore's batch queue
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not in_flight:
                return outs
            so, out = self.launch()
            outs.append(so)
            in_flight.append((so, out))
            while len(in_flight) >= depth or (in_flight and so.total_num_scheduled_tokens == 0):
                self._collect(self.scheduler.update_from_output(*in_flight.pop(0)))  # nothing new: wait for all
            if so.total_num_scheduled_tokens == 0:
                time.sleep(0.01)  # transfers pending: the engine polls get_finished at its steps
        raise AssertionError(f"the scheduler still holds requests after {max_steps} steps")

    def close(self) -> None:
        ensure_kv_transfer_shutdown()  # the worker connector's shutdown
        self.scheduler.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None
