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
                   namespace declares (kvpool.vllm_compat); the copier is picked by device:
                   kvpool.copier.HostCopier on CPU, kvpool.gpu_copier.CudaCopier on CUDA.
                   start_load_kv: lease, copy whole blocks into the KV
                   tensors, digest the installed bytes, release; a block that cannot be
                   installed (any MissCause) is reported by get_block_ids_with_load_errors
                   together with every block after it; an asynchronous load is reported
                   by get_finished (finished_recving) once it is installed, its failed
                   blocks no later than that. wait_for_save: publish the blocks
                   this step completed (two-phase, digests re-verified by the pool).

Nothing the pool holds and no failure of the pool raises out of a hook (an exception in
one ends vLLM's engine core): the probe reads one snapshot of the client's session and
segment and validates what it reads (kvpool.client.PoolClient.probe); a lookup that fails
is a miss with its cause; a load that cannot install a block (a page of another length,
bad bytes, a page outside the segment, a pool that failed or restarted under it) is a
failed load of that block and every block after it, reported by
get_block_ids_with_load_errors, counted as a miss with its cause and recorded
(kvpool.client.load, kvpool.copier, kvpool.gpu_copier); a store that fails is recorded and
the request is reported finished; a preempted request's stores still queued are dropped,
not waited for. What still raises is this process's own mistake (a programming error).

Metadata is typed in both directions (KVPoolMetadata scheduler -> worker). Every lookup,
load and publish is appended to the history (kvpool.history) when `history_dir` is set,
with the request's tag (`kv_transfer_params={"kvpool": {"tag": ...}}`) so a test or the
gate can follow one request across processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Union

from kvpool import vllm_compat as compat
from kvpool.client import PoolBackend, PoolClient
from kvpool.copier import CopyRun, HostCopier
from kvpool.copy import prefault
from kvpool.errors import MissCause, PoolError, PoolTimeout
from kvpool.history import HistoryWriter
from kvpool.identity import model_identity
from kvpool.keys import HASH_BYTES, ROOT_HASH, Namespace, block_hashes
from kvpool.metrics import ClientMetrics
from kvpool.catalog import LookupResult
from kvpool.tier import TierAuth, TierError
from kvpool.tier_registry import open_tier
from kvpool.stats import KVPoolPromMetrics, KVPoolStats, StatsCollector
from kvpool.tier_rule import TierLoadStat, TierRule

if TYPE_CHECKING:
    from kvpool.gpu_copier import CudaCopier

Copier = Union[HostCopier, "CudaCopier"]  # one interface (kvpool.copier's docstring); a wrapper keeps it

# -- settings -------------------------------------------------------------------------------


LOAD_MODES = ("auto", "sync", "async")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, typed. Unknown keys are an error, not a silent default."""

    pool: str  # "unix:PATH" or "tcp:HOST:PORT"
    tenant: str = "default"
    token: str = ""
    token_file: str = ""  # JSON {tenant: token}; used when token is empty
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
    # opaque, with keys derived from it (kvpool.tier.TierAuth). tier_secret_file: JSON
    # {tenant: secret}, used when tier_secret is empty. A tier needs one.
    tier_secret: str = ""
    tier_secret_file: str = ""
    tier_timeout_s: float = 1.0
    tier_publish: bool = True
    # A tier load stops at its deadline (the rest of its run is recomputed); the scheduler
    # claims from the tier only what its measured rate moves within the deadline, and holds
    # a failing tier off for tier_backoff_s, doubled while it keeps failing, up to
    # tier_backoff_max_s (kvpool.tier_rule).
    tier_deadline_s: float = 1.0
    tier_backoff_s: float = 1.0
    tier_backoff_max_s: float = 30.0
    # On CPU: fault the engine's KV tensors in at registration (kvpool.copy.prefault), so that
    # a load into blocks the engine never touched does not pay a page fault per 4 KiB.
    prefault_kv: bool = True
    model_id: str = ""  # a stable model name for the namespace (default: the model path)
    model_revision: str = ""  # overrides the model fingerprint in the namespace

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown kvpool connector settings {unknown}; known: {sorted(names)}")
        if "pool" not in extra:
            raise ValueError("kv_connector_extra_config needs 'pool' (e.g. 'unix:/path/pool.sock')")
        if extra.get("load_mode", "auto") not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {extra['load_mode']!r}")
        return cls(**extra)

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
        """The tenant's tier keys (kvpool.tier.TierAuth), from tier_secret or tier_secret_file."""
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
    revision = settings.model_revision or model_identity(str(mc.model), mc.revision)  # every weight (kvpool.identity)
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


def connect_backend(settings: ConnectorSettings, role: str, history: HistoryWriter,
                    metrics: ClientMetrics | None = None) -> PoolBackend:
    """The default BackendFactory: a PoolClient to the configured pool (the scheduler's
    with the scheduler's short timeout)."""
    timeout = settings.lookup_timeout_s if role == "scheduler" else settings.timeout_s
    return PoolClient(settings.pool, settings.tenant, settings.resolved_token(),
                      name=f"{settings.replica}/{role}", timeout_s=timeout, metrics=metrics)


# Extension points for a wrapper (kvpool.audit's twin for faults, or instrumentation):
# KVPoolConnector(..., backend_factory=f, copier_factory=g) builds its pool backend and its
# copy engine through them. A factory may wrap the default one; what it returns must keep
# the interface (kvpool.client.PoolBackend; kvpool.copier's copier interface).
BackendFactory = Callable[[ConnectorSettings, str, HistoryWriter, "ClientMetrics | None"], PoolBackend]
CopierFactory = Callable[[ConnectorSettings, PoolBackend, HistoryWriter, ClientMetrics, str], Copier]


# -- metadata -------------------------------------------------------------------------------

BlockRun = CopyRun  # consecutive blocks of one request: engine block ids and their pool keys


@dataclasses.dataclass
class KVPoolMetadata(compat.KVConnectorMetadata):
    loads: list[BlockRun] = dataclasses.field(default_factory=list)
    # loads of requests vLLM holds (WAITING_FOR_REMOTE_KVS) until get_finished reports them:
    # no step reads these blocks before that
    async_loads: list[BlockRun] = dataclasses.field(default_factory=list)
    stores: list[BlockRun] = dataclasses.field(default_factory=list)
    # requests preempted since the last step: their blocks are free now, so their stores
    # must finish before the next forward may write into those blocks
    drain: list[str] = dataclasses.field(default_factory=list)


# -- scheduler side -------------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    tag: str
    n_prompt: int
    hashes: list[bytes]  # every complete prompt block
    publish_blocks: int  # publish boundary, in blocks
    block_ids: list[int] = dataclasses.field(default_factory=list)
    published: int = 0  # blocks [0, published) are in the pool or on their way
    stored: bool = False  # a store was handed to the worker: free the blocks only after it
    load: tuple[int, int] | None = None  # blocks [b0, b1) to load this step
    # an asynchronous load was handed to the worker and the request has not been scheduled
    # since: asked to match again meanwhile, its load failed (vLLM freed its blocks)
    loading_async: bool = False
    load_allowed: bool = True  # the request's own `load` flag (false when its params were malformed)
    tier_blocks: int = 0  # of the last lookup's hit, the blocks past the pool's run that the tier holds
    tier_from: int | None = None  # the load's first block read from the tier
    attribution: dict[str, Any] | None = None  # the last lookup's outcome, for the response (request_finished)
    load_failed: bool = False  # vLLM reported blocks of its load invalid: recomputed
    loaded_ids: set[int] = dataclasses.field(default_factory=set)  # engine blocks its loads were handed
    # before its first lookup: the engine's arrival stamp (wall clock, the front end's) and the
    # first scheduler call's own preparation (the prompt's hashes), in the lookup records
    timing: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """A request's `kv_transfer_params["kvpool"]`, typed. Everything a request carries is
    checked here, before it can reach a scheduler hook: an exception there would end vLLM's
    engine core for every request. A malformed field is not an exception but `error`: the
    request is then served without the pool (nothing loaded, nothing published), and the
    history says why."""

    tag: str | None = None
    load: bool = True
    publish: bool = True
    publish_tokens: int | None = None
    error: str | None = None

    KNOWN = ("tag", "load", "publish", "publish_tokens")

    @classmethod
    def of(cls, request) -> RequestParams:  # noqa: ANN001
        return cls.parse(getattr(request, "kv_transfer_params", None))

    @classmethod
    def parse(cls, params: object) -> RequestParams:
        """The same check of a request's raw `kv_transfer_params` (kvpool.http runs it on
        the HTTP body, before the request reaches the engine)."""
        if params is None:
            return cls()
        if not isinstance(params, dict):
            return cls(load=False, publish=False, error=f"kv_transfer_params must be an object, got {params!r}"[:200])
        ours = params.get("kvpool")
        if ours is None:
            return cls()
        if not isinstance(ours, dict):
            return cls(load=False, publish=False, error=f"kv_transfer_params.kvpool must be an object, got {ours!r}"[:200])
        problems = [f"unknown field {k!r}" for k in ours if k not in cls.KNOWN]
        tag = ours.get("tag")
        if tag is not None and not isinstance(tag, (str, int)):
            problems.append(f"tag must be a string, got {tag!r}")
        for flag in ("load", "publish"):
            if ours.get(flag) is not None and not isinstance(ours[flag], bool):
                problems.append(f"{flag} must be true or false, got {ours[flag]!r}")
        limit = ours.get("publish_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            problems.append(f"publish_tokens must be a non-negative integer, got {limit!r}")
        if problems:
            return cls(tag=str(tag)[:200] if isinstance(tag, (str, int)) else None, load=False, publish=False,
                       error=("kv_transfer_params.kvpool: " + "; ".join(problems))[:400])
        return cls(str(tag) if tag is not None else None, ours.get("load", True) is not False,
                   ours.get("publish", True) is not False, limit)


def _request_tag(request) -> str:  # noqa: ANN001
    tag = RequestParams.of(request).tag
    return tag if tag else str(request.request_id)


def _salt_root(request) -> bytes:  # noqa: ANN001
    """A request's cache_salt isolates its cache: it seeds the block chain."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return ROOT_HASH
    return hashlib.blake2b(b"kvgate/cache-salt/" + str(salt).encode(), digest_size=HASH_BYTES).digest()


class UnsupportedInput(ValueError):
    """A request carries something that changes its KV and that the keys cannot represent:
    the request neither loads nor publishes (it is served, recorded as `unsupported`)."""


@dataclasses.dataclass(frozen=True)
class ChainInputs:
    """What besides its token ids changes a request's KV, as its block chain takes it: the
    LoRA adapter (mixed into the chain's root), multimodal items (each mixed into every
    complete block its placeholder overlaps, by the item's content hash)."""

    root: bytes = ROOT_HASH
    extras: tuple[bytes, ...] | None = None

    def hashes(self, tokens: Sequence[int], block_size: int, salt_root: bytes = ROOT_HASH) -> list[bytes]:
        root = self.root if salt_root == ROOT_HASH else (
            salt_root if self.root == ROOT_HASH else
            hashlib.blake2b(salt_root + self.root, digest_size=HASH_BYTES).digest())
        n = (len(tokens) // block_size) * block_size
        extras = None if self.extras is None else list(self.extras[: n // block_size])
        return block_hashes(tokens[:n], block_size, parent=root, extras=extras)


def chain_inputs(request, block_size: int) -> ChainInputs:  # noqa: ANN001
    """A request's ChainInputs; UnsupportedInput for what the keys cannot represent (prompt
    embeddings; multimodal items without a content hash or a placeholder position)."""
    if getattr(request, "prompt_embeds", None) is not None:
        raise UnsupportedInput("prompt embeddings: the KV depends on vectors the keys do not hash")
    root = ROOT_HASH
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        ident = "\0".join(str(getattr(lora, f, "") or "") for f in ("lora_name", "lora_int_id", "lora_path"))
        root = hashlib.blake2b(b"kvgate/lora/" + ident.encode(), digest_size=HASH_BYTES).digest()
    features = getattr(request, "mm_features", None) or []
    if not features:
        return ChainInputs(root)
    n_blocks = len(getattr(request, "prompt_token_ids", None) or []) // block_size
    extras = [b""] * n_blocks
    for f in features:
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        offset, length = getattr(pos, "offset", None), getattr(pos, "length", None)
        if not ident or not isinstance(offset, int) or not isinstance(length, int) or length <= 0 or offset < 0:
            raise UnsupportedInput(f"a multimodal item without a content hash or a position ({type(f).__name__})")
        for i in range(offset // block_size, min(n_blocks, -(-(offset + length) // block_size))):
            extras[i] += hashlib.blake2b(f"{ident}@{offset}".encode(), digest_size=HASH_BYTES).digest()
    return ChainInputs(root, tuple(extras))


def request_inputs(request, block_size: int) -> tuple[ChainInputs, str | None]:  # noqa: ANN001
    """(the request's ChainInputs, None), or (plain ChainInputs, why) when its keys cannot
    represent it: such a request is served without the pool, keyed by its tokens alone."""
    try:
        return chain_inputs(request, block_size), None
    except UnsupportedInput as exc:
        return ChainInputs(), str(exc)


def kv_groups_unsupported(kv_cache_config) -> str | None:  # noqa: ANN001
    """Why the connector cannot serve this engine's KV cache, if it cannot: it moves the
    blocks of one KV-cache group, so an engine with several (sliding-window and full
    attention layers, say) would share only part of each block's KV."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        return f"{len(groups)} KV-cache groups: the connector moves one group's blocks"
    return None


@dataclasses.dataclass
class _Lookup:
    """A lookup in flight for one request, from the first block past its local hit."""

    first_block: int
    future: Future
    started: float
    deferred: int = 0  # scheduler calls answered None while it ran


class KVPoolScheduler:
    def __init__(self, vllm_config, settings: ConnectorSettings,  # noqa: ANN001
                 backend_factory: BackendFactory = connect_backend, kv_cache_config=None) -> None:  # noqa: ANN001
        self.settings = settings
        self.unsupported_config = kv_groups_unsupported(kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.ns = namespace_for(vllm_config, settings)
        self.history = HistoryWriter(settings.history_dir, settings.replica, "scheduler")
        self.load_async = settings.loads_async(vllm_config)
        self.history.write("namespace", ns=self.ns.as_dict(), load_mode="async" if self.load_async else "sync")
        self.backend = backend_factory(settings, "scheduler", self.history, None)
        self.tier = open_tier(settings.tier, settings.tier_auth(), settings.tier_timeout_s) if settings.tier else None
        self.tier_rule = TierRule(settings.tier_deadline_s, settings.tier_backoff_s, settings.tier_backoff_max_s) \
            if settings.tier else None
        self._reqs: dict[str, _Request] = {}
        self.stats = StatsCollector()  # this interval's lookups (vLLM's connector stats, kvpool.stats)
        self._lookups: dict[str, _Lookup] = {}
        self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="kvpool-lookup")
        self._paused_until = 0.0  # no lookups before this: the pool timed out
        self._backoff_s = settings.pool_backoff_s
        # Past this a lookup is given up even if the client has not timed out (connect, hello,
        # the call and its one resend are each bounded by lookup_timeout_s).
        self._give_up_s = 3 * settings.lookup_timeout_s + settings.lookup_wait_pending_s

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:  # noqa: ANN001
        B = self.block_size
        called = time.monotonic()
        tokens = list(request.prompt_token_ids or [])
        n = len(tokens)
        st = self._reqs.get(request.request_id)
        if st is None:
            params = RequestParams.of(request)
            limit = params.publish_tokens
            inputs, unsupported = request_inputs(request, B)
            unsupported = unsupported or self.unsupported_config
            hashes = inputs.hashes(tokens, B, _salt_root(request))
            pub = len(hashes) if limit is None else min(len(hashes), limit // B)
            if not params.publish or unsupported:
                pub = 0
            st = self._reqs[request.request_id] = _Request(params.tag or str(request.request_id), n, hashes, pub,
                                                           load_allowed=params.load and not unsupported)
            if params.error:
                self.history.write("invalid_params", req=request.request_id, tag=st.tag, error=params.error)
            if unsupported:  # served without the pool: neither loads nor publishes, and says why
                self.history.write("unsupported", req=request.request_id, tag=st.tag, reason=unsupported)
        max_blocks = (n - 1) // B  # at least one prompt token is always computed
        local_blocks = num_computed_tokens // B
        record: dict[str, Any] = {"req": request.request_id, "tag": st.tag, "prompt_tokens": n,
                                  "local_tokens": num_computed_tokens, "max_blocks": max_blocks}
        if not st.timing:
            prep = time.monotonic() - called
            st.timing = {"arrival": getattr(request, "arrival_time", None), "first_call": time.time() - prep,
                         "prep_us": round(prep * 1e6, 1)}
            events = getattr(request, "events", None) or []  # the engine's own stamps (with its stats on)
            if events and hasattr(events[0], "timestamp"):  # QUEUED: the engine core took the request in
                st.timing["queued_us"] = round((called - events[0].timestamp) * 1e6, 1)
        record.update(st.timing)
        if st.loading_async:  # matched again before it was scheduled: vLLM dropped its failed load
            st.loading_async = False
            st.load_allowed = False  # what the pool holds for it failed once: recompute the rest
            self._note_lookup(st, **record, external_tokens=0, hit_blocks=0, outcome="skipped",
                               reason="its asynchronous load failed: recomputed")
            return 0, False
        if not (self.settings.load and st.load_allowed) or local_blocks >= max_blocks:
            self._note_lookup(st, **record, external_tokens=0, hit_blocks=0,
                               outcome="local_hit" if local_blocks >= max_blocks and local_blocks else "skipped")
            return 0, False
        now = time.monotonic()
        rid = request.request_id
        pending = self._lookups.get(rid)
        if pending is not None and pending.first_block != local_blocks:  # the local hit moved: ask anew
            pending.future.cancel()
            del self._lookups[rid]
            pending = None
        if pending is None:
            if now < self._paused_until:
                self._note_lookup(st, **record, external_tokens=0, hit_blocks=0, outcome="miss",
                                   miss_cause=MissCause.TIMEOUT.value,
                                   error=f"the pool timed out: no lookups for {self._paused_until - now:.2f} s more")
                return 0, False
            probed = self._probe(st.hashes[local_blocks:max_blocks])
            if probed is not None:
                self._note_lookup(st, **record, external_tokens=probed * B, hit_blocks=probed,
                                   outcome="remote_hit", first_block=local_blocks, miss_cause=None, miss_index=None,
                                   miss_fields=[], load_async=self.load_async, via="probe",
                                   lookup_us=round((time.monotonic() - now) * 1e6, 1), deferred=0)
                return probed * B, self.load_async
            slow = any(now - x.started > self.settings.lookup_sync_s for x in self._lookups.values())
            future = self._lookup_thread.submit(self._lookup, st.hashes[local_blocks:max_blocks])
            pending = self._lookups[rid] = _Lookup(local_blocks, future, now)
            budget = self.settings.lookup_poll_s if slow else self.settings.lookup_sync_s  # slow now: barely wait
        else:
            budget = self.settings.lookup_poll_s
        try:
            found = pending.future.result(timeout=budget)
        except FutureTimeout:
            if time.monotonic() - pending.started < self._give_up_s:
                pending.deferred += 1
                return None, False  # vLLM asks again at a later step; meanwhile the other requests run
            pending.future.cancel()
            found = PoolTimeout(f"no answer within {self._give_up_s:.2f} s")
        except PoolError as exc:
            found = exc
        del self._lookups[rid]
        waited = dict(lookup_us=round((time.monotonic() - pending.started) * 1e6, 1), deferred=pending.deferred)
        if isinstance(found, PoolError):  # the pool is unreachable or too slow: recompute, and say why
            cause = MissCause.TIMEOUT if isinstance(found, PoolTimeout) else MissCause.TRANSPORT_ERROR
            if cause == MissCause.TIMEOUT:
                self._paused_until = time.monotonic() + self._backoff_s
                self._backoff_s = min(2 * self._backoff_s, self.settings.pool_backoff_max_s)
            self._note_lookup(st, **record, external_tokens=0, hit_blocks=0, outcome="miss",
                               miss_cause=cause.value, error=f"{type(found).__name__}: {found}", **waited)
            return 0, False
        self._backoff_s = self.settings.pool_backoff_s
        found, st.tier_blocks, tier_note = found
        hit = len(found.hits)
        miss = found.miss
        claim = hit + st.tier_blocks
        extra = {} if self.tier is None else {"tier_blocks": st.tier_blocks, **tier_note}
        self._note_lookup(st, **record, external_tokens=claim * B, hit_blocks=hit,
                           outcome="remote_hit" if claim else "miss", first_block=local_blocks,
                           miss_cause=miss.cause.value if miss else None,
                           miss_index=(local_blocks + miss.index) if miss else None,
                           miss_fields=list(miss.fields) if miss else [], load_async=bool(claim and self.load_async),
                           **extra, **waited)
        return claim * B, bool(claim and self.load_async)

    def _note_lookup(self, st: _Request, **fields: Any) -> None:
        """A lookup's outcome: the history's record, the replica's counters (vLLM's connector
        stats, kvpool.stats) and the request's attribution (returned in its response's
        kv_transfer_params when it finishes)."""
        self.history.write("lookup", **fields)
        outcome = fields["outcome"]
        if outcome == "remote_hit" and fields.get("tier_blocks") and not fields.get("hit_blocks"):
            outcome = "tier_hit"
        self.stats.lookup(outcome, fields.get("miss_cause"), fields.get("via") == "probe")
        kind = {"remote_hit": "remote", "tier_hit": "tier", "local_hit": "local"}.get(outcome)
        if kind is None:
            kind = "local" if fields.get("local_tokens") else "cold"
        st.attribution = {"hit_kind": kind, "prompt_tokens": fields.get("prompt_tokens"),
                          "local_tokens": fields.get("local_tokens", 0),
                          "loaded_blocks": fields.get("hit_blocks", 0) + int(fields.get("tier_blocks") or 0),
                          "tier_blocks": int(fields.get("tier_blocks") or 0), "miss_cause": fields.get("miss_cause"),
                          "via": fields.get("via", "lookup" if outcome in ("remote_hit", "tier_hit", "miss") else None)}

    def take_stats(self) -> KVPoolStats | None:
        return self.stats.take()

    def _probe(self, hashes: list[bytes]) -> int | None:
        """The whole run from the segment's index, if it holds all of it and the daemon's
        heartbeat is fresh; None: ask the daemon. Not with a tier, whose blocks past the
        pool's run only a lookup finds."""
        probe = getattr(self.backend, "probe", None)
        if probe is None or self.tier is not None or self.settings.probe_fresh_s <= 0 or not hashes:
            return None
        try:
            run = probe(self.ns, hashes, self.settings.probe_fresh_s)
        except PoolError:
            return None  # the lookup meets the same failure and records it
        return run if run == len(hashes) else None

    def _lookup(self, hashes: list[bytes]) -> tuple[LookupResult, int, dict[str, Any]]:
        """On the lookup thread: the pool's run of hits, then how many of the blocks past it
        to read from the tier (where the pool never had them or evicted them): those it
        holds, as far as the tier rule allows (kvpool.tier_rule). A tier that fails or is
        held off is no hit, and the record says why."""
        found = self.backend.lookup(self.ns, hashes, wait_pending_s=self.settings.lookup_wait_pending_s)
        hit = len(found.hits)
        if self.tier is None or hit >= len(hashes) or (
                found.miss is not None and found.miss.cause not in (MissCause.NEVER_PUBLISHED, MissCause.EVICTED)):
            return found, 0, {}
        held = self.tier_rule.allow_lookup(time.monotonic())
        if held is not None:
            return found, 0, {"tier_held": held}
        try:
            there = self.tier.exists(self.ns, hashes[hit:])
        except TierError as exc:
            why = f"{type(exc).__name__}: {exc}"
            self.tier_rule.fail(time.monotonic(), why)
            return found, 0, {"tier_error": why}
        claim, limit = self.tier_rule.claim(there, time.monotonic())
        return found, claim, {"tier_found": there, **({"tier_limit": limit} if limit else {})}

    def update_connector_output(self, connector_output) -> None:  # noqa: ANN001
        """The worker's tier loads of the last step (vLLM's connector stats) teach the tier rule."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:  # the loads that failed: their requests were recomputed (the response says so)
            for st in self._reqs.values():
                if invalid.intersection(st.loaded_ids):
                    st.load_failed = True
        stats = getattr(connector_output, "kv_connector_stats", None)
        if self.tier_rule is None or stats is None or not isinstance(getattr(stats, "data", None), dict):
            return
        now = time.monotonic()
        for item in stats.data.get("tier_loads", ()):
            stat = TierLoadStat.of(item)
            self.tier_rule.observe(stat, now)
            self.history.write("tier_rule", wanted=stat.wanted, loaded=stat.loaded, seconds=stat.seconds,
                               cause=stat.cause, rate=self.tier_rule.rate,
                               held_s=round(max(0.0, self.tier_rule.held_until - now), 3))

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:  # noqa: ANN001
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        b0 = request.num_computed_tokens // self.block_size
        st.load = (b0, b0 + num_external_tokens // self.block_size)
        st.tier_from = max(b0, st.load[1] - st.tier_blocks) if st.tier_blocks else None
        if self.load_async:  # not scheduled before its load is done: its blocks are known only here
            st.block_ids = compat.allocated_block_ids(blocks)

    def build_connector_meta(self, scheduler_output) -> KVPoolMetadata:  # noqa: ANN001
        B = self.block_size
        meta = KVPoolMetadata()
        computed = compat.scheduled_requests(scheduler_output, self._reqs)
        if self.load_async:
            for rid, st in self._reqs.items():
                if st.load is not None and rid not in computed:  # held by vLLM until the load is reported
                    meta.async_loads.extend(self._take_load(rid, st))
                    st.loading_async = True
        for rid, ncomp in computed.items():
            st = self._reqs[rid]
            st.loading_async = False
            if st.load is not None:
                meta.loads.extend(self._take_load(rid, st))
            elif ncomp < st.published * B:  # rolled back (a failed load is being recomputed)
                st.published = ncomp // B
            if not self.settings.publish:
                continue
            done = min(ncomp + scheduler_output.num_scheduled_tokens.get(rid, 0), st.n_prompt) // B
            done = min(done, st.publish_blocks, len(st.block_ids))
            if done > st.published:
                p = st.published
                meta.stores.append(BlockRun(rid, st.tag, p, st.block_ids[p:done], st.hashes[p:done]))
                st.published = done
                st.stored = True
        meta.drain = sorted(r for r in (getattr(scheduler_output, "preempted_req_ids", None) or ())
                            if r in self._reqs and self._reqs[r].stored)
        return meta

    @staticmethod
    def _take_load(rid: str, st: _Request) -> list[BlockRun]:
        """Hand the request's load over: the pool's blocks, then the tier's (if its lookup
        found any). Its blocks count as published from here: they came from the pool or the tier
        and are not published again."""
        b0, b1 = st.load
        split = b1 if st.tier_from is None else st.tier_from
        runs = [BlockRun(rid, st.tag, b0, st.block_ids[b0:split], st.hashes[b0:split])] if split > b0 else []
        if split < b1:
            runs.append(BlockRun(rid, st.tag, split, st.block_ids[split:b1], st.hashes[split:b1], source="tier"))
        st.published = max(st.published, b1)
        st.load = st.tier_from = None
        st.loaded_ids.update(st.block_ids[b0:b1])
        return runs

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:  # noqa: ANN001
        """A request whose blocks were handed to the copier keeps them until the worker
        reports its stores done (get_finished -> finished_sending)."""
        st = self._reqs.pop(request.request_id, None)
        pending = self._lookups.pop(request.request_id, None)
        if pending is not None:  # finished (aborted) while its lookup ran: nobody needs the answer
            pending.future.cancel()
        if st is None or st.attribution is None:
            return (st is not None and st.stored), None
        attribution = dict(st.attribution)
        if st.load_failed:
            attribution.update(hit_kind="fallback", loaded_blocks=0)
        attribution["published_blocks"] = st.published
        return st.stored, {"kvpool": attribution}


# -- worker side ----------------------------------------------------------------------------


class KVPoolWorker:
    """The worker half. Copies run on the copier's thread (kvpool.copier), overlapped
    with the engine; the ordering the engine relies on is enforced here:

      loads   submitted in start_load_kv; wait_for_layer_load (before the first
              attention reads a block) and wait_for_save wait for them.
      stores  submitted in wait_for_save, after the step's forward wrote the KV. A
              finished request's blocks stay allocated (request_finished said so) until
              a get_finished sees its stores done and reports it in finished_sending
              (get_finished never waits: a request whose stores still run is reported
              at a later call); a preempted request's stores are drained in
              start_load_kv, before the next forward can write into its freed blocks.
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

    @property
    def _wait_s(self) -> float:  # a copy is bounded by the client's own timeouts; this is the backstop
        return self.settings.load_deadline_s + 4 * self.settings.timeout_s

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Verify every layer's KV tensor against the namespace's layout and hand them to
        the copier: on CPU as byte arrays (each block contiguous), on CUDA the tensors
        themselves with the layout's block dimension (kvpool.gpu_copier.CudaCopier)."""
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

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        for rid in meta.drain:
            self._drain(rid)
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
        sending = self._sending.get(rid, [])
        drop = getattr(self.copier, "drop_unstarted", None)  # the host copier's; the CUDA copier's are ordered
        dropped = drop(sending) if drop is not None and sending else []
        if dropped:
            sending = self._sending[rid] = [f for f in sending if not f.cancelled()]
            self.history.write("publish_dropped", req=rid, stores=len(dropped),
                               reason="preempted before its store started: its blocks are free")
        self.copier.wait(sending, self._wait_s)

    def _load(self, run: BlockRun) -> Future:
        if run.source == "tier":
            if self.tier is None:
                raise ValueError(f"a load from the tier for {run.req_id}, and no tier is configured on the worker")
            future = self.copier.tier_load(self.tier, self.ns, run, self.settings.tier_deadline_s)
        else:
            future = self.copier.load(self.ns, run, self.settings.load_deadline_s)
        future.add_done_callback(lambda f, n=len(run.block_ids), src=run.source: self._note_load(f, n, src))
        return future

    def _note_load(self, future: Future, wanted: int, source: str) -> None:
        """A finished load's measurement, for vLLM's connector stats (kvpool.stats): the
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
                store = self.copier.store(self.ns, run, keep)
                store.add_done_callback(self._note_store)
                sending.append(store)
                if self.tier is not None and self.settings.tier_publish:
                    sending.append(self.copier.tier_store(self.tier, self.ns, run, keep))

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


def default_copier(settings: ConnectorSettings, backend: PoolBackend, history: HistoryWriter,
                   metrics: ClientMetrics, device: str = "cpu") -> Copier:
    """The default CopierFactory, by device: HostCopier on CPU, CudaCopier on CUDA."""
    if device == "cuda":
        from kvpool.gpu_copier import CudaCopier

        return CudaCopier(backend, history, metrics)
    return HostCopier(backend, history, metrics)


# -- the facade -----------------------------------------------------------------------------


class KVPoolConnector(compat.KVConnectorBase_V1):
    """vLLM builds it as KVPoolConnector(vllm_config, role, kv_cache_config). A wrapping
    connector (kvpool.wrap.WrappingConnector) may also pass `extra` (its own settings
    removed from kv_connector_extra_config) and the two factories."""

    takes_extra_config = True  # capability flags a wrapper reads (kvpool.wrap)
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

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        return self._scheduler.request_finished(request, block_ids)

    # worker side
    def register_kv_caches(self, kv_caches):  # noqa: ANN001, ANN201
        self._worker.register_kv_caches(kv_caches)

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

    def get_kv_connector_stats(self):  # noqa: ANN201
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.take_stats() if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):  # noqa: ANN001, ANN206
        return KVPoolStats(data=dict(data) if data else None)

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # noqa: ANN001, ANN206
        """kvpool's counters on the replica's own /metrics (kvpool.stats.KVPoolPromMetrics)."""
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
