"""The scheduler side of the connector: the lookup beyond the local prefix-cache hit (on a
thread of its own, bounded), and what the worker is told to load and publish.

Reset (KVPoolScheduler.reset: vLLM's connector reset_cache, which
`POST /reset_prefix_cache?reset_external=true` and the cache clear of a weight update call):
everything published under this engine's namespace (every tensor-parallel rank's) leaves the
pool, at once for every replica of the tenant that shares it (the pool's reset_namespace:
committed blocks out of its index, open publishes cancelled), so no request anywhere hits KV
published before it. The reset is a cut at the pool: what a replica publishes after it is a
new block, whatever weights computed it, so a fleet resets after every replica of the
namespace stopped serving the old weights (the weight-update flow pauses generation first).
It answers False (vLLM then reports the reset failed; the caller retries) where it cannot
promise the cut: the pool did not answer, a network tier is configured (its blocks are not
reset), or this replica still has stores in flight (blocks computed before the reset whose
publish could land after it).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from kvpool.connector import vllm_compat as compat
from kvpool.errors import MissCause, PoolError, PoolTimeout
from kvpool.connector.history import HistoryWriter
from kvpool.pool.records import LookupResult
from kvpool.pool.keys import NAMESPACE_RESET
from kvpool.tier.record import TierError
from kvpool.tier.registry import open_tier
from kvpool.connector.stats import KVPoolStats, StatsCollector
from kvpool.tier.rule import TierLoadStat, TierRule
from kvpool.connector.params import BlockRun, KVPoolMetadata, RequestParams, salt_root, kv_groups_unsupported, request_inputs
from kvpool.connector.settings import BackendFactory, ConnectorSettings, connect_backend, namespace_for


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
        self._sending: set[str] = set()  # finished requests whose stores the worker has not reported done
        self.stats = StatsCollector()  # this interval's lookups (vLLM's connector stats, kvpool.connector.stats)
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
            hashes = inputs.hashes(tokens, B, salt_root(request))
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
        if compat.skips_external_kv(request):
            # vLLM's flag of a request that must compute its whole prompt (prompt_logprobs sets
            # it: a log-probability exists only for a token the engine computes). vLLM 0.32's
            # and 0.34's schedulers drop a connector's hit of such a request themselves; before
            # vllm#57269 they did not. No lookup, no claim: its attribution and counters say
            # so. It publishes.
            self._note_lookup(st, **record, external_tokens=0, hit_blocks=0, outcome="skipped",
                               reason="the request reads no external KV (vLLM's skip_reading_prefix_cache, 0.34's skip_reading_external_kv: prompt logprobs, a bounded hit)")
            return 0, False
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
        stats, kvpool.connector.stats) and the request's attribution (returned in its response's
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
        holds, as far as the tier rule allows (kvpool.tier.rule). A tier that fails or is
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

    def reset(self) -> bool:
        """Take everything published under this engine's namespaces out of the pool (the
        module's docstring: the semantics). True: nothing published before this call is
        served after it, here or on any replica of the tenant; False: retry."""
        for pending in self._lookups.values():  # answers from before the reset are not used
            pending.future.cancel()
        self._lookups.clear()
        namespaces = [self.ns.replace(tp_rank=r) for r in range(self.ns.tp_world_size)]
        outcomes: list[str] = []
        try:
            for ns in namespaces:
                outcomes += [str(o) for o in self.backend.evict(ns, [NAMESPACE_RESET])]
        except PoolError as exc:
            self.history.write("reset", ok=False, error=f"{type(exc).__name__}: {exc}", namespaces=len(namespaces))
            return False
        in_flight = sorted(self._sending | {rid for rid, st in self._reqs.items() if st.stored})
        why = ("a network tier is configured: its blocks are not reset" if self.tier is not None else
               f"{len(in_flight)} requests have stores in flight" if in_flight else None)
        self.history.write("reset", ok=why is None, why=why, namespaces=len(namespaces),
                           pages={o: outcomes.count(o) for o in sorted(set(outcomes))}, in_flight=in_flight[:20])
        return why is None

    def update_connector_output(self, connector_output) -> None:  # noqa: ANN001
        """The worker's tier loads of the last step (vLLM's connector stats) teach the tier rule."""
        self._sending.difference_update(getattr(connector_output, "finished_sending", None) or ())
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

    def hit_sources(self, request, num_external_tokens: int) -> dict:  # noqa: ANN001
        """vLLM's split of a request's external hit by source (get_external_cache_hit_sources,
        asked after update_state_after_alloc): the tier's blocks of the load planned for it,
        the pool's the rest. Empty where this vLLM has no sources."""
        if num_external_tokens <= 0 or compat.HIT_SOURCE_POOL is None:
            return {}
        st = self._reqs.get(request.request_id)
        tier = 0
        if st is not None and st.load is not None and st.tier_from is not None:
            tier = min(num_external_tokens, (st.load[1] - st.tier_from) * self.block_size)
        split = {compat.HIT_SOURCE_POOL: num_external_tokens - tier, compat.HIT_SOURCE_TIER: tier}
        return {source: n for source, n in split.items() if n}

    def close(self) -> None:
        """vLLM's shutdown: the lookup thread (its lookups cancelled) and the pool connection."""
        self._lookup_thread.shutdown(wait=True, cancel_futures=True)
        self._lookups.clear()
        self.backend.close()
        if self.tier is not None:
            self.tier.close()
        self.history.close()

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
        if st is not None and st.stored:  # its blocks are held until the worker reports its stores done
            self._sending.add(request.request_id)
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
