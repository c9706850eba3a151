"""The connector's settings (kv_connector_extra_config, checked), the namespace a replica's
KV belongs to, and the backend and copier each role opens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from functools import lru_cache
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from kvpool.connector import vllm_compat as compat
from kvpool.client.backend import PoolBackend, parse_address
from kvpool.client.pool_client import PoolClient
from kvpool.connector.copier import HostCopier
from kvpool.connector.history import HistoryWriter
from kvpool.connector.identity import model_identity
from kvpool.errors import InvalidRequest
from kvpool.gpu.config import SKETCH_IMPLS
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics
from kvpool.tier.record import TierAuth


if TYPE_CHECKING:
    from kvpool.connector.gpu_copier import CudaCopier

Copier = Union[HostCopier, "CudaCopier"]  # one interface (kvpool.connector.copier's docstring); a wrapper keeps it

# -- settings -------------------------------------------------------------------------------


LOAD_MODES = ("auto", "sync", "async")
GPU_SKETCHES = ("auto", *SKETCH_IMPLS)
GPU_CHUNK_MIB_MAX = 4096  # three staging buffers of 4 GiB: past this a chunk only costs GPU memory
# A pool address naming a GPU keeper's run directory (`kvpool keeper`): the connector's pool is
# then the keeper's tier (kvpool.gpu.tier_backend), with kv-sketch-1 digests; its reset is
# refused (the keeper evicts nothing on a client's word). In host memory (--backing memfd) either
# copier moves its pages; in device memory (--backing vmm) the GPU copier does (CudaCopier: the
# transfer engine on the device pages, mapped on the worker's CUDA device). With `host_pool`
# too, a lookup or load that misses the keeper's tier falls through to that host pool
# (kvpool.gpu.tiered.TieredBackend: the tier, then the host pool).
KEEPER_SCHEME = "keeper:"


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, typed. Unknown keys are an error, not a silent default."""

    pool: str  # "unix:PATH", "tcp:HOST:PORT", or "keeper:RUN_DIR" (a GPU keeper's tier)
    tenant: str = "default"
    token: str = ""
    token_file: str = ""  # JSON {tenant: token}; used when token is empty
    # With pool "keeper:RUN_DIR" only: the host pool ("unix:PATH" or "tcp:HOST:PORT") a lookup
    # or load falls through to where the keeper's tier misses (its blocks, the ones it demoted,
    # or all of them while the keeper is down: the tier's misses are then transport_error), and
    # a publish where the tier has no room (kvpool.gpu.tiered). The tenant is the connector's;
    # its token host_token, else host_token_file's (JSON {tenant: token}), else the connector's.
    host_pool: str = ""
    host_token: str = ""
    host_token_file: str = ""
    replica: str = "replica"
    history_dir: str = ""
    load: bool = True
    publish: bool = True
    load_deadline_s: float = 10.0
    # "sync": a load runs in the request's first step (wait_for_layer_load waits for it);
    # "async": vLLM holds the request until the load is reported finished; "auto": async
    # where the engine schedules asynchronously (vLLM's async_scheduling), sync otherwise.
    load_mode: str = "auto"
    timeout_s: float = 10.0
    # A lookup whose first missing block is being published (reserved, not yet committed)
    # waits this long for its commit: a session's next turn on another replica must not
    # depend on whether the previous turn's store landed before the response did. Bounded,
    # since the lookup runs in vLLM's scheduler; running out is the `in_flight` miss.
    lookup_wait_pending_s: float = 0.5
    # The scheduler's hot path: its pool connection times out after lookup_timeout_s (plus
    # the pending wait above); a scheduler call waits lookup_sync_s at most for an answer,
    # then defers the request to a later step; after a timeout the pool is left alone for
    # pool_backoff_s, doubled while it keeps timing out, up to pool_backoff_max_s.
    lookup_timeout_s: float = 1.0
    lookup_sync_s: float = 0.2
    lookup_poll_s: float = 0.005  # a later call's wait for the same answer (and a slow pool's first)
    pool_backoff_s: float = 1.0
    pool_backoff_max_s: float = 30.0
    # A same-host scheduler first probes its tenant segment's index (PoolClient.probe: no
    # round trip) and claims at once a run the index holds whole, while the daemon's
    # heartbeat is at most probe_fresh_s old. A run it holds in part, or a stale heartbeat,
    # goes to the daemon's lookup, which also says why the run stops. 0: always ask.
    probe_fresh_s: float = 0.1
    # The network tier (kvpool.tier), for blocks this host's pool lacks: a URL
    # ("redis://HOST:PORT/DB"); empty: none. Lookups past the pool's run of hits ask the
    # tier which blocks it holds; loads read them from it; publishes also put to it.
    tier: str = ""
    # The tenant's tier secret (16 bytes or more; the same for its replicas on every host;
    # never given to the store): its records are authenticated, and its store keys made
    # opaque, with keys derived from it (kvpool.tier.record.TierAuth). tier_secret_file: JSON
    # {tenant: secret}, used when tier_secret is empty. A tier needs one.
    tier_secret: str = ""
    tier_secret_file: str = ""
    tier_timeout_s: float = 1.0
    tier_publish: bool = True
    # A tier load stops at its deadline (the rest of its run is recomputed); the scheduler
    # claims from the tier only what its measured rate moves within the deadline, and holds
    # a failing tier off for tier_backoff_s, doubled while it keeps failing, up to
    # tier_backoff_max_s (kvpool.tier.rule).
    tier_deadline_s: float = 1.0
    tier_backoff_s: float = 1.0
    tier_backoff_max_s: float = 30.0
    # On CPU: fault the engine's KV tensors in at registration (kvpool.pool.copy.prefault), so that
    # a load into blocks the engine never touched does not pay a page fault per 4 KiB.
    prefault_kv: bool = True
    # On CUDA (kvpool.gpu.config.TransferConfig): the staged copy chunk of the GPU engine in MiB
    # (0: the engine's 128 MiB; the host waits once per chunk of a load for its checks, so a
    # keeper's tier in device memory, whose copies take microseconds, gains from larger ones;
    # three staging buffers of it are allocated on the GPU), and how kv-sketch-1 runs there
    # ("auto", "triton-dot", "int8-mm", "float64-mm": kvpool.gpu.sketch).
    gpu_chunk_mib: int = 0
    gpu_sketch: str = "auto"
    # On CUDA, out of a keeper's tier in device memory: each chunk written straight into the
    # blocks by the kernel that sketches it (kvpool.gpu.config.TransferConfig.install_direct;
    # false: staged, then installed)
    gpu_install_direct: bool = True
    model_id: str = ""  # a stable model name for the namespace (default: the model path)
    model_revision: str = ""  # overrides the model fingerprint in the namespace

    def __post_init__(self) -> None:
        self.check_host_pool()

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown kvpool connector settings {unknown}; known: {sorted(names)}")
        if "pool" not in extra:
            raise ValueError("kv_connector_extra_config needs 'pool' (e.g. 'unix:/path/pool.sock')")
        if extra.get("gpu_sketch", "auto") not in GPU_SKETCHES:
            raise ValueError(f"gpu_sketch must be one of {GPU_SKETCHES}, got {extra['gpu_sketch']!r}")
        chunk = extra.get("gpu_chunk_mib", 0)
        if type(chunk) is not int or not 0 <= chunk <= GPU_CHUNK_MIB_MAX:
            raise ValueError(f"gpu_chunk_mib must be a whole number of MiB from 0 to {GPU_CHUNK_MIB_MAX} (three "
                             f"staging buffers of it go on the GPU), got {chunk!r}")
        if type(extra.get("gpu_install_direct", True)) is not bool:
            raise ValueError(f"gpu_install_direct must be true or false, got {extra['gpu_install_direct']!r}")
        if extra.get("load_mode", "auto") not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {extra['load_mode']!r}")
        return cls(**extra)

    def check_host_pool(self) -> None:
        """host_pool (and its token) only beside a keeper's pool, and an address of a pool daemon."""
        if not self.host_pool:
            if self.host_token or self.host_token_file:
                raise ValueError("host_token / host_token_file are for a host_pool, and none is set")
            return
        if not (isinstance(self.pool, str) and self.pool.startswith(KEEPER_SCHEME)):
            raise ValueError(f"host_pool is the pool a keeper's tier falls through to: it needs pool "
                             f"'{KEEPER_SCHEME}RUN_DIR', not {self.pool!r}")
        if not isinstance(self.host_pool, str):
            raise ValueError(f"host_pool must be a pool daemon's address, got {self.host_pool!r}")
        try:
            parse_address(self.host_pool)
        except InvalidRequest as exc:
            raise ValueError(f"host_pool {self.host_pool!r} is not a pool daemon's address "
                             "('unix:PATH' or 'tcp:HOST:PORT')") from exc

    def resolved_host_token(self) -> str:
        """The host pool's token for the connector's tenant."""
        if self.host_token:
            return self.host_token
        if self.host_token_file:
            return json.loads(Path(self.host_token_file).read_text())[self.tenant]
        return self.resolved_token()

    def loads_async(self, vllm_config) -> bool:  # noqa: ANN001
        """Whether this engine's loads are asynchronous, by `load_mode`."""
        if self.load_mode == "auto":
            return compat.schedules_async(vllm_config)
        return self.load_mode == "async"

    def resolved_token(self) -> str:
        if self.token:
            return self.token
        if self.token_file:
            return json.loads(Path(self.token_file).read_text())[self.tenant]
        raise ValueError(f"no token for tenant {self.tenant!r}: set 'token' or 'token_file'")

    def tier_auth(self) -> TierAuth:
        """The tenant's tier keys (kvpool.tier.record.TierAuth), from tier_secret or tier_secret_file."""
        secret = self.tier_secret or (json.loads(Path(self.tier_secret_file).read_text()).get(self.tenant, "")
                                      if self.tier_secret_file else "")
        if not secret:
            raise ValueError(f"a network tier needs tenant {self.tenant!r}'s tier secret ('tier_secret' or "
                             "'tier_secret_file'): its records are authenticated with it")
        return TierAuth.from_secret(self.tenant, secret)


# -- namespace ------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def _tokenizer_fingerprint(path: str) -> str:
    root = Path(path)
    if not root.is_dir():
        return path
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt"):
        f = root / name
        if f.exists():
            h.update(name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def namespace_for(vllm_config, settings: ConnectorSettings, tp_rank: int = 0) -> Namespace:  # noqa: ANN001
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    revision = settings.model_revision or model_identity(str(mc.model), mc.revision)  # every weight (kvpool.connector.identity)
    return Namespace(
        model_id=settings.model_id or str(mc.model),
        model_revision=str(revision),
        tokenizer_hash=_tokenizer_fingerprint(str(mc.tokenizer)),
        kv_dtype=kv_dtype,
        kv_layout=compat.layout_name(compat.device_type(vllm_config)),
        block_size=int(cc.block_size),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        tp_rank=tp_rank,
        tp_world_size=int(pc.tensor_parallel_size),
        tenant=settings.tenant,
    )


def tier_device_index(role: str) -> int | None:
    """The CUDA device on which a role maps a keeper's buffer: the worker's, the device torch
    has made current in this process (vLLM's worker sets it before its connector starts); None
    (the mapping's default, device 0; nothing on the GPU for a memfd keeper) for the scheduler
    and wherever torch has not started CUDA (a CPU replica). torch is not imported here."""
    if role != "worker":
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def connect_backend(settings: ConnectorSettings, role: str, history: HistoryWriter,
                    metrics: ClientMetrics | None = None) -> PoolBackend:
    """The default BackendFactory: a PoolClient to the configured pool (the scheduler's
    with the scheduler's short timeout); a TierBackend of the keeper a `keeper:` address names
    (the worker's mapping on its own CUDA device: tier_device_index); with a host_pool beside
    it, the two in lookup order (kvpool.gpu.tiered.TieredBackend: "gpu", then "host"), where a
    keeper that is not up yet joins when it answers (the host pool serves meanwhile)."""
    timeout = settings.lookup_timeout_s if role == "scheduler" else settings.timeout_s
    if settings.pool.startswith(KEEPER_SCHEME):  # a GPU keeper's tier (memfd: host memory; vmm: device memory)
        from kvpool.gpu.tier_backend import TierBackend
        from kvpool.gpu.tier_client import TierLink

        link = TierLink(settings.pool[len(KEEPER_SCHEME):], settings.tenant, settings.resolved_token(),
                        name=f"{settings.replica}/{role}", timeout_s=timeout, metrics=metrics,
                        device_index=tier_device_index(role))
        if not settings.host_pool:
            return TierBackend(link.connect())
        from kvpool.gpu.tiered import TieredBackend

        tier = TierBackend(link)  # not connected yet: a keeper not started joins when it answers

        try:
            host = PoolClient(settings.host_pool, settings.tenant, settings.resolved_host_token(),
                              name=f"{settings.replica}/{role}", timeout_s=timeout, metrics=metrics)
        except BaseException:
            tier.close()
            raise
        try:
            return TieredBackend([("gpu", tier), ("host", host)])
        except BaseException:  # TierMismatch: the keeper's and the pool's page sizes differ
            tier.close()
            host.close()
            raise
    return PoolClient(settings.pool, settings.tenant, settings.resolved_token(),
                      name=f"{settings.replica}/{role}", timeout_s=timeout, metrics=metrics)


# Extension points for a wrapper (kvpool.connector.audit's twin for faults, or instrumentation):
# KVPoolConnector(..., backend_factory=f, copier_factory=g) builds its pool backend and its
# copy engine through them. A factory may wrap the default one; what it returns must keep
# the interface (kvpool.client.backend.PoolBackend; kvpool.connector.copier's copier interface).
BackendFactory = Callable[[ConnectorSettings, str, HistoryWriter, "ClientMetrics | None"], PoolBackend]
CopierFactory = Callable[[ConnectorSettings, PoolBackend, HistoryWriter, ClientMetrics, str], Copier]
