"""`kvgate gate --connector NAME` and `kvgate conformance`: the connector-agnostic
scenarios (kvgate.harness.conformance.scenarios) against one V1 connector, or a matrix of them.

  run_connector(name, extra, seed, report_dir, scenarios) -> dict
      first checks that the connector can run here (it imports; the hardware it needs is
      present): where it cannot, every cell is "not run" with that reason (the import
      error) and nothing is started. Else it starts a pool (kvpool's rows use it; the
      others ignore it) and replicas A (policy fail), B (recompute) and, where a scenario
      needs them, C (revision r2 of the tiny model), D (a small KV cache), E and F (LoRA
      adapters loaded at run time) with the connector wrapped by
      kvgate.faults.connector and kvpool.connector.audit; runs every scenario (n/a where the connector
      declares it lacks what the scenario needs); a replica that died is restarted before
      the next scenario, and its death is the failing cell's evidence.
  row_verdict(row) -> (passed, reason)      the gate's verdict on one connector's row
  write_matrix(rows, out_dir, root, judgement) -> paths
                                            matrix.json, matrix.md and matrix.html (the
                                            correctness table: kvgate.harness.report.conformance)

A cell is "n/a" only where the connector itself declares it lacks a capability the
scenario needs (its reason is the connector's); it is "not run" where kvgate could not run
it (the connector does not import, needs hardware this machine lacks, or the scenario has
no body yet). The rule of `kvgate gate --connector X`: X passes only when no cell failed,
no cell is "not run", and at least one cell passed; so a connector that is not there, or
a matrix whose every cell is n/a or not run, fails (exit 1, the reason printed). Not run
is never a pass. A failing cell is a finding about that connector: its reason, its
evidence, its signature (kvgate.harness.conformance.baseline.signature_of: what failed,
without numbers), the versions and the command that replays it. Every cell that ran also
carries its wrong-KV count (kvgate.harness.conformance.wrong_kv: blocks installed whose
bytes no replica with the consumer's weights computed), and so does each control run.
`kvgate conformance` writes the whole matrix and judges it against the known-red baseline
(kvgate.harness.conformance.baseline): it fails on a new red cell, a known one failing
differently, and a cell not run.
"""

from __future__ import annotations

import json
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvgate.harness.checkers.verdict import Checks
from kvgate.harness.client.http import RequestFailed
from kvgate.harness.conformance import wrong_kv
from kvgate.harness.conformance.baseline import byte_oracle, signature_of
from kvgate.harness.conformance.connectors import ConnectorUnavailable, Profile, profile
from kvgate.harness.conformance.scenarios import SCENARIOS, Ctx, Scenario, ScenarioDown
from kvgate.harness.plugin import derive_seed
from kvgate.harness.provenance import provenance
from kvgate.harness.system.procs import tail

STATUSES = ("pass", "fail", "n/a", "not run")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def replay(name: str, scenario: str, seed: int, given: str = "") -> str:
    """The command that replays one cell (`given`: the connector config the row ran with, JSON)."""
    config = f" --connector-config '{given}'" if given else ""
    return f"kvgate gate --connector {name}{config} --scenario {scenario} --seed {seed}"


def detect_device() -> str:
    """"cuda" where torch sees a GPU (the replicas then run vLLM's CUDA build), else "cpu"."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _specs(prof: Profile, report_dir: Path, replicas: set[str], service_settings: dict,  # noqa: ANN202
           device: str = "cpu"):
    from kvgate.fixtures.tiny_model import build_tiny_model
    from kvgate.harness.system.cluster import DEFAULT_CHUNK, SMALL_KV_BLOCKS, ReplicaSpec
    from kvgate.harness.system.gpu import gpu_args

    # On CUDA: vLLM's GPU flags (TRITON_ATTN) with the CPU system's 128-token blocks, so
    # every scenario's block arithmetic holds on both devices.
    args = gpu_args(0.08, block_size=128) if device == "cuda" else ()

    settings = tuple({**prof.settings(report_dir), **service_settings}.items())
    inner = "" if prof.name == "kvpool" else prof.inner
    specs = []
    from kvgate.harness.conformance.lifecycle import LORA_ARGS, LORA_ENV

    for name, core, policy in (("A", "0", "fail"), ("B", "1", "recompute"), ("C", "0", "recompute"),
                               ("D", "1", "recompute"), ("E", "0", "recompute"), ("F", "1", "recompute")):
        if name not in replicas:
            continue
        # E and F: LoRA adapters loaded at run time (the adapter scenario)
        lora = name in ("E", "F")
        model = build_tiny_model(report_dir / "model" / "tiny-r2", seed=0, revision="r2") if name == "C" else None
        small = {"kv_bytes": SMALL_KV_BLOCKS * 128 * 1024, "max_model_len": (SMALL_KV_BLOCKS - 1) * 128} \
            if name == "D" else {}  # D: a KV cache of 64 blocks (the preemption scenario)
        specs.append(ReplicaSpec(name, core=core, policy=policy, audit=True, model_dir=model, **small,
                                 max_num_batched_tokens=DEFAULT_CHUNK, inner=inner, inner_extra=settings,
                                 connector_extra=() if inner else settings,  # kvpool's own settings
                                 faults_file=str(report_dir / f"faults-{name}.json"), python=prof.python,
                                 extra_env=prof.env + (LORA_ENV if lora else ()),
                                 extra_args=args + (LORA_ARGS if lora else ())))
    return specs


# an exception with its message, or one alone as the log line's whole message (a bare assert)
_CAUSE = re.compile(r"\b\w+(Error|Exception): |\]\s+(?:[\w.]+\.)?\w+(?:Error|Exception)\s*$")
_NOT_ROOT = ("EngineDeadError", "Worker failed with error", "WARNING")


def _log_errors(path: Path, since: int = 0) -> str:
    """The root cause of the log's last crash (its last `SomeError: ...` line that is not
    the engine reporting its own death) first, then its last error lines; `since`: the byte
    where the process's own part of the log begins (an earlier run's crash is not its cause)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(since if since <= size else 0, size - 4_000_000))  # a log shorter than since: replaced
            text = f.read().decode(errors="replace")
    except OSError as exc:
        text = f"(no log: {exc})"
    errors = [ln for ln in text.splitlines() if " ERROR " in ln]
    causes = [ln for ln in errors if _CAUSE.search(ln) and not any(w in ln for w in _NOT_ROOT)]
    head = [causes[-1][causes[-1].find("]") + 1:].strip()] if causes else []
    return "\n".join(head + errors[-6:]) or text[-1500:]


def _casualties(cluster) -> dict[str, str]:  # noqa: ANN001
    """Replicas that died or stopped answering (each given up to 20 s: a server whose
    engine died shuts down by itself), with the last errors of their logs."""
    from kvgate.harness.client.http import healthy

    out = {}
    for name, r in cluster.replicas.items():
        if r.proc.poll() is None and healthy(r.url):
            continue
        deadline = time.monotonic() + 20
        while r.proc.poll() is None and not healthy(r.url) and time.monotonic() < deadline:
            time.sleep(0.5)
        if r.proc.poll() is None and healthy(r.url):
            continue
        out[name] = _log_errors(r.log_path, r.log_from)
    return out


# how many times a connector's row starts the whole system afresh after losing it (each loss
# can cost a connector's own connect timeout, 300 s for LMCache's): the cells after the last
# loss past these are not run
FRESH_STARTS = 3


class SystemLost(RuntimeError):
    """Replicas that went down under a cell did not come back when restarted: `down` is
    what their logs said when they died, `cause` the restart's error (or why none was
    tried: the connector's server had exited); the run's wrong-KV count, what it could not
    finish and its checks' verdict, and the control it ran under, if any, come with it."""

    def __init__(self, down: dict[str, str], cause: BaseException, *, wrong_kv: dict | None = None,
                 during: str | None = None, checks: str | None = None, control: str | None = None):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.down, self.cause = down, cause
        self.wrong_kv, self.during, self.checks, self.control = wrong_kv, during, checks, control
        self.own: dict[str, Any] | None = None  # under a control: the scenario's own run (run_cell sets it)


class ServerExited(RuntimeError):
    """The connector's server had exited: replicas restarted against it cannot start."""


def _lacks(prof: Profile, sc: Scenario) -> str | None:
    """The connector's reason a scenario does not apply to it (its first need it lacks), or None."""
    return next((why for why in (prof.needs(n) for n in sc.needs) if why), None)


def _runs(prof: Profile, sc: Scenario) -> bool:
    """The scenario is in the catalog and applies to the connector: it needs a live system."""
    return sc.body is not None and _lacks(prof, sc) is None


def _heal(cluster, names) -> list[str]:  # noqa: ANN001
    """Restart the given replicas (all killed first where the process is still there, in the
    order given, then started together)."""
    for name in names:
        if cluster.replicas[name].proc.poll() is None:
            cluster.kill_replica(name)
    cluster.restart_replicas(list(names))
    return list(names)


def _run_body(ctx: Ctx, sc: Scenario, **kw: Any) -> tuple[Checks | None, str | None, dict]:
    """(checks, why it could not finish, the replicas that went down, with their logs'
    last errors); the replicas that went down are restarted before it returns."""
    ctx.cluster.reset()
    if ctx.profile.reset is not None:
        ctx.profile.reset(ctx.cluster.report_dir)
    ctx.t0 = time.time()
    ctx.armed, ctx.restart = set(), set()
    ctx.reloaded = {}
    checks, broke = None, None
    try:
        checks = sc.body(ctx, **kw)
    except ScenarioDown as exc:
        broke = f"the system went down: {exc}"
    except (RequestFailed, AssertionError, OSError) as exc:
        broke = f"{type(exc).__name__}: {str(exc)[:400]}"
    ctx.wrong_kv = wrong_kv.of_run(ctx, ctx.t0, time.time())
    down = _casualties(ctx.cluster)
    # Every armed replica is disarmed. Those a control with state of its own was armed on are
    # restarted, first: one left busy by the control (a connector whose held stores keep its
    # engine stepping) must not starve the restart of the others. The rest go on as they are:
    # their controls keep nothing past a disarm (kvgate.faults.connector_controls), and the
    # cluster's reset before the next run (their prefix caches; refused while a block is held)
    # drops what the engine computed under them.
    heal = [*sorted(ctx.restart - set(down)), *down]
    for name in ctx.armed | ctx.restart:  # they come back disarmed
        ctx.cluster.faults[name].write_text("{}")
    if heal:
        from kvgate.harness.system.cluster import ClusterStartError

        lost = {"wrong_kv": ctx.wrong_kv, "during": broke, "control": kw.get("control"),
                "checks": checks.verdict(sc.describe).reason[:600] if checks is not None else None}
        service = ctx.service
        if service is not None and service.proc is not None and service.proc.poll() is not None:
            # no restart against a server that is gone: it would wait out the connector's own timeout
            raise SystemLost(down, ServerExited(f"the connector's server had exited with {service.proc.returncode}"),
                             **lost)
        try:
            _heal(ctx.cluster, heal)
        except ClusterStartError as exc:
            raise SystemLost(down, exc, **lost) from exc
    ctx.healed = {"restarted": heal, "disarmed": sorted(ctx.armed - set(heal))}
    return checks, broke, down


def run_cell(ctx: Ctx, sc: Scenario, root: int) -> dict[str, Any]:
    name = ctx.profile.name
    seed = derive_seed(root, f"conformance:{sc.name}")
    cell: dict[str, Any] = {"scenario": sc.name, "describe": sc.describe, "seed": seed,
                            "replay": replay(name, sc.name, root, ctx.profile.given)}
    na = _lacks(ctx.profile, sc)
    if na:
        return {**cell, "status": "n/a", "reason": na}
    if sc.body is None:
        return {**cell, "status": "not run", "reason": sc.not_run}
    t0 = time.monotonic()
    ctx.seed = seed
    ctx.wrong_kv = None
    checks, broke, down = _run_body(ctx, sc)
    cell["wrong_kv"] = ctx.wrong_kv
    if down:  # a replica died under the scenario: that is the finding, whatever else was judged
        first = {name: (text.splitlines() or [""])[0][-300:] for name, text in down.items()}
        cell = {**cell, "status": "fail", "reason": f"replica {', '.join(down)} died: {first}",
                "evidence": {"replica_logs": down, "restarted": sorted(down), "during": broke,
                             **({"checks": checks.verdict(sc.describe).reason[:600]} if checks else {})},
                "seconds": round(time.monotonic() - t0, 1)}
        return {**cell, "signature": signature_of(cell, down=down)}
    if checks is None:  # it could not finish (a request failed or hung): what the replicas logged
        errors = {r.spec.name: _log_errors(r.log_path, r.log_from) for r in ctx.cluster.replicas.values()}
        cell = {**cell, "status": "fail", "reason": broke, "seconds": round(time.monotonic() - t0, 1),
                "evidence": {"replica_errors": {k: v for k, v in errors.items() if " ERROR " in v}}}
        return {**cell, "signature": signature_of(cell)}
    v = checks.verdict(sc.describe)
    cell.update(status="pass" if v.valid else "fail", reason=v.reason[:600], evidence=v.evidence)
    try:
        if v.valid and sc.control:
            cell["control"] = control = _run_control(ctx, sc, seed, sc.control, sc.control_oracle)
            if not control["caught"]:
                cell.update(status="fail", reason=f"negative control {sc.control} not caught: {control['why']}")
        # More controls, each where the connector has what it needs (its reason kept where not)
        more = [(name, oracle, ctx.profile.needs(need) if need else None) for name, oracle, need in sc.more_controls]
        if v.valid and more:
            cell["controls"] = [cell["control"]] if "control" in cell else []
            for name, oracle, na in more:
                if na:
                    cell["controls"].append({"name": name, "oracle": oracle, "caught": None, "why": f"n/a: {na}"})
                    continue
                control = _run_control(ctx, sc, seed, name, oracle)
                cell["controls"].append(control)
                if not control["caught"] and cell["status"] == "pass":
                    cell.update(status="fail", reason=f"negative control {name} not caught: {control['why']}")
    except SystemLost as lost:  # under a control: what the scenario's own run judged goes with it
        lost.own = {"wrong_kv": cell.get("wrong_kv"), "reason": cell.get("reason"),
                    "controls": cell.get("controls") or ([cell["control"]] if cell.get("control") else [])}
        raise
    cell["seconds"] = round(time.monotonic() - t0, 1)
    cell = byte_oracle(cell)
    cell["signature"] = signature_of(cell, checks=checks)
    return cell


def _run_control(ctx: Ctx, sc: Scenario, seed: int, name: str, oracle: str) -> dict[str, Any]:
    """Run the scenario under a negative control: caught only when `oracle` (the output
    oracle, or the scenario's checks named so) judged the run false; a run that could not
    finish is inconclusive, never caught."""
    ctx.seed = derive_seed(seed, f"control:{name}")
    ctx.wrong_kv = None
    cchecks, cbroke, cdown = _run_body(ctx, sc, control=name)
    if cchecks is None or (cdown and not sc.control_down_judged):
        control = {"name": name, "caught": False,
                   "why": f"INCONCLUSIVE (the control run proves nothing): {cbroke or 'a replica died'}",
                   "replica_logs": cdown}
    else:
        failed = (cchecks.output_failed if oracle == "output"
                  else [f for f in cchecks.failed if f.startswith(oracle)])
        control = {"name": name, "oracle": oracle, "caught": bool(failed),
                   "why": (failed[0] if failed else f"the {oracle} judgement passed under the control")[:300]}
        if cdown:  # the scenario declares it (control_down_judged): the oracle judged the run
            control["replica_down"] = {r: (text.splitlines() or [""])[0][-300:] for r, text in cdown.items()}
    control["wrong_kv"] = ctx.wrong_kv
    control["after"] = ctx.healed  # the replicas restarted after it, and those only disarmed
    ctx.cluster.reset()
    return control


def run_connector(name: str, extra: dict[str, Any] | None, seed: int, report_dir: Path,
                  scenarios: list[str] | None = None, device: str | None = None,
                  request_timeout_s: float = 600.0) -> dict[str, Any]:
    from kvgate.harness.system.cluster import Cluster, ClusterStartError, install_sigterm_unwind
    from kvgate.harness.workload.prompts import Corpus

    prof = profile(name, extra)
    device = device or detect_device()
    chosen = [SCENARIOS[s] for s in (scenarios or list(SCENARIOS))]
    row: dict[str, Any] = {"connector": prof.name, "class": prof.inner, "describe": prof.describe,
                           "versions": prof.versions(), "device": device, "seed": seed, "cells": {}}
    try:  # before anything is built or started: a connector that is not there runs nothing
        prof.check_available()
    except ConnectorUnavailable as exc:
        row["unavailable"] = str(exc)
        for sc in chosen:
            row["cells"][sc.name] = {"scenario": sc.name, "describe": sc.describe, "status": "not run",
                                     "reason": f"the connector cannot run here: {exc}",
                                     "replay": replay(prof.name, sc.name, seed, prof.given)}
        _say(f"kvgate gate --connector {prof.name}: not run: {exc}")
        return row
    runnable = [sc for sc in chosen if _runs(prof, sc)]
    replicas = {r for sc in runnable for r in sc.replicas}
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    model = None

    def start_system(where: Path):  # noqa: ANN202
        """The connector's server (where it has one), then the pool and the replicas."""
        svc = clu = None
        where.mkdir(parents=True, exist_ok=True)  # a fresh start's folder is new: the server's log goes in it
        try:
            if prof.service is not None:
                _say(f"kvgate gate --connector {prof.name}: starting its server ...")
                svc = prof.service(where)
            clu = Cluster(model, where, page_size=128 * 1024, pool_pages=1024)
            _say(f"kvgate gate --connector {prof.name}: starting a pool and replicas {sorted(replicas)} ...")
            clu.start(_specs(prof, where, replicas, svc.settings if svc else {}, device))
        except BaseException:
            _stop_system(clu, svc)
            raise
        return svc, clu

    cluster = service = None
    try:
        if replicas:
            from kvgate.fixtures.tiny_model import build_tiny_model

            install_sigterm_unwind()
            model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
            service, cluster = start_system(report_dir)
        corpus = Corpus(cluster.model_dir) if cluster is not None else None
        ctx = Ctx(cluster, corpus, prof, seed, timeout_s=request_timeout_s, service=service)

        def leave_rest(after: int, why: str) -> None:
            """The cells after `after` without a system: n/a where the connector lacks what they
            need (that needs none), else not run, with why."""
            for later in chosen[after:]:
                na = _lacks(prof, later)
                row["cells"][later.name] = {
                    "scenario": later.name, "describe": later.describe, "status": "n/a" if na else "not run",
                    "reason": na or why, "replay": replay(prof.name, later.name, seed, prof.given)}
            (report_dir / "row.json").write_text(json.dumps(row, indent=1, default=str))

        for i, sc in enumerate(chosen, 1):
            t0 = time.monotonic()
            lost = None  # why the system must be started afresh before the next cell
            try:
                cell = run_cell(ctx, sc, seed)
            except (SystemLost, ClusterStartError) as exc:  # what went down under the cell did not come back
                cell, lost = _lost_cell(exc, sc, service, replay(prof.name, sc.name, seed, prof.given))
            except Exception as exc:  # noqa: BLE001 - a harness defect: this cell's failure, with its traceback
                cell = {"scenario": sc.name, "describe": sc.describe, "status": "fail",
                        "reason": f"harness error {type(exc).__name__}: {exc}",
                        "evidence": {"traceback": "".join(traceback.format_exception(exc))[-1500:]},
                        "replay": replay(prof.name, sc.name, seed, prof.given)}
                cell["signature"] = signature_of(cell)
            row["cells"][sc.name] = cell
            (report_dir / "row.json").write_text(json.dumps(row, indent=1, default=str))  # so far
            ctls = cell.get("controls") or ([cell["control"]] if cell.get("control") else [])
            _say(f"[{prof.name} {i}/{len(chosen)}] {sc.name}: {cell['status']}"
                 + (f" ({cell['reason'][:240]})" if cell["status"] != "pass" else "")
                 + "".join(f"; control {c['name']}: "
                           + {True: "caught", False: "NOT CAUGHT", None: "n/a"}[c["caught"]] for c in ctls)
                 + f" in {time.monotonic() - t0:.0f} s")
            if lost is None:
                continue
            if not any(_runs(prof, c) for c in chosen[i:]):
                leave_rest(i, f"the system was lost in {sc.name}")
                break
            if len(row.get("restarts", [])) >= FRESH_STARTS:  # a connector that loses every system
                leave_rest(i, f"the system was lost {FRESH_STARTS + 1} times, the last in {sc.name}: no fresh start "
                              f"after {FRESH_STARTS}")
                _say(f"kvgate gate --connector {prof.name}: the system was lost {FRESH_STARTS + 1} times; the "
                     f"cells left are not run")
                break
            # The cells after it run on a fresh system (the connector's server too: one that
            # stopped answering is what kept the replica from coming back), in a folder of its
            # own, so the logs of the one that was lost stay where they are.
            restart = {"after": sc.name, "why": lost[:600], "dir": f"restart-{len(row.get('restarts', [])) + 1}"}
            row.setdefault("restarts", []).append(restart)
            _say(f"kvgate gate --connector {prof.name}: starting the system afresh in {restart['dir']} "
                 f"after {sc.name} ...")
            try:
                _stop_system(cluster, service)
            except Exception as exc:  # noqa: BLE001 - no fresh system beside what the lost one left running
                restart["stop_error"] = f"{type(exc).__name__}: {exc}"[:600]
                cluster = service = None
                leave_rest(i, f"the system lost in {sc.name} did not stop cleanly ({restart['stop_error'][:300]}): "
                              f"a fresh one beside what it left would be judged on it")
                _say(f"kvgate gate --connector {prof.name}: the lost system did not stop cleanly: {exc}")
                break
            cluster = service = None
            try:
                service, cluster = start_system(report_dir / restart["dir"])
            except Exception as exc:  # noqa: BLE001 - the cells left are not run, with this reason
                restart["start_error"] = f"{type(exc).__name__}: {exc}"[:1500]
                leave_rest(i, f"the system could not be started afresh after {sc.name}: "
                              f"{type(exc).__name__}: {str(exc)[:300]}")
                _say(f"kvgate gate --connector {prof.name}: the system did not start afresh: {exc}")
                break
            ctx.cluster, ctx.service = cluster, service
    finally:
        try:
            _stop_system(cluster, service)
        except Exception as exc:  # noqa: BLE001 - this row records it and fails; the other rows run
            row["stop_error"] = f"{type(exc).__name__}: {exc}"[:600]
            _say(f"kvgate gate --connector {prof.name}: the system did not stop cleanly: {exc}")
    return row


def _lost_cell(exc: BaseException, sc: Scenario, service,  # noqa: ANN001
               replay_cmd: str) -> tuple[dict[str, Any], str]:
    """The cell whose system was lost (SystemLost: its dead replicas did not come back; a bare
    ClusterStartError: a restart of the scenario's own failed), with what the run judged before
    the loss, and why the system must be started afresh."""
    down = getattr(exc, "down", {})
    cause = getattr(exc, "cause", exc)
    exited = service.proc.poll() if service is not None and service.proc is not None else None
    control = getattr(exc, "control", None)
    who = f"replica {', '.join(down)} died" if down else "a replica to restart"
    under = f" under the control {control}" if control else ""
    if isinstance(cause, ServerExited):
        lost = f"ServerExited: {who}{under}, not restarted: {cause}"
    else:
        lost = (f"ClusterStartError: {who}{under} and did not come back"
                + (f" (the connector's server had exited with {exited})" if exited is not None else "") + f": {cause}")
    cell = {"scenario": sc.name, "describe": sc.describe, "status": "fail", "reason": lost[:600],
            "evidence": {"replica_logs": down, "start_error": str(cause)[-1500:], "service_exit": exited,
                         **({"during": exc.during} if getattr(exc, "during", None) else {}),
                         **({"checks": exc.checks} if getattr(exc, "checks", None) else {}),
                         **({"service_log": tail(service.log, 3000)} if service is not None and service.log else {})},
            "replay": replay_cmd}
    own = getattr(exc, "own", None)  # a loss under a control: the scenario's own run, judged before it
    if control is None:  # the scenario's own run: its wrong-KV count stands (a control's is its own)
        cell["wrong_kv"] = getattr(exc, "wrong_kv", None)
    elif own is not None:
        cell["wrong_kv"] = own.get("wrong_kv")
        cell["evidence"]["control_checks"] = cell["evidence"].pop("checks", None)
        cell["evidence"].update(own_run=own.get("reason"), controls_before=own.get("controls"))
    kind = "ServerExited" if isinstance(cause, ServerExited) else "ClusterStartError"
    cell["signature"] = sorted(set(signature_of(cell, down=down) if down else [])
                               | {f"the system did not come back ({kind})"}
                               | ({"the connector's server had exited"} if exited is not None else set()))
    return cell, lost


def _stop_system(cluster, service) -> None:  # noqa: ANN001
    """Stop the replicas and the pool, then the connector's server (whatever of them is there)."""
    try:
        if cluster is not None:
            cluster.stop()
    finally:
        if service is not None:
            service.stop()


def row_verdict(row: dict[str, Any]) -> tuple[bool, str]:
    """The gate's verdict on one connector's row: passed only when no cell failed, no cell
    is "not run", and at least one cell passed (n/a cells, which the connector declares
    inapplicable, neither pass nor fail it, but a row of nothing else judged nothing)."""
    cells = list(row["cells"].values())
    by = {status: [c for c in cells if c["status"] == status] for status in STATUSES}
    unknown = [c for c in cells if c["status"] not in STATUSES]
    if row.get("unavailable"):
        return False, f"not run: {row['unavailable']}"
    if row.get("stop_error"):
        return False, f"the system did not stop cleanly: {row['stop_error']}"
    if by["fail"] or by["not run"] or unknown:
        parts = [f"{len(by['fail'])} failing cells"] if by["fail"] else []
        parts += [f"{len(by['not run'])} cells not run ({by['not run'][0]['reason']})"] if by["not run"] else []
        parts += [f"{len(unknown)} cells of unknown status"] if unknown else []
        return False, "; ".join(parts)
    if not by["pass"]:
        return False, (f"nothing was judged: all {len(cells)} cells n/a" if cells else "no scenario was chosen")
    return True, f"{len(by['pass'])} cells passed" + (f", {len(by['n/a'])} n/a" if by["n/a"] else "")


def write_matrix(rows: list[dict[str, Any]], out_dir: Path, root: int, judgement: dict[str, Any] | None = None,
                 provenance_of: dict[str, Any] | None = None,
                 sources: list[dict[str, Any]] | None = None) -> dict[str, Path]:
    """matrix.json, matrix.md and matrix.html (kvgate.harness.report.conformance) under
    `out_dir`. `judgement`: the baseline's (kvgate.harness.conformance.baseline.judge);
    `provenance_of` and `sources`: where the rows were read from earlier runs (cmd
    `kvgate conformance --from`), their tree and each run's; else the tree when this run
    started, and a tree that changed under the run is said so."""
    from kvgate.harness.report.conformance import html_page, markdown

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if provenance_of is not None:
        doc = {"provenance": provenance_of, "seed": root, "sources": sources or []}
    else:
        # provenance() is the tree when the run started (cached at its first call, the replay key)
        start, now = provenance(), provenance.__wrapped__()
        doc = {"provenance": start, "seed": root}
        if (now["commit"], now["clean"]) != (start["commit"], start["clean"]):
            doc["provenance_at_end"] = now
            # not clean, and why: the paths dirty at either end, and a commit made during the run
            why = sorted(set(start["dirty"]) | set(now["dirty"]))[:20]
            if now["commit"] != start["commit"]:
                why.append(f"(commit {start['commit'][:12]} became {now['commit'][:12]} during the run)")
            doc["provenance"] = {**start, "clean": False, "dirty": why}
    doc.update(scenarios={s.name: s.describe for s in SCENARIOS.values()}, rows=rows)
    if judgement is not None:
        doc["judgement"] = judgement
    paths = {"json": out_dir / "matrix.json", "markdown": out_dir / "matrix.md", "html": out_dir / "matrix.html"}
    paths["json"].write_text(json.dumps(doc, indent=1, default=str))
    paths["markdown"].write_text(markdown(doc))
    paths["html"].write_text(html_page(doc))
    return paths
