"""The gate: one command, one report, pass/fail per criterion.

`run_gate(seed, seeds, report_dir, profile)` prints the replay key first, runs the
pool criteria and then every scenario of the catalog (fixtures/scenarios; kvgate.harness.scenarios)
that the profile selects, for each derived seed, with progress on stderr; each scenario
run is judged by its own checks, the history checkers and its negative control. It
writes run.json, junit.xml and checklist.md under `report_dir` (with a table per fault
kind: seeds, faults fired, loads, silent corruptions, lost requests, misclassified
misses, controls caught), prints a summary and returns the exit status (non-zero if any
criterion did not pass). Every failing line carries the command that replays it.
"""

from __future__ import annotations

import json
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kvgate.harness.measure import measure
from kvgate.harness.plugin import derive_seed
from kvgate.harness.provenance import provenance
from kvgate.harness.system.default import start_system
from kvgate.harness.checkers.verdict import Verdict, all_of
from kvgate.harness.report.render import Criterion, GateRun, write_reports

_BAR: list = []  # the run's progress bar (tqdm), while one is shown


def _say(msg: str) -> None:
    """A line of the run's log on stderr, above the progress bar when there is one."""
    if _BAR:
        _BAR[0].write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def _progress_bar(total: int):  # noqa: ANN202
    """tqdm's bar of scenario runs with its ETA, on a terminal only (a log keeps the lines)."""
    from tqdm import tqdm

    _BAR.clear()  # a run that ended on an exception left its bar
    bar = tqdm(total=total, desc="kvgate gate", unit="run", file=sys.stderr, disable=not sys.stderr.isatty(),
               dynamic_ncols=True, leave=False)
    if not bar.disable:
        _BAR[:] = [bar]
    return bar


def _pool_criteria() -> list[tuple[str, Callable[[int], Verdict]]]:
    from kvgate.harness.scenarios import pool as pool_checks
    from kvgate.harness.system.pool import PoolProcess

    def exchange(seed: int) -> Verdict:
        out = Path(tempfile.mkdtemp(prefix="kvgate-exchange-"))
        pool = PoolProcess.start(page_size=pool_checks.EXCHANGE_PAGE, num_pages=64, run_dir=out)
        try:
            return pool_checks.exchange_between_processes(pool, seed, out)
        finally:
            pool.stop()
            pool.cleanup()

    def controls(seed: int) -> Verdict:
        return pool_checks.catalog_controls(seed)

    return [
        ("pool: two processes exchange byte-identical pages", exchange),
        ("pool: each miss cause reported as itself", pool_checks.miss_causes),
        ("pool: crash, restart clean, graceful stop frees memory", pool_checks.crash_and_restart),
        ("pool: daemon agrees with the reference model", lambda s: pool_checks.state_machine(s, 25, 30)),
        ("pool: each known-bad catalog caught by the behaviour it breaks", controls),
    ]


def select(profile: str, names: list[str] | None = None):  # noqa: ANN201
    """Scenarios of the catalog for a profile: 'all', 'hosts' (the multi-host system's), or
    comma-separated fault kinds ('none' for the fault-free scenarios), optionally only the
    named ones."""
    from kvgate.faults.schedule import KINDS
    from kvgate.harness.scenarios.catalog import load_catalog

    catalog = load_catalog()
    if names:
        unknown = sorted(set(names) - {sc.name for sc in catalog})
        if unknown:
            raise SystemExit(f"kvgate: no scenarios {unknown}; the catalog has {[sc.name for sc in catalog]}")
        catalog = [sc for sc in catalog if sc.name in names]
    if profile == "all":
        return catalog
    if profile == "hosts":  # everything the multi-host system runs (its fault-free scenario included)
        from kvgate.harness.scenarios.catalog import on_hosts

        return [sc for sc in catalog if on_hosts(sc)]
    kinds = set(profile.split(","))
    unknown = sorted(kinds - set(KINDS) - {"none"})
    if unknown:
        raise SystemExit(f"kvgate: unknown fault kinds {unknown}; known: {sorted(KINDS)} and 'none'")
    return [sc for sc in catalog if (sc.fault or "none") in kinds]


def run_gate(seed: int | None = None, seeds: int = 2, report_dir: Path = Path("reports/runs/latest"),
             profile: str = "all", scenarios: list[str] | None = None, pool_checks: bool = True) -> int:
    root = seed if seed is not None else secrets.randbits(32)
    chosen = select(profile, scenarios)
    prov = provenance()
    key = {"seed": root, "commit": prov["short"], "clean": prov["clean"], "profile": profile, "seeds": seeds}
    print(f"kvgate gate: replay key seed={root} commit={key['commit']}{'' if prov['clean'] else ' (DIRTY TREE)'} "
          f"profile={profile} seeds={seeds}", flush=True)
    _say("kvgate gate: a seed fixes the workload and every fault parameter; it cannot force thread "
         "interleavings, which the report notes where they matter")
    run = GateRun(replay_key=key)
    t_start = time.monotonic()
    # The replicas take minutes to start: start them while the pool criteria run.
    from kvgate.harness.system.cluster import install_sigterm_unwind

    install_sigterm_unwind()  # the cluster starts in a thread, where it cannot install it
    started: dict = {}

    from kvgate.harness.scenarios.catalog import on_hosts

    on_default = [sc for sc in chosen if not on_hosts(sc)]
    hosted = [sc for sc in chosen if on_hosts(sc)]

    def start() -> None:
        try:
            if on_default:
                started["system"] = start_system(report_dir, {r for sc in on_default for r in sc.replicas})
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
            started["error"] = exc

    starter = threading.Thread(target=start, name="kvgate-start-system")
    starter.start()
    try:
        if pool_checks:
            _run_criteria(run, _pool_criteria(), root, seeds, f"kvgate gate --seed {root} --seeds {seeds}")
    except BaseException:
        starter.join()
        if "system" in started:  # interrupted: leave nothing running
            started["system"][0].stop()
        raise
    starter.join()
    if "error" in started:
        raise started["error"]
    results: list = []
    measured: list[dict] = []
    total = sum(min(seeds, sc.seeds or seeds) for sc in chosen)
    progress = {"done": 0, "total": total, "bar": _progress_bar(total)}
    if on_default:
        cluster, model = started["system"]
        try:
            _run_scenarios(run, results, cluster, model, on_default, root, seeds, report_dir, progress)
        finally:
            cluster.stop()
            measured.append(measure(cluster.history_dir, "default"))  # before the next system's history replaces it
    from kvgate.harness.scenarios.catalog import store_of

    for store in sorted({store_of(sc) for sc in hosted}):  # the multi-host system, once the default one is gone
        from kvgate.harness.system.default import start_hosts_system

        system, model = start_hosts_system(report_dir, store)
        try:
            _run_scenarios(run, results, system, model, [sc for sc in hosted if store_of(sc) == store], root, seeds,
                           report_dir, progress)
        finally:
            system.stop()
            measured.append(measure(system.history_dir, f"hosts-{store}"))
    progress["bar"].close()
    _BAR.clear()
    kinds = per_kind(results)
    run.summary = {"wall_s": round(time.monotonic() - t_start, 1), "criteria": len(run.criteria),
                   "passed": sum(c.verdict.valid is True for c in run.criteria), "per_fault_kind": kinds,
                   "outcomes": dict(Counter(r.outcome for r in results))}
    paths = write_reports(report_dir, run)
    paths.update(write_measurements(report_dir, run, measured))
    print(f"kvgate gate: {'PASS' if run.passed else 'FAIL'} - {run.summary['passed']}/{len(run.criteria)} criteria "
          f"in {run.summary['wall_s']} s; checklist {paths['markdown']}")
    for c in run.criteria:
        print(f"  [{c.verdict.label:>7}] {c.name}" + ("" if c.verdict.valid else f"  replay: {c.replay}"))
    print(format_kinds(kinds))
    sessions = next((c for c in run.criteria if "off-on-on-off" in c.name), None)
    if sessions is not None:
        for part in sessions.verdict.evidence.get("parts", []):
            ttft = part["evidence"].get("parts", [{}])[0].get("evidence", {}).get("ttft_median_ms_cross_turns")
            print(f"  OFF-ON-ON-OFF median TTFT of turns 2-6 (ms): {ttft}")
    return 0 if run.passed else 1


def _run_scenarios(run: GateRun, results: list, cluster, model: Path, chosen: list, root: int,  # noqa: ANN001
                   seeds: int, report_dir: Path, progress: dict) -> None:
    from kvgate.harness.scenarios.catalog import replay_command
    from kvgate.harness.scenarios.runner import run_scenario
    from kvgate.harness.workload.prompts import Corpus

    corpus = Corpus(model)
    total = progress["total"]
    for sc in chosen:
        t0 = time.monotonic()
        per = []
        for i in range(min(seeds, sc.seeds or seeds)):
            s = derive_seed(root, f"{sc.name}#{i}")
            progress["done"] += 1
            progress["bar"].update(1)
            done = progress["done"]
            _say(f"[{done}/{total}] {sc.name} (seed {s}) ...")
            try:
                r = run_scenario(cluster, corpus, sc, s)
            except Exception as exc:  # noqa: BLE001 - a harness defect: reported as this scenario's failure
                r = harness_failure(sc, s, exc)
            ctl = "" if r.control is None else f"; control {r.control['name']}: " + (
                "caught" if r.control["caught"] else "NOT CAUGHT")
            _say(f"[{done}/{total}] {sc.name}: {r.verdict.label} ({r.outcome}) in {r.seconds:.0f} s{ctl}"
                 + ("" if r.verdict.valid else f" - {r.verdict.reason[:300]}\n    replay: {r.replay}"))
            per.append(r)
            results.append(r)
            if r.verdict.valid is not True:
                path = write_schedule(report_dir, sc.name, s)
                _say(f"    its fault schedule: {path} (kvgate replay {sc.name} --schedule {path})")
        n_seeds = f"{len(per)} seed" + ("s" if len(per) != 1 else "")
        verdict = all_of([r.verdict for r in per], n_seeds)
        if verdict.valid is True:
            verdict = Verdict(True, f"{n_seeds}: {per[0].verdict.reason}", verdict.evidence, verdict.not_checked)
        failing = next((r for r in per if r.verdict.valid is not True), per[0])
        run.criteria.append(Criterion(f"{sc.name}: {sc.description.split(':')[0].split('.')[0]}", verdict,
                                      replay_command(sc.name, failing.seed), time.monotonic() - t0))


def write_measurements(report_dir: Path, run: GateRun, measured: list[dict]) -> dict[str, Path]:
    """measurements.json (kvgate.harness.measure: each request's TTFT by hit kind, misses and faults
    over time, per system) and the run's HTML report (kvgate.harness.report.html), next to run.json."""
    from kvgate.harness.report.html import gate_report

    path = report_dir / "measurements.json"
    doc = {"replay_key": run.replay_key, "provenance": provenance(), "systems": measured}
    path.write_text(json.dumps(doc, indent=None, separators=(",", ":")))
    html = report_dir / "report.html"
    html.write_text(gate_report(run, doc))
    return {"measurements": path, "html": html}


def write_schedule(report_dir: Path, scenario: str, seed: int) -> Path:
    """A failing run's fault schedule (kvgate.faults.schedule: every site, its drawn parameters
    and heal step), next to the report; `kvgate replay SCENARIO --schedule FILE` replays it."""
    from kvgate.faults.schedule import draw_schedule

    path = Path(report_dir) / "schedules" / f"{scenario}-{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(draw_schedule(seed).to_json())
    path.write_text(json.dumps({"scenario": scenario, **doc}, indent=1, sort_keys=True))
    return path


def harness_failure(sc, seed: int, exc: BaseException):  # noqa: ANN001, ANN201
    """A scenario that raised instead of returning a verdict: a failed criterion that
    carries the traceback (the gate goes on with the next one)."""
    import traceback

    from kvgate.harness.scenarios.catalog import replay_command
    from kvgate.harness.scenarios.runner import ScenarioResult

    text = "".join(traceback.format_exception(exc))[-1500:]
    return ScenarioResult(sc.name, sc.fault, seed, Verdict(False, f"harness error {type(exc).__name__}: {exc}",
                                                           {"traceback": text}),
                          "crash", {c: 0 for c in COUNTS}, None, replay_command(sc.name, seed), 0.0)


COUNTS = ("faults_fired", "loads", "silent_corruptions", "lost_requests", "misclassified", "outputs_differ")


def per_kind(results) -> dict[str, dict]:  # noqa: ANN001
    out: dict[str, dict] = {}
    for r in results:
        k = out.setdefault(r.fault or "none", {"scenarios": set(), "seeds_run": 0, **{c: 0 for c in COUNTS},
                                              "controls": 0, "controls_caught": 0, "controls_inconclusive": 0,
                                              "caught_by": set()})
        k["scenarios"].add(r.scenario)
        k["seeds_run"] += 1
        for c in COUNTS:
            k[c] += r.counts[c]
        if r.control is not None:
            k["controls"] += 1
            k["controls_caught"] += bool(r.control["caught"])
            k["controls_inconclusive"] += bool(r.control.get("inconclusive"))
            if r.control["caught"]:
                k["caught_by"].add(f"{r.control['name']}: {r.control['oracle']}")
    for k in out.values():
        k["scenarios"] = sorted(k["scenarios"])
        k["caught_by"] = sorted(k["caught_by"])
    return out


def format_kinds(kinds: dict[str, dict]) -> str:
    head = f"  {'fault kind':<18} {'seeds':>5} {'fired':>5} {'loads':>5} {'silent':>6} {'lost':>4} {'miscl':>5} {'out≠':>4} controls"
    lines = [head]
    for name, k in sorted(kinds.items()):
        ctl = (f"{k['controls_caught']}/{k['controls']} caught ({'; '.join(k['caught_by'])})"
               + (f", {k['controls_inconclusive']} inconclusive" if k["controls_inconclusive"] else "")
               if k["controls"] else "-")
        lines.append(f"  {name:<18} {k['seeds_run']:>5} {k['faults_fired']:>5} {k['loads']:>5} "
                     f"{k['silent_corruptions']:>6} {k['lost_requests']:>4} {k['misclassified']:>5} {k['outputs_differ']:>4} {ctl}")
    return "\n".join(lines)


def _run_criteria(run: GateRun, criteria, root: int, seeds: int, replay: str) -> None:  # noqa: ANN001
    total = len(criteria) * seeds
    done = 0
    for name, check in criteria:
        verdicts = []
        t0 = time.monotonic()
        for i in range(seeds):
            s = derive_seed(root, f"{name}#{i}")
            done += 1
            _say(f"[pool {done}/{total}] {name} (seed {s}) ...")
            v = check(s)
            _say(f"[pool {done}/{total}] {name}: {v.label} - {v.reason}")
            verdicts.append(v)
        run.criteria.append(Criterion(name, all_of(verdicts, f"{seeds} seeds"), replay, time.monotonic() - t0))
