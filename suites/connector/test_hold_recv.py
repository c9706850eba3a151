"""kvgate.faults.connector's schedule section `hold_recv` and its `stale_completion` control,
around an inner connector that reports completed loads: while the section is armed each
completed load is held until the engine reports the request finished (an abort lands there),
then released in that same call; lifting the section releases what is held. Under
`stale_completion` each request reported finished comes back as a finished store in the same
call (vllm#43226's double completion)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kvgate.faults.connector import FaultConnector
from kvpool.connector.history import read_history
from suites.connector.test_late_store import Recorder


class Loader(Recorder):
    """Reports the loads the test says are complete, once each."""

    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.receiving: set[str] = set()

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
        done, self.receiving = self.receiving, set()
        return None, (done or None)


def _worker(tmp_path):  # noqa: ANN001, ANN202
    extra = {"fault_inner": f"{__name__}:Loader", "faults_file": str(tmp_path / "faults.json"),
             "history_dir": str(tmp_path / "h"), "replica": "B"}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    return FaultConnector(config, "worker")


def _write(tmp_path, doc) -> None:  # noqa: ANN001
    (tmp_path / "faults.json").write_text(json.dumps(doc))


def _jobs(tmp_path) -> list[tuple[str, str, str | None]]:  # noqa: ANN001
    return [(r["job"], r["req"], r.get("why")) for r in read_history(tmp_path / "h")
            if r["ev"] == "schedule" and r.get("kind") == "hold_recv"]


def test_a_completed_load_is_held_until_its_request_finishes(tmp_path):
    _write(tmp_path, {"schedule": {"hold_recv": True}})
    c = _worker(tmp_path)
    c.inner.receiving = {"r1"}
    assert c.get_finished(set()) == (None, None)  # the load is done; the engine is not told
    assert c.get_finished(set()) == (None, None)
    assert c.get_finished({"r0"}) == (None, None)  # another request's finish releases nothing
    assert c.get_finished({"r1"}) == (None, {"r1"})  # the abort reached the worker: released with it
    assert c.get_finished(set()) == (None, None)  # once
    assert _jobs(tmp_path) == [("hold", "r1", None), ("finished", "r0", None), ("finished", "r1", None),
                               ("release", "r1", "finished")]


def test_a_load_finished_in_the_same_call_is_released_at_once(tmp_path):
    _write(tmp_path, {"schedule": {"hold_recv": True}})
    c = _worker(tmp_path)
    c.inner.receiving = {"r1"}
    assert c.get_finished({"r1"}) == (None, {"r1"})


def test_lifting_the_section_releases_what_is_held(tmp_path):
    _write(tmp_path, {"schedule": {"hold_recv": True}})
    c = _worker(tmp_path)
    c.inner.receiving = {"r1"}
    assert c.get_finished(set()) == (None, None)
    _write(tmp_path, {})
    c.inner.receiving = {"r2"}
    assert c.get_finished(set()) == (None, {"r1", "r2"})
    assert _jobs(tmp_path)[-1] == ("release", "r1", "lifted")


def test_without_the_section_nothing_is_held(tmp_path):
    _write(tmp_path, {})
    c = _worker(tmp_path)
    c.inner.receiving = {"r1"}
    assert c.get_finished({"r1"}) == (None, {"r1"})
    assert _jobs(tmp_path) == []


def test_stale_completion_reports_each_finished_request_as_a_finished_store(tmp_path):
    _write(tmp_path, {"schedule": {"hold_recv": True}, "connector": {"control": "stale_completion"}})
    c = _worker(tmp_path)
    c.inner.receiving = {"r1"}
    assert c.get_finished(set()) == (None, None)
    assert c.get_finished({"r1"}) == ({"r1"}, {"r1"})  # the load's completion and a store's, for one id
    fired = [r for r in read_history(tmp_path / "h") if r["ev"] == "fault"]
    assert [(r["control"], r["reqs"]) for r in fired] == [("stale_completion", ["r1"])]
    _write(tmp_path, {})
    assert c.get_finished({"r2"}) == (None, None)  # disarmed: nothing more


def test_a_finish_that_comes_before_the_load_completes_releases_it_at_once(tmp_path):
    _write(tmp_path, {"schedule": {"hold_recv": True}})
    c = _worker(tmp_path)
    assert c.get_finished({"r1"}) == (None, None)  # aborted while its load is still running
    c.inner.receiving = {"r1"}
    assert c.get_finished(set()) == (None, {"r1"})  # the load completes: reported, never held
    assert ("hold", "r1", None) not in _jobs(tmp_path)
    assert _jobs(tmp_path)[-1] == ("release", "r1", "finished")


def test_stale_completion_repeats_a_store_the_inner_connector_reported_itself(tmp_path):
    """Where the inner connector reports the finished request's store in the same call, the
    control reports it once more in the next: a second completion all the same."""
    _write(tmp_path, {"connector": {"control": "stale_completion"}})
    c = _worker(tmp_path)
    c.inner.get_finished = lambda finished: ({"r1"} if "r1" in finished else None, None)
    assert c.get_finished({"r1"}) == ({"r1"}, None)
    assert c.get_finished(set()) == ({"r1"}, None)
    assert c.get_finished(set()) == (None, None)
