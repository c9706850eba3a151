"""The live GPU exchanges' definitions and the control file of their faults, checked without a
GPU: which edges a consumer-side control drops by load mode, and a control file that names an
edge no engine has is an error, not a control that drops nothing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvgate.faults.control import ControlFile, ControlFileError  # noqa: E402
from kvgate.faults.gpu_live import _spec, dropped_edges  # noqa: E402
from kvgate.harness.scenarios.gpu_live import CONSUMER_EDGES, EXCHANGES, load_mode, reads_edges  # noqa: E402
from kvpool.connector.history import HistoryWriter  # noqa: E402
from kvpool.gpu.config import OrderingEdge  # noqa: E402


def test_every_fault_has_its_control_on_the_same_side():
    by = {ex.name: ex for ex in EXCHANGES}
    for name in ("stream_delay", "load_delay"):
        fault, control = by[name], by[f"{name}_control"]
        assert not fault.expect_caught and control.expect_caught and fault.side == control.side
        assert {k: v for k, v in control.fault.items() if k not in ("control", "drop", "install")} == fault.fault
    assert by["load_delay"].side == "consumer" and by["stream_delay"].side == "producer"
    assert by["load_delay_control"].fault["drop"] == CONSUMER_EDGES


def test_the_consumer_control_drops_every_edge_that_alone_orders_the_reads():
    assert reads_edges("sync") == ["read_after_load"]
    assert reads_edges("async") == ["read_after_load", "release_after_copy"]
    assert reads_edges(None) == ["read_after_load"]  # no namespace record: the synchronous default


def test_the_load_mode_is_the_replicas_latest_namespace_record(tmp_path):
    for replica, mode in (("A", "sync"), ("B", "sync"), ("B", "async")):
        w = HistoryWriter(tmp_path, replica, "scheduler")
        w.write("namespace", ns={}, load_mode=mode)
        w.close()
    assert load_mode(tmp_path, "B") == "async" and load_mode(tmp_path, "A") == "sync"
    assert load_mode(tmp_path, "C") is None


def test_drop_names_one_edge_or_several_and_an_unknown_one_is_an_error(tmp_path):
    assert dropped_edges({}) == {OrderingEdge.STORE_AFTER_WRITE}
    assert dropped_edges({"drop": "read_after_load"}) == {OrderingEdge.READ_AFTER_LOAD}
    assert dropped_edges({"drop": ["read_after_load", "release_after_copy"]}) == {
        OrderingEdge.READ_AFTER_LOAD, OrderingEdge.RELEASE_AFTER_COPY}
    for bad in ("read_after_lod", ["read_after_load", 3], 7):
        path = tmp_path / "faults.json"
        path.write_text(json.dumps({"gpu": {"load_delay_ms": 1, "control": "unordered", "drop": bad}}))
        with pytest.raises(ControlFileError):
            _spec(ControlFile(path))


def test_the_consumer_control_takes_the_staged_install():
    """With the direct install the writes are over when load() returns (the host read the
    sketches of the blocks the same kernel wrote), so the control that drops the reads' edges
    runs its load staged, where the writes follow the check."""
    control = {ex.name: ex for ex in EXCHANGES}["load_delay_control"].fault
    assert control["install"] == "staged"


def test_a_control_file_the_engines_threads_cannot_read_keeps_every_edge_and_is_recorded(tmp_path):
    """The edge hooks run on the engine's own threads (a commit's, a release's): a file that
    cannot be read there arms nothing (every edge kept, no raise that would leave a copy
    running under pages given back), and the error is in the history."""
    from kvgate.faults.gpu_live import SwitchableTransferEngine, check_section
    from kvpool.connector.history import read_history

    path = tmp_path / "faults.json"
    path.write_text('{"gpu": {"control": "unordered", "drop": "release_after_copy"')  # half written
    engine = object.__new__(SwitchableTransferEngine)  # the hooks' state only: no CUDA here
    engine.control, engine.dropped = ControlFile(path), 0
    engine.history = HistoryWriter(tmp_path / "history", "A", "worker")
    assert engine._drops(OrderingEdge.RELEASE_AFTER_COPY) is False and engine.dropped == 0
    path.write_text(json.dumps({"gpu": {"control": "unordered", "drop": "release_after_copy"}}))
    assert engine._drops(OrderingEdge.RELEASE_AFTER_COPY) is True and engine.dropped == 1
    assert engine._drops(OrderingEdge.READ_AFTER_LOAD) is False
    engine.history.close()
    errors = [r for r in read_history(tmp_path / "history") if r["ev"] == "fault_control_error"]
    assert len(errors) == 1 and "not JSON" in errors[0]["error"]
    with pytest.raises(ControlFileError, match="install"):
        check_section({"load_delay_ms": 1, "install": "stagd"})


def test_the_consumer_is_reused_only_once_its_engine_recorded_the_delayed_writes_over(tmp_path):
    import time

    from kvgate.harness.scenarios.gpu_live import GpuLiveError, wait_delayed_writes

    since = time.time()
    w = HistoryWriter(tmp_path, "B", "worker")
    w.write("load_delay_done", site="gpu_stream", blocks=75, loaded=75)
    w.close()
    wait_delayed_writes(tmp_path, "B", since)  # there: returns
    with pytest.raises(GpuLiveError, match="never finished"):
        wait_delayed_writes(tmp_path, "A", since, timeout_s=0.2)  # another replica's record is not this one's
    with pytest.raises(GpuLiveError):
        wait_delayed_writes(tmp_path, "B", time.time() + 1, timeout_s=0.2)  # an earlier delay's is not this one's
