"""The conformance matrix's bookkeeping, without a live system: a scenario that needs what
a connector lacks is "n/a" with the connector's own reason (never a pass), a scenario not
in the catalog yet is "not run", a connector that cannot run here (it does not import, or
needs a GPU this machine lacks) gives every cell "not run" with why and fails
`kvgate gate --connector` before anything is started, a row of nothing but n/a fails, and
the matrix names every failing cell's finding and replay command."""

import dataclasses
import json
from pathlib import Path

import pytest

from kvgate.harness import cli
from kvgate.harness.conformance.connectors import CONNECTORS, profile
from kvgate.harness.conformance.gate import STATUSES, row_verdict, run_cell, run_connector, write_matrix
from kvgate.harness.conformance.scenarios import SCENARIOS, Ctx
from kvgate.harness.system.cluster import ClusterStartError


@pytest.fixture
def nothing_starts(monkeypatch):
    """Building the model, the pool or a replica fails the test: the availability check
    must come before all of them."""
    import kvgate.fixtures.tiny_model
    import kvgate.harness.system.cluster

    def started(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the gate started something for a connector that cannot run")

    monkeypatch.setattr(kvgate.harness.system.cluster, "Cluster", started)
    monkeypatch.setattr(kvgate.fixtures.tiny_model, "build_tiny_model", started)


def test_a_missing_capability_is_not_applicable_with_the_connectors_reason():
    ctx = Ctx(cluster=None, corpus=None, profile=CONNECTORS["example"], seed=0)
    cell = run_cell(ctx, SCENARIOS["partial_hit"], root=7)
    assert cell["status"] == "n/a"
    assert "whole prompt" in cell["reason"]
    assert cell["replay"] == "kvgate gate --connector example --scenario partial_hit --seed 7"


def test_a_scenario_not_in_the_catalog_yet_is_not_run_never_a_pass():
    ctx = Ctx(cluster=None, corpus=None, profile=CONNECTORS["kvpool"], seed=0)
    later = dataclasses.replace(SCENARIOS["cross_replica_hit"], body=None, not_run="not in the catalog yet")
    cell = run_cell(ctx, later, root=7)
    assert cell["status"] == "not run" and cell["reason"]


def test_an_unavailable_connector_is_not_run_everywhere_and_starts_nothing(tmp_path, nothing_starts):
    row = run_connector("no_such_module_kvgate:Connector", None, 3, tmp_path / "x")
    assert {c["status"] for c in row["cells"].values()} == {"not run"}
    assert all("cannot import" in c["reason"] for c in row["cells"].values())
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
    passed, why = row_verdict(row)
    assert not passed and "No module named 'no_such_module_kvgate'" in why


def test_gate_connector_that_does_not_import_fails_with_the_import_error(tmp_path, nothing_starts, capsys):
    rc = cli.main(["gate", "--connector", "nosuch.module:Foo", "--seed", "5", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "kvgate gate --connector nosuch.module:Foo: FAIL" in out and "No module named 'nosuch'" in out
    doc = json.loads((tmp_path / "matrix.json").read_text())
    assert {c["status"] for c in doc["rows"][0]["cells"].values()} == {"not run"}


def test_a_module_without_the_class_or_a_broken_import_is_not_run(tmp_path, nothing_starts, monkeypatch):
    assert not row_verdict(run_connector("json:NoSuchConnector", None, 3, tmp_path / "a"))[0]
    broken = tmp_path / "kvgate_broken_connector.py"
    broken.write_text("raise RuntimeError('the vendor library failed to load')\nclass C: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    row = run_connector("kvgate_broken_connector:C", None, 3, tmp_path / "b")
    passed, why = row_verdict(row)
    assert not passed and "RuntimeError: the vendor library failed to load" in why


def test_a_gpu_only_connector_on_a_host_without_a_gpu_is_not_run(tmp_path, nothing_starts, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_only = dataclasses.replace(CONNECTORS["kvpool"], name="gpu-only", device="cuda")
    monkeypatch.setitem(CONNECTORS, "gpu-only", gpu_only)
    row = run_connector("gpu-only", None, 3, tmp_path / "g", device="cpu")
    passed, why = row_verdict(row)
    assert not passed and "CUDA GPUs only" in why
    assert {c["status"] for c in row["cells"].values()} == {"not run"}


def _row(*statuses):  # noqa: ANN002, ANN202
    return {"connector": "x", "cells": {f"s{i}": {"scenario": f"s{i}", "status": st, "reason": f"r{i}"}
                                        for i, st in enumerate(statuses)}}


def test_the_rule_n_a_is_neither_a_pass_nor_a_fail_but_nothing_judged_fails():
    assert row_verdict(_row("pass", "n/a", "pass")) == (True, "2 cells passed, 1 n/a")
    assert not row_verdict(_row("n/a", "n/a"))[0]  # every cell n/a: nothing was judged
    assert "nothing was judged" in row_verdict(_row("n/a", "n/a"))[1]
    assert not row_verdict(_row("pass", "not run"))[0]  # not run is never a pass
    assert not row_verdict(_row("pass", "fail", "n/a"))[0]
    assert not row_verdict(_row())[0]


def test_every_profile_declares_every_capability_the_scenarios_need():
    needed = {n for sc in SCENARIOS.values() for n in sc.needs}
    for name, prof in CONNECTORS.items():
        assert needed <= set(prof.capabilities), (name, needed - set(prof.capabilities))
    assert profile("pkg.mod:Cls", {"a": 1}).settings(None) == {"a": 1}


def test_the_matrix_reports_each_failing_cell_with_its_evidence_and_replay(tmp_path):
    cell = {"scenario": "salt_isolation", "describe": "d", "status": "fail", "reason": "B installed 9 blocks",
            "evidence": {"leaked": 9}, "replay": "kvgate gate --connector example --scenario salt_isolation --seed 1"}
    rows = [{"connector": "example", "versions": {"vllm": "0.32"}, "cells": {"salt_isolation": cell}}]
    paths = write_matrix(rows, tmp_path, 1)
    md = paths["markdown"].read_text()
    assert "**FAIL**" in md and "B installed 9 blocks" in md and cell["replay"] in md and '"leaked": 9' in md
    doc = json.loads(paths["json"].read_text())
    assert doc["rows"][0]["cells"]["salt_isolation"]["status"] in STATUSES


@pytest.mark.parametrize("down_judged", [True, False], ids=["declared", "not-declared"])
def test_a_control_that_takes_its_replica_down_is_judged_only_where_the_scenario_declares_it(monkeypatch,
                                                                                            down_judged):
    """A control run with a replica down is inconclusive (the cell fails), unless the
    scenario declares that its control's defect takes the replica down on this vLLM
    (control_down_judged): then its oracle judges the run, and the down replica is evidence."""
    from kvgate.harness.checkers.verdict import Checks
    from kvgate.harness.conformance import gate

    def body(ctx, control=None):  # noqa: ANN001, ANN202
        c = Checks()
        c.check("the list is full-length", control is None, {"request_failed": "HTTP 500"})
        return c

    def run_body(ctx, sc, **kw):  # noqa: ANN001, ANN003, ANN202
        checks = sc.body(ctx, **kw)
        return checks, None, ({"B": "OverflowError: number too small"} if kw.get("control") else {})

    monkeypatch.setattr(gate, "_run_body", run_body)
    sc = dataclasses.replace(SCENARIOS["prompt_logprobs_warm"], body=body, control_oracle="the list is full-length",
                             control_down_judged=down_judged)
    cluster = type("Cluster", (), {"reset": lambda self: None})()
    cell = run_cell(Ctx(cluster=cluster, corpus=None, profile=CONNECTORS["kvpool"], seed=0), sc, root=7)
    if down_judged:
        assert cell["status"] == "pass" and cell["control"]["caught"], cell
        assert "OverflowError" in cell["control"]["replica_down"]["B"]
    else:
        assert cell["status"] == "fail" and "INCONCLUSIVE" in cell["control"]["why"], cell


class _StandIn:
    """A cluster of replicas that never start: the fault files are real, a kill and a restart
    are recorded, a reset does nothing."""

    def __init__(self, tmp_path, names):  # noqa: ANN001
        from types import SimpleNamespace

        self.faults = {n: tmp_path / f"faults-{n}.json" for n in names}
        for path in self.faults.values():
            path.write_text("{}")
        self.replicas = {n: SimpleNamespace(proc=SimpleNamespace(poll=lambda: None)) for n in names}
        self.report_dir, self.history_dir = tmp_path, tmp_path / "h"
        self.killed, self.restarted = [], []

    def reset(self) -> None:
        pass

    def kill_replica(self, name: str) -> None:
        self.killed.append(name)

    def restart_replicas(self, names: list[str]) -> None:
        self.restarted.append(list(names))


@pytest.mark.parametrize(("armed", "restarted"), [
    ({"B": "claim_past_loaded"}, []),                          # healed by its disarm
    ({"B": "hide_failures", "D": "late_store"}, [["D"]]),      # D keeps held saves: restarted
    ({"E": "adapter_by_name", "F": "adapter_by_name"}, []),
    ({"B": "a-control-nobody-declared"}, [["B"]]),             # unknown: restarted
])
def test_after_a_run_every_armed_replica_is_disarmed_and_only_a_stateful_controls_restarted(
        tmp_path, monkeypatch, armed, restarted):
    from kvgate.harness.conformance import gate
    from kvgate.harness.conformance.context import arm_control
    from kvgate.harness.conformance.scenarios import Scenario

    monkeypatch.setattr(gate, "_casualties", lambda cluster: {})
    monkeypatch.setattr(gate.wrong_kv, "of_run", lambda ctx, t0, t1: None)
    cluster = _StandIn(tmp_path, ["A", "B", "D", "E", "F"])

    def body(ctx, control=None):  # noqa: ANN001, ANN202
        for name, c in armed.items():
            arm_control(ctx, name, c)
        return None

    ctx = Ctx(cluster=cluster, corpus=None, profile=dataclasses.replace(CONNECTORS["kvpool"], reset=None), seed=0)
    gate._run_body(ctx, Scenario("s", body, (), "a stand-in"))
    assert cluster.restarted == restarted and cluster.killed == [n for r in restarted for n in r]
    assert all(json.loads(p.read_text()) == {} for p in cluster.faults.values())
    assert ctx.healed == {"restarted": [n for r in restarted for n in r],
                          "disarmed": sorted(set(armed) - {n for r in restarted for n in r})}


def _hist(tmp_path, recs):
    from kvpool.connector.history import HistoryWriter

    w = HistoryWriter(tmp_path, "A", "worker")
    for ev, fields in recs:
        w.write(ev, **fields)
    w.close()
    return tmp_path


def test_kvpool_unsettled_names_each_queued_store_without_its_record(tmp_path):
    from kvgate.harness.conformance.connectors import kvpool_unsettled

    q = {"req": "r1", "tag": "t", "blocks": 4, "tier": False}
    h = _hist(tmp_path, [("store_queued", {**q, "first_block": 0}), ("store_queued", {**q, "first_block": 4}),
                         ("store_queued", {**q, "req": "r2", "tag": "other", "first_block": 0}),
                         ("publish", {"req": "r1", "tag": "t", "first_block": 0, "blocks": 4, "committed": 4})])
    left = kvpool_unsettled(h, "A", "t")
    assert [(r["req"], r["first_block"], r["missing"]) for r in left] == [("r1", 4, ["publish"])]
    assert kvpool_unsettled(h, "B", "t") == []  # another replica's stores are not this request's


def test_kvpool_unsettled_waits_for_the_tier_record_and_counts_a_drop(tmp_path):
    from kvgate.harness.conformance.connectors import kvpool_unsettled

    h = _hist(tmp_path, [("store_queued", {"req": "r1", "tag": "t", "first_block": 0, "blocks": 2, "tier": True}),
                         ("publish", {"req": "r1", "tag": "t", "first_block": 0, "blocks": 2, "error": "PoolTimeout"}),
                         ("store_queued", {"req": "r3", "tag": "t", "first_block": 0, "blocks": 2, "tier": False}),
                         ("publish_dropped", {"req": "r3", "stores": 1, "reason": "preempted"})])
    assert [(r["req"], r["missing"]) for r in kvpool_unsettled(h, "A", "t")] == [("r1", ["tier_publish"])]
    _hist(tmp_path, [("tier_publish", {"req": "r1", "tag": "t", "first_block": 0, "blocks": 2, "put": 2})])
    assert kvpool_unsettled(h, "A", "t") == []


def test_kvpool_unsettled_spends_a_drop_on_the_latest_store_and_reads_complete_lines_only(tmp_path):
    """A preemption cancels the stores that had not started, the latest ones: a drop stands for
    the latest store's missing record, never for one that landed (the hook would otherwise wait
    for a record that cannot come); a line the worker is still writing is not read."""
    from kvgate.harness.conformance.connectors import kvpool_unsettled

    q = {"req": "r1", "tag": "t", "blocks": 8, "tier": False}
    h = _hist(tmp_path, [("store_queued", {**q, "first_block": 0}),
                         ("publish", {"req": "r1", "tag": "t", "first_block": 0, "blocks": 8, "committed": 8}),
                         ("store_queued", {**q, "first_block": 8}), ("store_queued", {**q, "first_block": 16}),
                         ("publish_dropped", {"req": "r1", "stores": 1, "reason": "preempted"})])
    assert [(r["first_block"], r["missing"]) for r in kvpool_unsettled(h, "A", "t")] == [(8, ["publish"])]
    (path,) = tmp_path.glob("A.worker.*.jsonl")
    with open(path, "a") as f:
        f.write('{"ev": "publish", "t": 1.0, "replica": "A", "tag": "t", "req": "r1", "first_bl')  # half a line
    assert [(r["first_block"], r["missing"]) for r in kvpool_unsettled(h, "A", "t")] == [(8, ["publish"])]


def test_lmcache_on_cuda_runs_beside_vllm_and_needs_a_gpu(tmp_path, nothing_starts, monkeypatch):
    """The CUDA twin of lmcache-mp: no environment of its own (LMCache installed beside the GPU
    host's vLLM), its server run by this interpreter; on a machine without a GPU it is not run,
    with that reason, and nothing starts."""
    import sys

    import kvgate.harness.conformance.connectors as connectors

    prof = CONNECTORS["lmcache-mp-cuda"]
    cpu = CONNECTORS["lmcache-mp"]
    assert (prof.device, prof.venv, prof.inner, prof.chunk_tokens) == ("cuda", "", cpu.inner, cpu.chunk_tokens)
    assert prof.capabilities == cpu.capabilities
    started = []
    monkeypatch.setattr(connectors, "spawn", lambda args, log, env: started.append(args) or (_ for _ in ()).throw(
        RuntimeError("not started here")))
    with pytest.raises(RuntimeError, match="not started here"):
        prof.service(tmp_path)
    assert started[0][0] == sys.executable and started[0][1] == "-c" and "lmcache.cli.main" in started[0][2]
    assert started[0][3] == "server"
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    engine = CONNECTORS["lmcache-mp-cuda-engine"]  # the control of the stale-chunk finding: the worker copies
    assert engine.settings(tmp_path) == {"lmcache.mp.mp_transfer_mode": "engine_driven"}
    assert (engine.device, engine.venv, engine.inner, engine.capabilities) == (
        prof.device, prof.venv, prof.inner, prof.capabilities)
    if not gpu:
        row = run_connector("lmcache-mp-cuda", None, 3, tmp_path / "x")
        assert {c["status"] for c in row["cells"].values()} == {"not run"}
        assert all("CUDA GPUs only" in c["reason"] for c in row["cells"].values())


class _System:
    """Stand-ins for the pool's cluster and a connector's server: what started, where, and
    what stopped, in order."""

    def __init__(self, fail_starts: int = 0):
        self.events: list[tuple[str, str]] = []
        self.fail_starts = fail_starts  # starts of the cluster that fail, after the first

    def cluster_class(self):  # noqa: ANN202
        system = self

        class Cluster:
            def __init__(self, model, report_dir, **kw):  # noqa: ANN001, ANN003
                self.report_dir, self.model_dir = Path(report_dir), Path(model)
                self.replicas, self.faults = {}, {}

            def start(self, specs):  # noqa: ANN001
                if system.fail_starts and any(e[0] == "cluster start" for e in system.events):
                    system.fail_starts -= 1
                    raise ClusterStartError(f"replica A exited with 1 ({self.report_dir.name})")
                system.events.append(("cluster start", self.report_dir.name))
                return self

            def stop(self) -> None:
                system.events.append(("cluster stop", self.report_dir.name))

        return Cluster

    def service(self, report_dir):  # noqa: ANN001, ANN201
        from kvgate.harness.conformance.connectors import Service

        system = self
        (Path(report_dir) / "server.log").write_text("")  # as a real server opens its log in the system's folder
        self.events.append(("service start", Path(report_dir).name))

        class Stopping(Service):
            def stop(self) -> None:
                system.events.append(("service stop", Path(report_dir).name))

        from types import SimpleNamespace

        # the first server segfaults under the cells (it has exited when the system is lost)
        proc = SimpleNamespace(poll=lambda: -11 if Path(report_dir).name == "r" else None)
        return Stopping({"server": Path(report_dir).name}, proc=proc, log=None)


@pytest.mark.parametrize(("fail_starts", "died"), [(0, True), (1, True), (0, False)])
def test_a_replica_that_does_not_come_back_fails_its_cell_and_the_rest_run_on_a_fresh_system(
        tmp_path, monkeypatch, fail_starts, died):
    """A connector that wedges its own server takes a replica down in one cell and keeps it
    from restarting: that cell fails with the restart's error, and the cells after it run on a
    system started afresh (its server too) in a folder of its own; where that start fails as
    well, the cells left are not run, with the reason, never passed."""
    from kvgate.harness.conformance import gate

    seen = []

    def run_cell(ctx, sc, root):  # noqa: ANN001, ANN202
        seen.append((sc.name, ctx.cluster.report_dir.name))
        assert ctx.service.settings == {"server": ctx.cluster.report_dir.name}  # the server of the system in use
        if sc.name == "long_prompt":
            lost = ClusterStartError("replica A exited with 1; log replica-A.log: cannot reach the server")
            if died:  # the cell's replica died, and its restart failed (gate._run_body)
                raise gate.SystemLost({"A": "AssertionError: \n(EngineCore) ERROR ... AssertionError"}, lost)
            raise lost  # a restart of the scenario's own
        return {"scenario": sc.name, "status": "pass", "reason": ""}

    names = ["cross_replica_hit", "long_prompt", "partial_hit", "salt_isolation"]
    row, system = _lost_row(tmp_path, monkeypatch, run_cell, names, connector="kvpool", fail_starts=fail_starts)
    cells = row["cells"]
    assert cells["cross_replica_hit"]["status"] == "pass"
    lost = cells["long_prompt"]
    assert lost["status"] == "fail" and "did not come back" in lost["reason"] and "cannot reach" in lost["reason"]
    assert "the connector's server had exited with -11" in lost["reason"] and lost["evidence"]["service_exit"] == -11
    assert lost["signature"] == (["replica A died (AssertionError)"] if died else []) + [
        "the connector's server had exited", "the system did not come back (ClusterStartError)"]
    assert row["restarts"][0]["after"] == "long_prompt" and row["restarts"][0]["dir"] == "restart-1"
    from kvgate.harness.report.conformance import restarts_text

    assert restarts_text(row)[0].startswith("The system was lost in long_prompt and started afresh in restart-1/")
    if not fail_starts:
        assert [c["status"] for c in cells.values()] == ["pass", "fail", "pass", "pass"]
        assert seen == [("cross_replica_hit", "r"), ("long_prompt", "r"), ("partial_hit", "restart-1"),
                        ("salt_isolation", "restart-1")]
        assert system.events == [("service start", "r"), ("cluster start", "r"), ("cluster stop", "r"),
                                 ("service stop", "r"), ("service start", "restart-1"),
                                 ("cluster start", "restart-1"), ("cluster stop", "restart-1"),
                                 ("service stop", "restart-1")]
    else:
        assert [c["status"] for c in cells.values()] == ["pass", "fail", "not run", "not run"]
        assert all("could not be started afresh after long_prompt" in cells[n]["reason"]
                   for n in ("partial_hit", "salt_isolation"))
        assert "ClusterStartError" in row["restarts"][0]["start_error"]
        # what started of the fresh system was stopped when its cluster did not start
        assert system.events[-3:] == [("service start", "restart-1"), ("cluster stop", "restart-1"),
                                      ("service stop", "restart-1")]
        assert not row_verdict(row)[0]


def test_a_restart_that_fails_after_a_death_raises_what_died_with_it(tmp_path, monkeypatch):
    """_run_body restarts the replicas that died under the cell; where that restart fails, the
    caller gets the dead replicas' log lines with the restart's error (SystemLost), so the
    cell names what died, not only that the restart failed."""
    from kvgate.harness.conformance import gate
    from kvgate.harness.conformance.scenarios import Scenario

    died = {"B": "AssertionError: \n(EngineCore) ERROR AssertionError"}
    monkeypatch.setattr(gate, "_casualties", lambda cluster: died)
    monkeypatch.setattr(gate.wrong_kv, "of_run", lambda ctx, t0, t1: None)
    cluster = _StandIn(tmp_path, ["A", "B"])

    def restart(names):  # noqa: ANN001, ANN202
        raise ClusterStartError("replica B exited with 1: cannot reach the server")

    cluster.restart_replicas = restart
    ctx = Ctx(cluster=cluster, corpus=None, profile=dataclasses.replace(CONNECTORS["kvpool"], reset=None), seed=0)
    with pytest.raises(gate.SystemLost) as lost:
        gate._run_body(ctx, Scenario("s", lambda ctx, control=None: None, (), "a stand-in"))
    assert lost.value.down == died and isinstance(lost.value.cause, ClusterStartError)


def test_a_dead_engines_root_cause_is_found_when_it_has_no_message(tmp_path):
    """A bare `assert` dies as a line that is only `AssertionError`: that is the root cause,
    not the API server's EngineDeadError after it (vLLM 0.24's scheduler, on the H100)."""
    from kvgate.harness.conformance import gate
    from kvgate.harness.conformance.baseline import signature_of

    log = tmp_path / "replica-A.log"
    log.write_text(
        "(EngineCore pid=1) ERROR 12-06 07:58:10 [scheduler.py:2604] Failing 1 request(s) due to KV load failure\n"
        "(EngineCore pid=1) ERROR 12-06 07:58:10 [core.py:1233]     assert req_id in self.requests\n"
        "(EngineCore pid=1) ERROR 12-06 07:58:10 [core.py:1233] AssertionError\n"
        "(APIServer pid=2) ERROR 12-06 07:58:10 [async_llm.py:704] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n")
    errors = gate._log_errors(log)
    assert errors.splitlines()[0] == "AssertionError"
    assert signature_of({"status": "fail", "reason": "x"}, down={"A": errors}) == ["replica A died (AssertionError)"]


def test_a_connector_that_loses_every_system_gets_a_bounded_number_of_fresh_starts(tmp_path, monkeypatch):
    """Each loss can cost the connector's own connect timeout: after FRESH_STARTS fresh starts
    the next loss leaves the cells after it not run, with why."""
    from kvgate.harness.conformance import gate

    def run_cell(ctx, sc, root):  # noqa: ANN001, ANN202
        raise ClusterStartError("replica A exited with 1")

    names = list(SCENARIOS)[:gate.FRESH_STARTS + 3]
    row, system = _lost_row(tmp_path, monkeypatch, run_cell, names, connector="kvpool")
    statuses = [row["cells"][n]["status"] for n in names]
    assert statuses == ["fail"] * (gate.FRESH_STARTS + 1) + ["not run"] * 2, statuses
    assert len(row["restarts"]) == gate.FRESH_STARTS
    assert f"lost {gate.FRESH_STARTS + 1} times" in row["cells"][names[-1]]["reason"]
    assert sum(e[0] == "cluster start" for e in system.events) == gate.FRESH_STARTS + 1
    assert sum(e[0] == "cluster stop" for e in system.events) == gate.FRESH_STARTS + 1


def _lost_row(tmp_path, monkeypatch, run_cell, names, stop_raises=False, connector="example",  # noqa: ANN001, ANN202
              fail_starts=0):
    """run_connector over stand-ins (tests of the lost-system path): the row and the events."""
    import kvgate.fixtures.tiny_model
    import kvgate.harness.system.cluster as cluster_mod
    from kvgate.harness.conformance import gate

    system = _System(fail_starts)
    cls = system.cluster_class()
    if stop_raises:
        def stop(self) -> None:  # noqa: ANN001
            system.events.append(("cluster stop", self.report_dir.name))
            raise cluster_mod.OrphanError("a replica survived stop()")
        cls.stop = stop
    monkeypatch.setattr(cluster_mod, "Cluster", cls)
    monkeypatch.setattr(cluster_mod, "install_sigterm_unwind", lambda: None)
    monkeypatch.setattr(kvgate.fixtures.tiny_model, "build_tiny_model", lambda path, **kw: path)
    monkeypatch.setattr("kvgate.harness.workload.prompts.Corpus", lambda model: None)
    monkeypatch.setattr(gate, "_specs", lambda prof, where, replicas, settings, device: [])
    prof = dataclasses.replace(CONNECTORS[connector], service=system.service)
    monkeypatch.setattr(type(prof), "check_available", lambda self: None)
    monkeypatch.setattr(gate, "profile", lambda name, extra: prof)
    monkeypatch.setattr(gate, "run_cell", run_cell)
    return run_connector(connector, None, 3, tmp_path / "r", scenarios=names, device="cpu"), system


def test_a_lost_cell_keeps_what_its_run_judged_and_its_wrong_kv(tmp_path, monkeypatch):
    """The cell in which the system was lost keeps its run's wrong-KV count and what the run
    judged before the loss; a loss under a control keeps no count (the control's is its own)."""
    from kvgate.harness.conformance import gate

    wrong = {"wrong": 5, "differ": 5, "misplaced": 5, "checked": 11, "unverified": 0}

    def run_cell(ctx, sc, root):  # noqa: ANN001, ANN202
        control = "claim_past_loaded" if sc.name == "partial_hit" else None
        raise gate.SystemLost({"A": "AssertionError"}, ClusterStartError("replica A exited with 1"), wrong_kv=wrong,
                              during="RequestFailed: A's request failed", checks="B installed 11 blocks",
                              control=control)

    row, _ = _lost_row(tmp_path, monkeypatch, run_cell, ["long_prompt", "partial_hit", "salt_isolation"])
    own, under_control = row["cells"]["long_prompt"], row["cells"]["partial_hit"]
    assert own["wrong_kv"] == wrong and own["evidence"]["checks"] == "B installed 11 blocks"
    assert own["evidence"]["during"].startswith("RequestFailed")
    assert "wrong_kv" not in under_control and "under the control claim_past_loaded" in under_control["reason"]


def test_a_lost_system_that_does_not_stop_cleanly_is_not_replaced_and_na_cells_stay_na(tmp_path, monkeypatch):
    """No fresh system beside what the lost one left running: the cells after it are not run
    (why: the stop's error), except those the connector declares n/a, which stay n/a; and a
    loss with only n/a cells left starts nothing afresh."""
    from kvgate.harness.conformance import gate

    def run_cell(ctx, sc, root):  # noqa: ANN001, ANN202
        raise gate.SystemLost({"A": "AssertionError"}, ClusterStartError("replica A exited with 1"))

    # example keys whole prompts: partial_hit is n/a for it, salt_isolation runs
    names = ["long_prompt", "partial_hit", "salt_isolation"]
    row, system = _lost_row(tmp_path, monkeypatch, run_cell, names, stop_raises=True)
    assert [row["cells"][n]["status"] for n in names] == ["fail", "n/a", "not run"]
    assert "whole prompt" in row["cells"]["partial_hit"]["reason"]
    assert "did not stop cleanly" in row["cells"]["salt_isolation"]["reason"]
    assert "OrphanError" in row["cells"]["salt_isolation"]["reason"]
    assert "OrphanError" in row["restarts"][0]["stop_error"]
    # the lost system's server was stopped all the same; nothing was started afresh
    assert ("service stop", "r") in system.events
    assert not any(e[1] == "restart-1" for e in system.events)
    from kvgate.harness.report.conformance import restarts_text

    assert restarts_text(row) == ["The system lost in long_prompt did not stop cleanly (OrphanError: a replica "
                                  "survived stop()); nothing was started."]


def test_a_loss_with_only_na_cells_left_starts_nothing_afresh(tmp_path, monkeypatch):
    from kvgate.harness.conformance import gate

    def run_cell(ctx, sc, root):  # noqa: ANN001, ANN202
        raise gate.SystemLost({"A": "AssertionError"}, ClusterStartError("replica A exited with 1"))

    prof = CONNECTORS["example"]
    na_names = [n for n, sc in SCENARIOS.items() if sc.body is not None and any(prof.needs(x) for x in sc.needs)]
    assert na_names, "example declares no scenario n/a"
    row, system = _lost_row(tmp_path, monkeypatch, run_cell, ["long_prompt", na_names[0]])
    assert row["cells"][na_names[0]]["status"] == "n/a" and "restarts" not in row
    assert not any(e[1] == "restart-1" for e in system.events)


def test_no_restart_is_waited_for_against_a_server_that_has_exited(tmp_path, monkeypatch):
    """A replica that died while the connector's server is gone is not restarted (it would
    wait out the connector's connect timeout): SystemLost at once, naming the server's exit."""
    from types import SimpleNamespace

    from kvgate.harness.conformance import gate
    from kvgate.harness.conformance.connectors import Service
    from kvgate.harness.conformance.scenarios import Scenario

    cluster = _StandIn(tmp_path, ["A", "B"])
    service = Service({}, proc=SimpleNamespace(poll=lambda: -11, returncode=-11))
    ctx = Ctx(cluster=cluster, corpus=None, profile=dataclasses.replace(CONNECTORS["kvpool"], reset=None), seed=0,
              service=service)
    monkeypatch.setattr(gate, "_casualties", lambda c: {"A": "AssertionError"})
    monkeypatch.setattr(gate.wrong_kv, "of_run", lambda ctx, t0, t1: {"wrong": 0})
    with pytest.raises(gate.SystemLost) as lost:
        gate._run_body(ctx, Scenario("s", lambda ctx, control=None: None, (), "a stand-in"))
    assert isinstance(lost.value.cause, gate.ServerExited) and "-11" in str(lost.value.cause)
    assert cluster.restarted == [] and lost.value.wrong_kv == {"wrong": 0}


def test_a_source_line_that_names_an_error_is_not_a_root_cause(tmp_path):
    from kvgate.harness.conformance import gate

    log = tmp_path / "replica-B.log"
    log.write_text(
        "(EngineCore pid=1) ERROR 12-06 07:58:10 [core.py:1233] RuntimeError: shape mismatch\n"
        "(EngineCore pid=1) ERROR 12-06 07:58:10 [core.py:1233]     raise NotImplementedError\n")
    assert gate._log_errors(log).splitlines()[0] == "RuntimeError: shape mismatch"


def test_a_service_whose_server_exited_still_has_its_group_killed(monkeypatch):
    from types import SimpleNamespace

    import kvgate.harness.conformance.connectors as connectors

    stopped = []
    monkeypatch.setattr(connectors, "stop_group", lambda proc: stopped.append(proc))
    proc = SimpleNamespace(poll=lambda: -11, pid=4242)
    connectors.Service({}, proc=proc).stop()
    assert stopped == [proc]


def test_a_restarted_replicas_death_is_read_from_its_own_part_of_the_log(tmp_path):
    """A restart appends to the replica's log: the cause of its death is read from where the
    restarted process began, never an earlier run's crash."""
    from kvgate.harness.conformance import gate

    log = tmp_path / "replica-A.log"
    log.write_text("(EngineCore pid=1) ERROR 12-06 07:58:10 [core.py:1233] AssertionError\n")
    since = log.stat().st_size
    with open(log, "a") as f:
        f.write("(EngineCore pid=2) ERROR 12-06 08:03:38 [core.py:1233] ConnectionError: Cannot reach the server\n")
    assert gate._log_errors(log, since).splitlines()[0] == "ConnectionError: Cannot reach the server"
    assert "AssertionError" not in gate._log_errors(log, since)
    assert gate._log_errors(log).splitlines()[0] == "ConnectionError: Cannot reach the server"
    with open(log, "a") as f:
        f.write("(APIServer pid=3) ERROR 12-06 08:05:00 [async_llm.py:704] EngineDeadError: died\n")
    assert "AssertionError" not in gate._log_errors(log, log.stat().st_size - 80)
    assert gate._log_errors(tmp_path / "none.log").startswith("(no log:")


def test_a_stateful_controls_restart_is_not_waited_for_against_a_server_that_has_exited(tmp_path, monkeypatch):
    """Nothing died, but a control's replica must be restarted while the connector's server is
    gone: no restart against it either (ServerExited, its own signature)."""
    from types import SimpleNamespace

    from kvgate.harness.conformance import gate
    from kvgate.harness.conformance.connectors import Service
    from kvgate.harness.conformance.scenarios import Scenario

    cluster = _StandIn(tmp_path, ["A", "B"])
    service = Service({}, proc=SimpleNamespace(poll=lambda: -11, returncode=-11))
    ctx = Ctx(cluster=cluster, corpus=None, profile=dataclasses.replace(CONNECTORS["kvpool"], reset=None), seed=0,
              service=service)
    monkeypatch.setattr(gate, "_casualties", lambda c: {})
    monkeypatch.setattr(gate.wrong_kv, "of_run", lambda ctx, t0, t1: None)
    with pytest.raises(gate.SystemLost) as lost:
        gate._run_body(ctx, Scenario("s", lambda ctx, control=None: ctx.restart.add("B"), (), "a stand-in"))
    assert isinstance(lost.value.cause, gate.ServerExited) and cluster.restarted == []
    cell, why = gate._lost_cell(lost.value, SCENARIOS["long_prompt"], service, "replay")
    assert why.startswith("ServerExited: a replica to restart, not restarted")
    assert cell["signature"] == ["the connector's server had exited", "the system did not come back (ServerExited)"]


def test_a_loss_under_a_control_keeps_the_scenarios_own_run(tmp_path, monkeypatch):
    """The scenario's own run passed and was counted; its control then lost the system: the
    cell keeps the own run's wrong-KV count and verdict, and the control run's checks apart."""
    from kvgate.harness.checkers.verdict import Checks
    from kvgate.harness.conformance import gate

    own = Checks()
    own.check("B installed at least 1 blocks", True, 9)
    runs = []

    def run_body(ctx, sc, **kw):  # noqa: ANN001, ANN003, ANN202
        runs.append(kw.get("control"))
        if kw.get("control"):
            raise gate.SystemLost({"B": "AssertionError"}, ClusterStartError("replica B exited with 1"),
                                  wrong_kv={"wrong": 3, "checked": 9}, checks="the control's run",
                                  control=kw["control"])
        ctx.wrong_kv = {"wrong": 0, "checked": 9}
        return own, None, {}

    monkeypatch.setattr(gate, "_run_body", run_body)
    sc = SCENARIOS["cross_replica_hit"]
    ctx = Ctx(cluster=_StandIn(tmp_path, ["A", "B"]), corpus=None, profile=CONNECTORS["kvpool"], seed=0)
    with pytest.raises(gate.SystemLost) as lost:
        run_cell(ctx, sc, root=7)
    assert runs == [None, sc.control] and lost.value.own["wrong_kv"] == {"wrong": 0, "checked": 9}
    cell, _ = gate._lost_cell(lost.value, sc, None, "replay")
    assert cell["wrong_kv"] == {"wrong": 0, "checked": 9}
    assert cell["evidence"]["control_checks"] == "the control's run" and "checks" not in cell["evidence"]
    assert cell["evidence"]["own_run"] == own.verdict(sc.describe).reason[:600]
    assert f"under the control {sc.control}" in cell["reason"]


def test_a_system_that_does_not_stop_at_the_end_fails_its_row_and_no_other(tmp_path, monkeypatch):
    def run_cell(ctx, sc, root):  # noqa: ANN001, ANN202
        return {"scenario": sc.name, "status": "pass", "reason": ""}

    row, _ = _lost_row(tmp_path, monkeypatch, run_cell, ["long_prompt"], stop_raises=True)
    assert row["cells"]["long_prompt"]["status"] == "pass" and "OrphanError" in row["stop_error"]
    passed, why = row_verdict(row)
    assert not passed and "did not stop cleanly" in why


def test_a_log_shorter_than_where_the_process_began_is_read_whole(tmp_path):
    from kvgate.harness.conformance import gate

    log = tmp_path / "replica-A.log"
    log.write_text("(EngineCore pid=2) ERROR 12-06 08:03:38 [core.py:1233] ValueError: bad\n")
    assert gate._log_errors(log, since=10_000).splitlines()[0] == "ValueError: bad"


def test_same_key_race_makes_every_replica_reconnect_after_its_control_restarted_the_pool(monkeypatch):
    """A control of same_key_race restarts the pool on a known-bad catalog and back. Each
    replica's next store after a restart meets a new segment, which a GPU replica drops: every
    replica reconnects on a request of its own before the next cell, which would otherwise lose
    its hit (the CUDA row's accounting and adapter cells did)."""
    from types import SimpleNamespace

    from kvgate.harness.checkers.verdict import Checks
    from kvgate.harness.conformance import race

    events = []
    store = SimpleNamespace(restart=lambda cluster, catalog: events.append(("restart", catalog)),
                            disarm=lambda cluster, r: events.append(("disarm", r)))
    ctx = SimpleNamespace(profile=SimpleNamespace(store=store), seed=7,
                          corpus=SimpleNamespace(text=lambda n, rng: f"{n} words"),
                          cluster=SimpleNamespace(replicas={"A": 0, "B": 0, "E": 0, "F": 0}),
                          run=lambda r, prompt, tag: events.append(("run", r, tag.rsplit("-", 2)[-2])))
    monkeypatch.setattr(race, "_race", lambda *a: events.append(("race",)) or Checks())
    race.same_key_race(ctx, control="visible_at_reserve")
    assert events[0] == ("restart", "visible_at_reserve") and events[-5] == ("restart", None), events
    assert [e for e in events[-4:]] == [("run", r, "reattach") for r in "ABEF"], events
    events.clear()
    race.same_key_race(ctx)  # the scenario itself restarts nothing: no reconnect either
    assert not any(e[0] in ("restart", "run") for e in events), events
