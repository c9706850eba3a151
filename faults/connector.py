"""The fault-injecting V1 connector: wraps any V1 connector from outside, as
kvpool.connector.audit.AuditConnector does, and injects faults through the connector API.

    kv_connector="FaultConnector", kv_connector_module_path="kvgate.faults.connector",
    kv_connector_extra_config={"fault_inner": "module:Class" (default kvpool's connector),
                               "faults_file": PATH, <the inner connector's settings>}
Put the audit outside it (audit_inner="kvgate.faults.connector:FaultConnector") so the audit
records what the engine was told, after the faults.

The fault-control file (kvgate.faults.control) is re-read when it changes. At the connector API,
for any inner connector, section "connector":

    {"connector": {"control": "hide_failures"}}
        a negative control: get_block_ids_with_load_errors reports nothing, so the engine
        computes on whatever the failed blocks hold instead of recomputing them.
    {"connector": {"control": "claim_past_loaded"}}
        a negative control: where the inner connector finds a hit, the engine is told that
        every prompt token but the last is external (as a connector that serves a fully
        cached prompt would say), while the inner connector loads only the blocks it found.
        The tokens between are never loaded nor computed: the engine attends to whatever
        their block holds. The pages it loaded are exact; only the output shows it.
    {"connector": {"control": "claim_one_more"}}
        a negative control: at a prompt whose length is an exact multiple of the block,
        where the inner connector claims a hit that leaves more than one token to compute,
        the engine is told one token more is external (an off-by-one at the boundary:
        the token at the claim's end is neither loaded nor computed, its KV slot holds
        whatever the block held). The inner connector loads only its own claim. Where it
        claims the whole prompt (an asynchronous loader: the engine computes the last
        token again itself) the claim stands and the inner connector is told one block
        less: the last block at the boundary is claimed and never loaded.
    {"connector": {"control": "double_count_stats"}}
        a negative control: the connector's own stats count every load twice (what it
        hands vLLM from get_kv_connector_stats is aggregated with a copy of itself), so
        its load counters on /metrics say twice what was installed.
    {"connector": {"control": "late_store"}}
        a negative control: the stores land after the engine reused the blocks. On the
        scheduler side every request that finishes while it holds is freed at once
        (request_finished asks no delay, whatever the inner connector asked; its later
        completion report is taken out of the output before the engine's scheduler reads
        it); on the worker side the inner connector's save calls
        (save_kv_layer, wait_for_save, with the step's metadata) are held, and replayed
        in order at the first step after the section says `"release": true` or is
        disarmed: the inner connector then reads the blocks as they are by then. A connector
        whose worker takes its stores as jobs in the step's metadata (OffloadingConnector:
        `store_jobs`, prepared at get_finished and submitted at the next step's start; its
        scheduler fences the reuse of a block by naming the jobs to flush, `jobs_to_flush`)
        has its store jobs kept back the same way, and the flush of a held job dropped: the
        blocks are reused unfenced, the job is reported done to the scheduler at once (as the
        inner worker reports a job it copied: vLLM resumes a preempted request only once its
        store jobs complete, and its tier then serves the job's keys), and the held jobs reach
        the inner connector with the release step's own (the own completion of one reported
        early is taken out of the worker's report). A held job never flushed is not reported:
        a request whose prefix it stores waits (vLLM's lookup answers "not yet") until the
        release, so a scenario releases before it waits on such a request; a held job copied
        after a reset_cache writes into tier blocks the reset gave back.
    {"connector": {"control": "deaf_tier_rule"}}
        a negative control: kvpool's tier rule never holds a failing tier off. The scheduler
        never hears of the worker's tier loads (the connector stats are dropped on their way
        to update_connector_output), and a hold its own failed lookups set is lifted before
        each request's lookup (the wrapped kvpool scheduler's rule, reached from outside),
        so every request is sent to a dead, cut off or too slow tier again.
    {"connector": {"control": "deaf_reset"}}
        a negative control: reset_cache answers None and leaves the inner connector's store
        as it is, as vLLM's base connector does (the scheduler counts only False as a
        failure): `POST /reset_prefix_cache?reset_external=true` reports success and the
        connector keeps serving what it stored before.
    {"connector": {"control": "load_despite_skip"}}
        a negative control: a request that reads no prefix cache (vLLM's
        skip_reading_prefix_cache, which prompt_logprobs sets) is shown to the inner connector
        and to the engine as one that does: its flag is cleared before the inner connector
        is asked and before the scheduler reads it, as on a vLLM without that check (before
        vllm#57269) with a connector that does not honour the flag itself. The engine then
        takes the connector's hit, and computes the prompt log-probabilities of the tail only.
    {"connector": {"control": "adapter_by_name"}}
        a negative control: the inner connector sees each request's LoRA adapter by its name
        alone (a LoRARequest of that name whose path is a directory this control derives from
        the name: the same on every replica), so two adapters loaded in turn under one name
        are one adapter to it, however it keys them (by name, id, path or the content at the
        path). Armed on every replica of the scenario.
    {"connector": {"control": "stale_completion"}}
        a negative control: every request the engine reports finished to the worker while the
        control is armed (get_finished's finished_req_ids: an aborted one too) is reported back
        once as a finished store (finished_sending) in the same call, whatever the inner
        connector did: a completion for a request the scheduler has already freed, or will free
        on the load's own completion in the same report (as LMCache's kv_both worker does
        after an aborted load, LMCache#4939). vLLM's scheduler asserts on it (vllm#43226).
    {"connector": {"finished_delay_ms": 500, "times": 1}}
        a delayed completion: get_finished holds the finished requests' ids back (they
        are reported at a later call, after the delay), `times` requests' worth.

Section "schedule" is not a fault: it takes a race out of a scenario's hands.

    {"schedule": {"hold_recv": true}}
        the worker holds each completed load it reports (finished_recving) until the engine has
        finished the request (its id among get_finished's finished_req_ids: the abort of a
        request whose client went away lands there), or until the section is lifted. A load
        then stays in flight, as a slow one would, for as long as the scenario needs to abort
        its request during it. Each hold and release is written to the history
        ("schedule", kind "hold_recv", job "hold" / "release" with why: "finished" or "lifted"), and
        so is each request the engine finished while the section is armed (job "finished").

    {"schedule": {"gather": "TAG-PREFIX", "count": 3}}
        the scheduler keeps the requests whose tag starts with the prefix waiting (asked
        for their external tokens, the connector answers None, "ask again", before the
        inner connector is asked) until `count` of them have arrived; then it admits them
        in their order of arrival, one per scheduler step. Requests sent together then run
        together however the client's sends and the engine's steps interleave; a request
        once admitted (a preempted one, resumed) is never held again.

For kvpool's own connector (capability flag `takes_factories`), the pool backend and the
copy engine are wrapped through kvpool's factories: kvgate.faults.backend.FaultyBackend (sections
"load", "publish", "client", "namespace"), kvgate.faults.copier.FaultyCopier around the host
copier (section "copier"), and on CUDA kvgate.faults.gpu_live.ControlledCudaCopier (section
"gpu": the unordered-transfer control) plus the stream delay before a step that publishes
blocks (section "gpu", `stream_delay_ms`). Every firing is written to the history
(`fault` events) with what it did; disarming a section heals it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from kvgate.faults.backend import FaultyBackend
from kvgate.faults.connector_controls import CONTROLS
from kvgate.faults.control import ControlFile, ControlFileError
from kvgate.faults.copier import FaultyCopier
from kvpool.connector.settings import ConnectorSettings, connect_backend
from kvpool.connector.worker import transfer_config
from kvpool.connector.params import request_tag
from kvpool.connector.copier import HostCopier
from kvpool.connector.history import HistoryWriter
from kvpool.connector.wrap import WrappingConnector


class FaultConnector(WrappingConnector):
    INNER_KEY = "fault_inner"
    OWN_KEYS = ("faults_file",)

    def __init__(self, vllm_config, role, kv_cache_config=None, *, extra: dict[str, Any] | None = None):  # noqa: ANN001
        # Read before the inner connector is built: its factories use the control file.
        own = (dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {}) if extra is None else extra)
        path = own.get("faults_file")
        self.control = ControlFile(path) if path else None
        self._lock = threading.Lock()
        self._generation = -1
        self._finished_fired = 0
        self._held: list[tuple[float, set[str]]] = []  # (release time, request ids) of delayed completions
        self._stream_delay = None  # set by the copier factory on CUDA
        self._claimed: dict[str, int] = {}  # claim_past_loaded: request id -> the inner connector's own count
        # late_store: this step's held save_kv_layer calls; the held steps (inner metadata,
        # their calls); requests freed at once whose completion reports are dropped
        self._saves: list[tuple[Any, ...]] = []
        self._late: list[tuple[Any, list[tuple[Any, ...]]]] = []
        self._freed_early: set[str] = set()  # (scheduler side) requests freed at once, their reports still to come
        # late_store on store jobs carried by the metadata: those held back; this step's metadata
        # with the inner connector's view of it
        self._held_jobs: dict[Any, Any] = {}
        # held jobs whose flush was dropped: reported done at once (those not yet reported in
        # _report_early), their own completion still to come at the release
        self._done_early: set[Any] = set()
        self._report_early: list[Any] = []
        self._bound: tuple[Any, Any] | None = None
        # schedule "gather": the spec it counts for, the arrivals in order, those admitted,
        # and whether this step has admitted one
        self._gather: tuple[str, int] | None = None
        self._arrived: list[str] = []
        self._admitted: set[str] = set()
        self._admitted_this_step = False
        self._recv_held: set[str] = set()  # schedule "hold_recv": completed loads not yet reported
        self._recv_finished: set[str] = set()  # and the requests the engine finished while it is armed
        self._stale_next: set[str] = set()  # stale_completion: ids the inner reported itself in that call
        super().__init__(vllm_config, role, kv_cache_config, extra=extra)
        self.history = HistoryWriter(self.history_dir, self.replica, f"faults-{self.role_name}")

    # -- kvpool's parts, through its factories -----------------------------------------------
    def inner_kwargs(self, inner_class: type) -> dict[str, Any]:
        if self.control is None or not getattr(inner_class, "takes_factories", False):
            return {}
        return {"backend_factory": self._backend, "copier_factory": self._copier}

    def _backend(self, settings: ConnectorSettings, role: str, history: HistoryWriter, metrics):  # noqa: ANN001, ANN202
        return FaultyBackend(connect_backend(settings, role, history, metrics), self.control, history,
                             load_deadline_s=settings.load_deadline_s)

    def _copier(self, settings: ConnectorSettings, backend, history: HistoryWriter, metrics, device: str):  # noqa: ANN001, ANN202
        if device == "cuda":
            from kvgate.faults.gpu_live import ControlledCudaCopier, StreamDelay

            self._stream_delay = StreamDelay(self.control, history)
            return ControlledCudaCopier(backend, history, metrics, control=self.control,
                                        config=transfer_config(settings))
        return FaultyCopier(HostCopier(backend, history, metrics), self.control, history)

    # -- the connector API ---------------------------------------------------------------------
    def _section(self) -> dict | None:
        if self.control is None:
            return None
        spec, generation = self.control.section("connector")
        with self._lock:
            if generation != self._generation:
                self._generation, self._finished_fired = generation, 0
                if spec and spec.get("control") not in (None, *CONTROLS):
                    raise ControlFileError(f"{self.control.path}: unknown connector control "
                                           f"{spec.get('control')!r}; known {CONTROLS}", generation)
        return spec

    def _hold(self, request) -> bool:  # noqa: ANN001
        """The schedule section's gather: True while the request must wait."""
        spec = self.control.section("schedule")[0] if self.control is not None else None
        if not spec or "gather" not in spec:
            return False
        key = (str(spec["gather"]), int(spec.get("count", 1)))
        if key != self._gather:
            self._gather, self._arrived, self._admitted = key, [], set()
        rid = request.request_id
        if rid in self._admitted or not request_tag(request).startswith(key[0]):
            return False
        if rid not in self._arrived:
            self._arrived.append(rid)
            self.history.write("schedule", site="connector", kind="gather", job="arrive", req=rid,
                               arrived=len(self._arrived), count=key[1])
        if len(self._arrived) < key[1] or self._admitted_this_step:
            return True
        if rid != next(r for r in self._arrived if r not in self._admitted):
            return True  # arrival order
        self._admitted.add(rid)
        self._admitted_this_step = True
        self.history.write("schedule", site="connector", kind="gather", job="admit", req=rid,
                           admitted=len(self._admitted), count=key[1])
        return False

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        self._admitted_this_step = False
        return super().build_connector_meta(scheduler_output)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        if self._hold(request):
            return None, False
        spec = self._section()
        if spec and spec.get("control") == "deaf_tier_rule":
            self._lift_tier_hold(request)
        if spec and spec.get("control") == "load_despite_skip" and getattr(request, "skip_reading_prefix_cache", False):
            request.skip_reading_prefix_cache = False
            self.history.write("fault", site="connector", kind="copier_control", job="unskip",
                               control="load_despite_skip", req=request.request_id)
        request = self._by_name(request, spec)
        ext, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        n = len(request.prompt_token_ids or [])
        if ext and spec and spec.get("control") == "claim_past_loaded" and num_computed_tokens + ext < n - 1:
            self._claimed[request.request_id] = ext
            claim = n - 1 - num_computed_tokens
            self.history.write("fault", site="connector", kind="copier_control", job="claim",
                               control="claim_past_loaded", req=request.request_id, loaded_tokens=ext,
                               claimed_tokens=claim)
            return claim, load_async
        if ext and spec and spec.get("control") == "claim_one_more":
            return self._claim_one_more(request, num_computed_tokens, ext, load_async, n)
        return ext, load_async

    def _claim_one_more(self, request, num_computed_tokens: int, ext: int, load_async: bool, n: int):  # noqa: ANN001, ANN202
        block = int(self._vllm_config.cache_config.block_size)
        if n % block == 0 and num_computed_tokens + ext + 1 <= n - 1:  # one token more than it loads
            loads, claim = ext, ext + 1
        elif n % block == 0 and load_async and num_computed_tokens + ext == n and ext >= block:
            # the whole prompt claimed (an asynchronous loader): no token is left to add, so the
            # claim stays and the load stops a block short, at the same boundary
            loads, claim = ext - block, ext
        else:
            self.history.write("fault_skipped", site="connector", kind="copier_control", control="claim_one_more",
                               req=request.request_id, prompt_tokens=n, claimed_tokens=num_computed_tokens + ext,
                               reason="not an exact block multiple" if n % block else "no token left to claim")
            return ext, load_async
        self._claimed[request.request_id] = loads
        self.history.write("fault", site="connector", kind="copier_control", job="claim", control="claim_one_more",
                           req=request.request_id, loaded_tokens=loads, claimed_tokens=claim, prompt_tokens=n)
        return claim, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        inner = self._claimed.pop(request.request_id, None)
        if inner is not None and num_external_tokens > 0:
            num_external_tokens = inner
        return super().update_state_after_alloc(self._by_name(request, self._section()), blocks, num_external_tokens)

    def _by_name(self, request, spec):  # noqa: ANN001, ANN202
        """adapter_by_name: the request as the inner connector is to see it (the adapter by
        its name alone); the request itself where the control is not armed or it has no adapter."""
        lora = getattr(request, "lora_request", None)
        if lora is None or not spec or spec.get("control") != "adapter_by_name":
            return request
        from kvgate.faults.adapter_control import by_name

        seen, shown = by_name(lora, self.control.path.parent)
        if not seen:
            self.history.write("fault", site="connector", kind="copier_control", job="adapter_by_name",
                               control="adapter_by_name", req=request.request_id, lora_name=lora.lora_name,
                               lora_path=str(getattr(lora, "lora_path", "")), shown_path=shown.lora_path)
        return _Shown(request, shown)

    def reset_cache(self):  # noqa: ANN201
        spec = self._section()
        if spec and spec.get("control") == "deaf_reset":
            self.history.write("fault", site="connector", kind="copier_control", job="reset", control="deaf_reset")
            return None
        return super().reset_cache()

    def start_load_kv(self, forward_context, **kwargs):  # noqa: ANN001, ANN201
        if self._stream_delay is not None and self.has_connector_metadata():
            stores = getattr(self._get_connector_metadata(), "stores", None)
            if stores:
                self._stream_delay.maybe_fire(stores)
        return super().start_load_kv(forward_context, **kwargs)

    def inner_metadata(self, connector_metadata):  # noqa: ANN001, ANN201
        """The step's metadata as the inner connector is given it, made once per step at its
        first sight (vLLM 0.24 hands it to handle_preemptions before it binds it)."""
        if self._bound is None or connector_metadata is not self._bound[0]:
            self._bound = (connector_metadata, self._job_fence(super().inner_metadata(connector_metadata)))
        return self._bound[1]

    def _job_fence(self, meta):  # noqa: ANN001, ANN202
        """late_store for store jobs carried by the step's metadata (the module's docstring):
        the metadata the inner connector is given for this step."""
        jobs = getattr(meta, "store_jobs", None)
        if not isinstance(jobs, dict) or not dataclasses.is_dataclass(meta):
            return meta
        flush = set(getattr(meta, "jobs_to_flush", None) or ())
        mode = self._late_store()
        if mode == "hold":
            if jobs:
                self._held_jobs.update(jobs)
                self.history.write("fault", site="connector", kind="copier_control", job="hold_jobs",
                                   control="late_store", jobs=len(jobs))
            unfenced = flush & set(self._held_jobs)
            if unfenced:
                # reported done now (build_connector_worker_meta), copied at the release: vLLM
                # resumes a preempted request only once its store jobs complete
                fresh = sorted(unfenced - self._done_early)
                self._done_early.update(fresh)
                self._report_early.extend(fresh)
                self.history.write("fault", site="connector", kind="copier_control", job="unfence",
                                   control="late_store", jobs=len(unfenced), early=len(fresh))
            return dataclasses.replace(meta, store_jobs={}, jobs_to_flush=(flush - unfenced) or None)
        if self._held_jobs:  # released, or disarmed with jobs held: handed over with this step's own
            held, self._held_jobs = self._held_jobs, {}
            self.history.write("fault", site="connector", kind="copier_control", job="replay_jobs",
                               control="late_store", jobs=len(held))
            # submitted at the next step's start: not yet in flight for this step's flush
            return dataclasses.replace(meta, store_jobs={**held, **jobs}, jobs_to_flush=(flush - set(held)) or None)
        return meta

    def build_connector_worker_meta(self):  # noqa: ANN201
        """late_store on store jobs: the completion of each held job whose flush was dropped
        goes to the scheduler in the next report, as the inner worker reports a job it copied
        (`completed_jobs`, one per worker); its own completion, when it copies at the release,
        is taken out of the report it comes in."""
        meta = self._inner.build_connector_worker_meta()
        done = getattr(meta, "completed_jobs", None)
        if done and self._done_early:
            late = sorted(set(done) & self._done_early)
            for job in late:
                del done[job]
            self._done_early.difference_update(late)
            if late:
                self.history.write("fault", site="connector", kind="copier_control", job="drop_completion",
                                   control="late_store", jobs=len(late))
        if self._report_early:
            if meta is None:  # the class of the store-job metadata _job_fence took the jobs from
                meta = _worker_meta_class(self._bound[1] if self._bound else None)()
            early, self._report_early = self._report_early, []
            for job in early:
                meta.completed_jobs[job] = meta.completed_jobs.get(job, 0) + 1
            self.history.write("fault", site="connector", kind="copier_control", job="complete_early",
                               control="late_store", jobs=len(early))
        return meta

    def _late_store(self) -> str | None:
        """"hold" while late_store is armed, "release" when it says so (or is disarmed
        with steps still held), else None."""
        spec = self._section()
        if spec and spec.get("control") == "late_store":
            return "release" if spec.get("release") else "hold"
        return "release" if self._late or self._held_jobs else None

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        delay, params = super().request_finished(self._by_name(request, self._section()), block_ids)
        if delay and self._late_store() == "hold":
            self.history.write("fault", site="connector", kind="copier_control", job="free",
                               control="late_store", req=request.request_id, blocks=len(block_ids))
            self._freed_early.add(request.request_id)
            return False, params
        return delay, params

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):  # noqa: ANN001, ANN201
        if self._late_store() == "hold":
            self._saves.append((layer_name, kv_layer, attn_metadata, kwargs))
            return None
        return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):  # noqa: ANN201
        mode = self._late_store()
        if mode == "hold":
            meta = self.inner_metadata(self._get_connector_metadata()) if self.has_connector_metadata() else None
            self._late.append((meta, self._saves))
            self._saves = []
            return None
        if mode == "release" and self._late:
            held, self._late = self._late, []
            current = self._get_connector_metadata() if self.has_connector_metadata() else None
            for meta, calls in held:  # each held step, as the inner connector would have run it
                if meta is None:
                    continue
                self._inner.bind_connector_metadata(meta)
                for layer_name, kv_layer, attn_metadata, kwargs in calls:
                    self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
                self._inner.wait_for_save()
            if current is not None:
                self._inner.bind_connector_metadata(self.inner_metadata(current))
            self.history.write("fault", site="connector", kind="copier_control", job="replay", control="late_store",
                               steps=len(held), saves=sum(len(c) for _, c in held))
        return super().wait_for_save()

    def _lift_tier_hold(self, request) -> None:  # noqa: ANN001
        rule = getattr(getattr(self._inner, "_scheduler", None), "tier_rule", None)
        why = rule.forget() if rule is not None else None
        if why is not None:
            self.history.write("fault", site="connector", kind="copier_control", job="lift_hold",
                               control="deaf_tier_rule", req=request.request_id, held_why=why)

    def update_connector_output(self, connector_output):  # noqa: ANN001, ANN201
        engines = connector_output  # the engine's own object: what its scheduler reads after this call
        spec = self._section()
        stats = getattr(connector_output, "kv_connector_stats", None)
        if stats is not None and spec and spec.get("control") == "deaf_tier_rule":
            self.history.write("fault", site="connector", kind="copier_control", job="stats",
                               control="deaf_tier_rule", dropped=stats.reduce() if hasattr(stats, "reduce") else None)
            connector_output = dataclasses.replace(connector_output, kv_connector_stats=None)
        out = super().update_connector_output(connector_output)  # the inner connector sees its own reports
        self._drop_freed_early(engines)
        return out

    def _drop_freed_early(self, connector_output) -> None:  # noqa: ANN001
        """late_store: the completion reports of the requests freed at once never reach the
        engine's scheduler (it asserts on a report for a request it no longer has). vLLM's
        scheduler hands the output to the connector before it reads the reports, so they are
        taken out of it here, in place, only those: a request that finished after the release
        keeps its delayed free and its report."""
        sending = getattr(connector_output, "finished_sending", None)
        if not self._freed_early or not sending:
            return
        dropped = set(sending) & self._freed_early
        if dropped:
            self._freed_early -= dropped
            for rid in dropped:
                sending.discard(rid)
            self.history.write("fault", site="connector", kind="copier_control", job="drop_report",
                               control="late_store", reqs=sorted(dropped))

    def get_kv_connector_stats(self):  # noqa: ANN201
        stats = super().get_kv_connector_stats()
        spec = self._section()
        if stats is not None and spec and spec.get("control") == "double_count_stats" and not stats.is_empty():
            import copy

            self.history.write("fault", site="connector", kind="copier_control", job="stats",
                               control="double_count_stats")
            stats = stats.aggregate(copy.deepcopy(stats))
        return stats

    def get_block_ids_with_load_errors(self):  # noqa: ANN201
        failed = super().get_block_ids_with_load_errors()
        spec = self._section()
        if failed and spec and spec.get("control") == "hide_failures":
            self.history.write("fault", site="connector", kind="copier_control", job="report",
                               control="hide_failures", hidden_block_ids=sorted(failed))
            return set()
        return failed

    def _hold_recv(self, receiving, finished_req_ids):  # noqa: ANN001, ANN202
        """The schedule section's hold_recv: the completed loads reported now (the rest held)."""
        spec = self.control.section("schedule")[0] if self.control is not None else None
        holding = bool(spec and spec.get("hold_recv"))
        if not holding:
            self._recv_finished = set()
            if not self._recv_held:
                return receiving
        finished = set(finished_req_ids or ())
        now = set(receiving or ())
        if holding:
            for rid in sorted(finished):
                self.history.write("schedule", site="connector", kind="hold_recv", job="finished", req=rid)
            self._recv_finished |= finished  # a finish that comes before its load's completion counts too
            for rid in sorted(now - self._recv_held - self._recv_finished):
                self.history.write("schedule", site="connector", kind="hold_recv", job="hold", req=rid)
            self._recv_held |= now
            now = set()
        out = {rid for rid in self._recv_held if rid in self._recv_finished or not holding}
        for rid in sorted(out):
            self.history.write("schedule", site="connector", kind="hold_recv", job="release", req=rid,
                               why="finished" if rid in self._recv_finished else "lifted")
        self._recv_held -= out
        return (now | out) or None

    def finished_filter(self, sending, receiving, finished_req_ids):  # noqa: ANN001, ANN201
        spec = self._section()  # read first: a scenario may disarm as soon as it reads the hold's records
        receiving = self._hold_recv(receiving, finished_req_ids)
        if spec and spec.get("control") == "stale_completion" and (finished_req_ids or self._stale_next):
            # each finished request reported once more as a finished store; one the inner connector
            # reports itself in this call comes again in the next (a second completion all the same)
            finished = set(finished_req_ids or ())
            stale = (finished | self._stale_next) - set(sending or ())
            self._stale_next = finished & set(sending or ())
            if stale:
                self.history.write("fault", site="connector", kind="copier_control", job="stale_completion",
                                   control="stale_completion", reqs=sorted(stale))
                sending = set(sending or ()) | stale
        elif self._stale_next:
            self._stale_next = set()
        now = time.monotonic()
        ms = float(spec.get("finished_delay_ms", 0)) if spec else 0.0
        with self._lock:
            if sending and ms > 0 and self._finished_fired < int(spec.get("times", 1)):
                self._finished_fired += 1
                self._held.append((now + ms / 1000, set(sending)))
                self.history.write("fault", site="connector", kind="finished_delay", job="report",
                                   delay_ms=ms, reqs=sorted(sending))
                sending = set()
            due = [ids for t, ids in self._held if t <= now]
            self._held = [(t, ids) for t, ids in self._held if t > now]
        for ids in due:
            sending = set(sending or ()) | ids
        return (sending or None), receiving


class _Shown:
    """A request as the inner connector sees it under adapter_by_name: every attribute the
    engine's, but its LoRA adapter; what the inner connector sets is set on the engine's."""

    def __init__(self, request, lora):  # noqa: ANN001
        object.__setattr__(self, "_request", request)
        object.__setattr__(self, "lora_request", lora)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._request, name)

    def __setattr__(self, name: str, value) -> None:  # noqa: ANN001
        setattr(self._request, name, value)


class JobFenceError(TypeError):
    """late_store on store jobs cannot report a job done the way the inner connector does."""


def _worker_meta_class(step_meta) -> type:  # noqa: ANN001
    """The class of the report a store-job worker sends its scheduler (vLLM's
    OffloadingWorkerMetadata, `completed_jobs`), found beside the class of the step's
    metadata it came with (the two are defined together)."""
    import sys

    module = sys.modules.get(type(step_meta).__module__) if step_meta is not None else None
    cls = getattr(module, "OffloadingWorkerMetadata", None)
    if cls is None:
        raise JobFenceError(f"late_store: no OffloadingWorkerMetadata beside {type(step_meta).__qualname__} "
                            "to report a held store job done")
    return cls
