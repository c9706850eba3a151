"""kvgate.faults.connector's `late_store` control on a connector whose worker takes its stores
as jobs in the step's metadata (OffloadingConnector's `store_jobs`, fenced by the scheduler's
`jobs_to_flush`): while held, each step's store jobs are kept back from the inner connector and
the flush of a held job is dropped (the blocks are reused unfenced) and the job reported done
at once; at the release (or the disarm) the held jobs reach it with that step's own, unflushed
in that step; metadata without
store jobs, and any metadata while the control is not armed, reach it unchanged."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from kvgate.faults.connector import FaultConnector, JobFenceError
from kvpool.connector import vllm_compat as compat
from kvpool.connector.history import read_history
from suites.connector.test_late_store import Recorder


@dataclasses.dataclass
class OffloadingWorkerMetadata:  # the shape of vLLM's worker report, beside the metadata as there
    completed_jobs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class JobsMeta:
    load_jobs: dict
    store_jobs: dict
    jobs_to_flush: set | None = None


class Jobs(Recorder):
    """Records the store jobs and the flush of each step it is given."""

    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.given: list[tuple[dict, set | None]] = []
        self.completed: dict = {}  # the jobs its next report says it copied

    def build_connector_worker_meta(self):  # noqa: ANN201
        done, self.completed = self.completed, {}
        return OffloadingWorkerMetadata(dict(done)) if done else None

    def bind_connector_metadata(self, connector_metadata):  # noqa: ANN001, ANN201
        super().bind_connector_metadata(connector_metadata)
        if hasattr(connector_metadata, "store_jobs"):
            self.given.append((dict(connector_metadata.store_jobs), connector_metadata.jobs_to_flush))

    def wait_for_save(self):  # noqa: ANN201
        return None  # its stores are jobs, prepared and submitted elsewhere


def _worker(tmp_path) -> FaultConnector:  # noqa: ANN001
    extra = {"fault_inner": f"{__name__}:Jobs", "faults_file": str(tmp_path / "faults.json"),
             "history_dir": str(tmp_path / "h"), "replica": "D"}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    return FaultConnector(config, compat.KVConnectorRole.WORKER)


def _arm(tmp_path, **section) -> None:  # noqa: ANN001
    (tmp_path / "faults.json").write_text(json.dumps({"connector": section} if section else {}))


def _step(w: FaultConnector, stores: dict, flush: set | None = None) -> tuple[dict, set | None]:
    w.bind_connector_metadata(JobsMeta({}, stores, flush))
    w.wait_for_save()
    w.clear_connector_metadata()
    return w.inner.given[-1]


def test_held_store_jobs_reach_the_inner_connector_at_the_release_unfenced(tmp_path):
    w = _worker(tmp_path)
    assert _step(w, {1: "a"}, {9}) == ({1: "a"}, {9})  # unarmed: as the scheduler built it
    _arm(tmp_path, control="late_store")
    assert _step(w, {2: "b"}) == ({}, None)
    assert _step(w, {3: "c"}, {2, 9}) == ({}, {9})  # the reuse of job 2's blocks is not fenced
    _arm(tmp_path, control="late_store", release=True)
    assert _step(w, {4: "d"}, {3}) == ({2: "b", 3: "c", 4: "d"}, None)  # submitted at the next step's start
    assert _step(w, {}, {3}) == ({}, {3})
    jobs = [(r["job"], r["jobs"]) for r in read_history(tmp_path / "h") if r["ev"] == "fault" and "jobs" in r]
    assert jobs == [("hold_jobs", 1), ("hold_jobs", 1), ("unfence", 1), ("replay_jobs", 2)]


def test_an_unfenced_job_is_reported_done_at_once_and_copied_at_the_release(tmp_path):
    """A preempted request's jobs are flushed at its preemption: the flush is dropped (the
    blocks are reused in that step) and the job is reported done in the next worker report,
    as the inner worker reports a job it copied (vLLM resumes a preempted request only once
    its store jobs complete); the copy itself waits for the release, and its own completion
    is taken out of the report it comes in."""
    w = _worker(tmp_path)
    _arm(tmp_path, control="late_store")
    _step(w, {2: "b", 3: "c"})
    assert w.build_connector_worker_meta() is None
    assert _step(w, {4: "d"}, {2, 9}) == ({}, {9})  # job 2's blocks reused unfenced
    assert w.build_connector_worker_meta().completed_jobs == {2: 1}
    assert _step(w, {}, {2, 8}) == ({}, {8})  # its flush dropped again, reported once
    assert w.build_connector_worker_meta() is None
    _arm(tmp_path, control="late_store", release=True)
    assert _step(w, {}) == ({2: "b", 3: "c", 4: "d"}, None)
    w.inner.completed = {2: 1, 3: 1, 4: 1}  # the inner worker copied them all
    assert w.build_connector_worker_meta().completed_jobs == {3: 1, 4: 1}
    w.inner.completed = {2: 1}  # dropped once only: a report of job 2 after that is the inner worker's own
    assert w.build_connector_worker_meta().completed_jobs == {2: 1}
    jobs = [(r["job"], r["jobs"]) for r in read_history(tmp_path / "h") if r["ev"] == "fault" and "jobs" in r]
    assert jobs == [("hold_jobs", 2), ("hold_jobs", 1), ("unfence", 1), ("complete_early", 1), ("unfence", 1),
                    ("replay_jobs", 3), ("drop_completion", 1)]


def test_an_early_report_joins_the_inner_workers_own_in_one_report(tmp_path):
    """The step that reports a job early may carry the inner worker's completions of other jobs
    (a load, a store copied before the control was armed): both reach the scheduler."""
    w = _worker(tmp_path)
    _step(w, {1: "a"})
    _arm(tmp_path, control="late_store")
    _step(w, {2: "b"})
    _step(w, {}, {2})
    w.inner.completed = {1: 1, 7: 1}
    assert w.build_connector_worker_meta().completed_jobs == {1: 1, 7: 1, 2: 1}


def test_disarming_after_an_early_report_copies_the_job_and_drops_its_own_completion(tmp_path):
    w = _worker(tmp_path)
    _arm(tmp_path, control="late_store")
    _step(w, {2: "b"})
    _step(w, {}, {2})
    assert w.build_connector_worker_meta().completed_jobs == {2: 1}
    _arm(tmp_path)
    assert _step(w, {3: "c"}) == ({2: "b", 3: "c"}, None)
    w.inner.completed = {2: 1, 3: 1}
    assert w.build_connector_worker_meta().completed_jobs == {3: 1}
    assert w.build_connector_worker_meta() is None


def test_two_workers_reports_aggregate_to_one_completion_per_job(tmp_path):
    """With two workers (tensor parallel) each reports a job early once, as each reports a job it
    copied: the scheduler counts the job done at two, once, and never hears of it again."""
    for rank in range(2):
        (tmp_path / str(rank)).mkdir()
        _arm(tmp_path / str(rank), control="late_store")
    workers = [_worker(tmp_path / str(rank)) for rank in range(2)]
    for w in workers:
        _step(w, {2: "b"})
        _step(w, {}, {2})
    counts: dict = {}
    for w in workers:
        for job, n in w.build_connector_worker_meta().completed_jobs.items():
            counts[job] = counts.get(job, 0) + n
    assert counts == {2: 2}
    for rank, w in enumerate(workers):
        _arm(tmp_path / str(rank), control="late_store", release=True)
        _step(w, {})
        w.inner.completed = {2: 1}
        assert w.build_connector_worker_meta().completed_jobs == {}  # its own copy's report, dropped


def test_a_job_reported_done_early_needs_the_report_class_beside_the_metadata(tmp_path):
    w = _worker(tmp_path)
    _arm(tmp_path, control="late_store")
    w.bind_connector_metadata(SimpleNamespace(store_jobs={2: "b"}, jobs_to_flush=None))
    with pytest.raises(JobFenceError, match="OffloadingWorkerMetadata"):
        w._report_early.append(2)
        w.build_connector_worker_meta()


def test_disarming_hands_over_the_held_jobs(tmp_path):
    w = _worker(tmp_path)
    _arm(tmp_path, control="late_store")
    _step(w, {2: "b"})
    _arm(tmp_path)
    assert _step(w, {}) == ({2: "b"}, None)
    assert _step(w, {5: "e"}) == ({5: "e"}, None)


def test_metadata_without_store_jobs_is_passed_as_it_is(tmp_path):
    w = _worker(tmp_path)
    _arm(tmp_path, control="late_store")
    meta = SimpleNamespace(step=1)
    w.bind_connector_metadata(meta)
    assert w.inner._get_connector_metadata() is meta


def test_the_step_is_seen_once_whichever_hook_sees_it_first(tmp_path):
    """vLLM 0.24 hands the step's metadata to handle_preemptions before it binds it: both get
    the same view, and the jobs are held once."""
    w = _worker(tmp_path)
    seen = []
    w.inner.handle_preemptions = lambda meta: seen.append((dict(meta.store_jobs), meta.jobs_to_flush))
    _arm(tmp_path, control="late_store")
    _step(w, {2: "b"})
    meta = JobsMeta({}, {3: "c"}, {2})
    w.handle_preemptions(meta)
    w.bind_connector_metadata(meta)
    assert seen == [({}, None)] and w.inner.given[-1] == ({}, None)
    _arm(tmp_path)
    assert _step(w, {}) == ({2: "b", 3: "c"}, None)


def test_the_early_report_is_vllms_own_worker_report(tmp_path):
    """With vLLM's own metadata class (the installed vLLM's OffloadingConnectorMetadata), the
    report made for an early job is its OffloadingWorkerMetadata, which aggregates as vLLM does."""
    common = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common")
    w = _worker(tmp_path)
    _arm(tmp_path, control="late_store")
    for flush in (None, {2}):
        w.bind_connector_metadata(common.OffloadingConnectorMetadata(load_jobs={}, store_jobs={2: "b"} if not flush
                                                                     else {}, jobs_to_flush=flush))
        w.wait_for_save()
        w.clear_connector_metadata()
    meta = w.build_connector_worker_meta()
    assert type(meta) is common.OffloadingWorkerMetadata
    assert meta.aggregate(common.OffloadingWorkerMetadata(completed_jobs={2: 1})).completed_jobs == {2: 2}
