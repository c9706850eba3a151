"""What a negative control of the fault-injecting connector leaves behind once disarmed
(kvgate.faults.connector_controls): the conformance runner restarts only the replicas a
control that keeps state of its own was armed on, and goes on with the others. Each control
declared healed by a disarm is driven through the hooks it acts on, for whole requests,
then disarmed: the fault connector's own state is then a fresh one's, and its next answers
are the inner connector's. late_store, which the runner restarts, is caught by the same
comparison (its held saves and the ids it freed early stay)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from kvgate.faults.connector import FaultConnector
from kvgate.faults.connector_controls import CONTROLS, HEALED_BY_DISARM, restart_after
from kvpool.connector import vllm_compat as compat

BLOCK = 16


class Stats:
    def __init__(self, n: int = 1) -> None:
        self.n = n

    def is_empty(self) -> bool:
        return self.n == 0

    def aggregate(self, other: "Stats") -> "Stats":
        return Stats(self.n + other.n)

    def reduce(self) -> dict:
        return {"loads": self.n}


@dataclasses.dataclass
class Output:
    kv_connector_stats: object = None


class Inner(compat.KVConnectorBase_V1):
    """An inner connector with a hit of two blocks for every prompt, one failed block,
    one load in its stats, a reset that works, and a delayed free."""

    takes_extra_config = True

    def __init__(self, vllm_config, role, kv_cache_config=None, *, extra=None):  # noqa: ANN001
        super().__init__(vllm_config, role, kv_cache_config)
        self.seen: list[tuple] = []  # what reached it: (hook, request id, what it saw)
        self.sending: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001, ANN201
        self.seen.append(("match", request.request_id, getattr(request, "skip_reading_prefix_cache", None),
                          getattr(getattr(request, "lora_request", None), "lora_path", None)))
        return 2 * BLOCK, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # noqa: ANN001, ANN201
        self.seen.append(("alloc", request.request_id, num_external_tokens))

    def request_finished(self, request, block_ids):  # noqa: ANN001, ANN201
        return True, None

    def build_connector_meta(self, scheduler_output):  # noqa: ANN001, ANN201
        return SimpleNamespace(step=0)

    def start_load_kv(self, forward_context, **kwargs):  # noqa: ANN001, ANN201
        return None

    def wait_for_layer_load(self, layer_name):  # noqa: ANN001, ANN201
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):  # noqa: ANN001, ANN201
        self.seen.append(("save", layer_name))

    def wait_for_save(self):  # noqa: ANN201
        return None

    def get_finished(self, finished_req_ids):  # noqa: ANN001, ANN201
        return set(self.sending) or None, None

    def get_block_ids_with_load_errors(self):  # noqa: ANN201
        return {3}

    def get_kv_connector_stats(self):  # noqa: ANN201
        return Stats()

    def update_connector_output(self, connector_output):  # noqa: ANN001, ANN201
        self.seen.append(("output", connector_output.kv_connector_stats is not None))

    def reset_cache(self):  # noqa: ANN201
        return True


def _connector(tmp_path, role):  # noqa: ANN001, ANN202
    extra = {"fault_inner": f"{__name__}:Inner", "faults_file": str(tmp_path / "faults.json"),
             "history_dir": str(tmp_path / "h"), "replica": "B"}
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
                             cache_config=SimpleNamespace(block_size=BLOCK))
    return FaultConnector(config, role)


def _arm(tmp_path, control: str | None) -> None:  # noqa: ANN001
    (tmp_path / "faults.json").write_text(json.dumps({"connector": {"control": control}} if control else {}))


def _request(rid: str, tokens: int = 4 * BLOCK):  # noqa: ANN202
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), skip_reading_prefix_cache=True,
                           lora_request=SimpleNamespace(lora_name="ad", lora_int_id=7, lora_path="/adapters/ad"))


def _traffic(sched: FaultConnector, worker: FaultConnector, rid: str) -> list:
    """One whole request through every hook a control acts on, and one step of the worker;
    what each hook answered."""
    req = _request(rid)
    answers = [sched.get_num_new_matched_tokens(req, 0)]
    sched.update_state_after_alloc(req, SimpleNamespace(), answers[0][0])
    answers.append(req.skip_reading_prefix_cache)
    sched.update_connector_output(Output(Stats()))
    answers.append(sched.request_finished(req, [1, 2]))
    answers.append(sched.reset_cache())
    worker.bind_connector_metadata(SimpleNamespace(step=1))
    worker.save_kv_layer("l0", None, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker.inner.sending = {rid}
    sending, _ = worker.get_finished({rid, f"{rid}-aborted"})  # and one the engine finished with no transfer
    answers.append(sorted("this request" if r == rid else r.replace(rid, "that") for r in sending or ()))
    answers.append(sorted(worker.get_block_ids_with_load_errors()))
    stats = worker.get_kv_connector_stats()
    answers.append(stats.n if stats is not None else None)
    seen = [s for s in sched.inner.seen[-3:] if s[0] != "alloc"]  # what reached the inner connector
    answers.append([s[2:] if s[0] == "match" else s for s in seen])
    return answers


_IDENTITY = {"_inner", "history", "control", "_lock", "_generation", "_vllm_config", "_role", "_kv_cache_config",
             "_connector_metadata", "_kv_transfer_config", "own", "_extra", "history_dir"}


def _own_state(c: FaultConnector) -> dict:
    """The fault connector's own state across calls (not the objects it holds, nor the
    inner connector's, nor the control file's generation it last read)."""
    return {k: v for k, v in vars(c).items() if k not in _IDENTITY and not callable(v)
            and type(v).__module__ in ("builtins", "typing")}


def _after_disarm(tmp_path, control: str):  # noqa: ANN001, ANN202
    sched = _connector(tmp_path, compat.KVConnectorRole.SCHEDULER)
    worker = _connector(tmp_path, compat.KVConnectorRole.WORKER)
    _arm(tmp_path, control)
    armed = _traffic(sched, worker, "r1")
    _arm(tmp_path, None)
    after = _traffic(sched, worker, "r2")
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    _arm(fresh_dir, None)
    fs, fw = _connector(fresh_dir, compat.KVConnectorRole.SCHEDULER), _connector(fresh_dir, compat.KVConnectorRole.WORKER)
    fresh = _traffic(fs, fw, "r2")
    return (armed, after, fresh), (_own_state(sched), _own_state(fs)), (_own_state(worker), _own_state(fw))


@pytest.mark.parametrize("control", sorted(HEALED_BY_DISARM))
def test_a_control_declared_healed_by_a_disarm_leaves_nothing_of_its_own(tmp_path, control):
    (armed, after, fresh), sched, worker = _after_disarm(tmp_path, control)
    assert armed != fresh, (control, armed, fresh)  # it acted while armed
    assert after == fresh, (control, after, fresh)  # disarmed: the inner connector's answers
    assert sched[0] == sched[1], (control, sched)
    assert worker[0] == worker[1], (control, worker)


def test_late_store_keeps_state_past_a_disarm_and_is_restarted(tmp_path):
    """The comparison the test above relies on catches a control with state of its own."""
    assert restart_after("late_store") and "late_store" in CONTROLS
    _, sched, worker = _after_disarm(tmp_path, "late_store")
    assert sched[0] != sched[1] or worker[0] != worker[1], (sched, worker)


def test_every_control_is_declared_and_an_unknown_one_is_restarted():
    assert set(HEALED_BY_DISARM) < set(CONTROLS)
    assert restart_after(None) and restart_after("a-control-nobody-declared")
    assert all(not restart_after(c) for c in HEALED_BY_DISARM)
