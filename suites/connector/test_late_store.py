"""kvgate.faults.connector's `late_store` control around a recording connector: while armed, the
scheduler frees a finished request at once and the inner connector's save calls are held;
at the first step after the release (or the disarm) they reach the inner connector in
order, each with its own step's metadata, and the inner's late completion reports of the
requests freed at once are dropped. The hooks the wrapper does not change (newer vLLM's
included) reach the inner connector unchanged."""

from __future__ import annotations

import json
from types import SimpleNamespace

from kvgate.faults.connector import FaultConnector
from kvpool.connector import vllm_compat as compat
from kvpool.connector.wrap import FORWARDED, WrappingConnector


class Recorder(compat.KVConnectorBase_V1):
    """An inner connector that asks a delayed free and records every save it gets."""

    takes_extra_config = True

    def __init__(self, vllm_config, role, kv_cache_config=None, *, extra=None):  # noqa: ANN001
        super().__init__(vllm_config, role, kv_cache_config)
        self.saves: list[tuple[str, str]] = []  # (the bound metadata's step, layer or "wait")
        self.sending: set[str] = set()
        self.new_requests: list[str] = []

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        return True, None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        return None

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        return SimpleNamespace(step=0)

    def start_load_kv(self, forward_context, **kwargs):  # noqa: ANN001, ANN201
        return None

    def wait_for_layer_load(self, layer_name):  # noqa: ANN001, ANN201
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):  # noqa: ANN001, ANN201
        self.saves.append((self._get_connector_metadata().step, layer_name))

    def wait_for_save(self):  # noqa: ANN201
        self.saves.append((self._get_connector_metadata().step, "wait"))

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
        return set(self.sending) or None, None

    def on_new_request(self, request):  # noqa: ANN001, ANN201
        self.new_requests.append(request)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):  # noqa: ANN001, ANN206
        return "HND"


def _connector(tmp_path, role):  # noqa: ANN001, ANN202
    extra = {"fault_inner": f"{__name__}:Recorder", "faults_file": str(tmp_path / "faults.json"),
             "history_dir": str(tmp_path / "h"), "replica": "D"}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    return FaultConnector(config, role), config


def _step(c: FaultConnector, step: int) -> None:
    c.bind_connector_metadata(SimpleNamespace(step=step))
    for layer in ("l0", "l1"):
        c.save_kv_layer(layer, None, None)
    c.wait_for_save()
    c.clear_connector_metadata()


def _arm(tmp_path, **section) -> None:  # noqa: ANN001
    (tmp_path / "faults.json").write_text(json.dumps({"connector": section} if section else {}))


def test_held_saves_reach_the_inner_connector_after_the_release_in_order(tmp_path):
    worker, _ = _connector(tmp_path, compat.KVConnectorRole.WORKER)
    inner = worker.inner
    _step(worker, 1)
    assert inner.saves == [(1, "l0"), (1, "l1"), (1, "wait")]
    _arm(tmp_path, control="late_store")
    _step(worker, 2)
    _step(worker, 3)
    assert len(inner.saves) == 3  # held
    _arm(tmp_path, control="late_store", release=True)
    _step(worker, 4)
    # step 4's layers are saved during its forward; the held steps land at its wait_for_save
    assert inner.saves[3:] == [(4, "l0"), (4, "l1"), (2, "l0"), (2, "l1"), (2, "wait"), (3, "l0"), (3, "l1"),
                               (3, "wait"), (4, "wait")]


def test_disarming_releases_what_is_held(tmp_path):
    worker, _ = _connector(tmp_path, compat.KVConnectorRole.WORKER)
    _arm(tmp_path, control="late_store")
    _step(worker, 1)
    _arm(tmp_path)
    _step(worker, 2)
    assert [s for s, _ in worker.inner.saves] == [2, 2, 1, 1, 1, 2]


def _output(sending):  # noqa: ANN001, ANN202
    """The engine's KVConnectorOutput of one step, as its scheduler hands it to the connector."""
    return SimpleNamespace(finished_sending=set(sending) if sending is not None else None, finished_recving=None,
                           kv_connector_stats=None)


def test_a_request_freed_at_once_never_reports_its_completion_to_the_engine(tmp_path):
    """The report of a request freed at once is taken out of the engine's output (its scheduler
    asserts on a report for a request it no longer has), once; a request that finished after the
    release keeps its delayed free and its report; the worker's reports pass unchanged."""
    sched, _ = _connector(tmp_path, compat.KVConnectorRole.SCHEDULER)
    worker, _ = _connector(tmp_path, compat.KVConnectorRole.WORKER)
    request = SimpleNamespace(request_id="r1")
    assert sched.request_finished(request, [1, 2]) == (True, None)  # unarmed: the inner's answer
    _arm(tmp_path, control="late_store")
    assert sched.request_finished(request, [1, 2]) == (False, None)
    worker.inner.sending = {"r1", "r0"}
    assert worker.get_finished({"r1"}) == ({"r0", "r1"}, None)  # the worker passes them on
    out = _output({"r1", "r0"})
    sched.update_connector_output(out)
    assert out.finished_sending == {"r0"}
    _arm(tmp_path, control="late_store", release=True)
    assert sched.request_finished(SimpleNamespace(request_id="r2"), [3]) == (True, None)  # after the release
    out = _output({"r1", "r2"})
    sched.update_connector_output(out)
    assert out.finished_sending == {"r1", "r2"}  # r1's one report was dropped; r2 keeps its own
    sched.update_connector_output(_output(None))  # no reports: nothing to do


def test_hooks_the_wrapper_does_not_change_reach_the_inner_connector(tmp_path):
    sched, config = _connector(tmp_path, compat.KVConnectorRole.SCHEDULER)
    if "on_new_request" in FORWARDED and hasattr(compat.KVConnectorBase_V1, "on_new_request"):
        sched.on_new_request("req")
        assert sched.inner.new_requests == ["req"]
    assert FaultConnector.get_required_kvcache_layout(config) == "HND"
    assert WrappingConnector.get_required_kvcache_layout(
        SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))) is None
