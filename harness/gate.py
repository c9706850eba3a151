"""The gate: one command, one report, pass/fail per criterion.

`run_gate(seed, seeds, report_dir)` prints the replay key first, runs every criterion
for each derived seed with progress on stderr, writes run.json, junit.xml and
checklist.md under `report_dir`, prints a short summary and returns the exit status
(non-zero if any criterion did not pass). Every criterion line carries the command
that replays it.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness.plugin import derive_seed
from reports.render import Criterion, GateRun, Verdict, all_of, write_reports

PROFILE = "pool+live"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pool_criteria() -> list[tuple[str, Callable[[int], Verdict]]]:
    from harness import pool_checks
    from harness.pool_proc import PoolProcess

    def exchange(seed: int) -> Verdict:
        out = Path(tempfile.mkdtemp(prefix="kvgate-exchange-"))
        pool = PoolProcess.start(page_size=pool_checks.EXCHANGE_PAGE, num_pages=64, run_dir=out)
        try:
            return pool_checks.exchange_between_processes(pool, seed, out)
        finally:
            pool.stop()
            pool.cleanup()

    def controls(seed: int) -> Verdict:
        from faults.controls import CATALOG_CONTROLS

        caught = {}
        for name, cls in CATALOG_CONTROLS.items():
            v = pool_checks.state_machine(seed, examples=400, steps=50, catalog_factory=cls, shrink=False)
            caught[name] = v.valid is False
        missed = [n for n, ok in caught.items() if not ok]
        return Verdict(not missed, "every negative control was caught" if not missed
                       else f"controls not caught: {missed}", {"caught": caught})

    return [
        ("pool: two processes exchange byte-identical pages", exchange),
        ("pool: each miss cause reported as itself", pool_checks.miss_causes),
        ("pool: crash, restart clean, graceful stop frees memory", pool_checks.crash_and_restart),
        ("pool: daemon agrees with the reference model", lambda s: pool_checks.state_machine(s, 25, 30)),
        ("pool: negative controls are caught", controls),
    ]


def _live_criteria(cluster, corpus) -> list[tuple[str, Callable[[int], Verdict]]]:  # noqa: ANN001
    from harness import live_scenarios as S
    from harness.workload import RequestFailed
    from kvpool.errors import PoolError

    def fresh(fn):  # noqa: ANN001, ANN202 - every live check starts from empty caches, no fault armed
        def run(seed: int) -> Verdict:
            cluster.reset()
            try:
                return fn(cluster, corpus, seed)
            except (AssertionError, RequestFailed, PoolError) as exc:  # the scenario could not finish
                return Verdict(False, f"{type(exc).__name__}: {exc}"[:600])

        return run

    return [
        ("live: cross-replica hit, byte-exact, output unchanged", fresh(S.cross_replica_hit)),
        ("live: partial hit loads only complete common blocks", fresh(S.partial_hit)),
        ("live: shared system prompt computed once, reused by every question", fresh(S.shared_system_prompt)),
        ("live: local hit, remote hit and miss told apart", fresh(S.hit_kinds)),
        ("live: corrupt load recomputed, output unchanged", fresh(lambda c, k, s: S.load_failure(c, k, s, "corrupt"))),
        ("live: transport error recomputed, output unchanged",
         fresh(lambda c, k, s: S.load_failure(c, k, s, "transport_error"))),
        ("live: timeout recomputed, output unchanged", fresh(lambda c, k, s: S.load_failure(c, k, s, "timeout"))),
        ("live: eviction between lookup and load recomputed, output unchanged",
         fresh(lambda c, k, s: S.load_failure(c, k, s, "evict"))),
        ("live: pool killed and restarted under live replicas", fresh(S.pool_restart)),
        ("live: another model revision finds the blocks incompatible", fresh(S.revision_mismatch)),
        ("live: policy fail ends the request explicitly", fresh(S.load_failure_fail)),
        ("live: OFF-ON-ON-OFF six-turn sessions alternating replicas", fresh(S.sessions)),
    ]


def start_default_cluster(report_dir: Path):  # noqa: ANN201
    """The embedded default system: local pool, two replicas of the tiny local model, and
    a third on another revision of it (for the incompatible-namespace criterion)."""
    from fixtures.tiny_model import build_tiny_model
    from harness.cluster import DEFAULT_CHUNK, ReplicaSpec, default_cluster

    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    r2 = build_tiny_model(report_dir / "model" / "tiny-r2", seed=0, revision="r2")
    cluster, specs = default_cluster(model, report_dir)
    # C: another revision of the model (other weights, same tokenizer) on the same pool
    specs.append(ReplicaSpec("C", core="0", model_dir=r2, audit=True, max_num_batched_tokens=DEFAULT_CHUNK))
    _say("kvgate gate: starting the pool and three vLLM replicas (one to two minutes) ...")
    return cluster.start(specs), model


def run_gate(seed: int | None = None, seeds: int = 3, report_dir: Path = Path("reports/runs/latest")) -> int:
    root = seed if seed is not None else secrets.randbits(32)
    key = {"seed": root, "commit": _commit(), "profile": PROFILE, "seeds": seeds}
    print(f"kvgate gate: replay key seed={root} commit={key['commit']} profile={PROFILE} seeds={seeds}", flush=True)
    run = GateRun(replay_key=key)
    t_start = time.monotonic()
    from harness.workload import Corpus

    cluster, model = start_default_cluster(report_dir)
    try:
        criteria = _pool_criteria() + _live_criteria(cluster, Corpus(model))
        _run_criteria(run, criteria, root, seeds)
    finally:
        cluster.stop()
    run.summary = {"wall_s": round(time.monotonic() - t_start, 1), "criteria": len(run.criteria),
                   "passed": sum(c.verdict.valid is True for c in run.criteria)}
    paths = write_reports(report_dir, run)
    print(f"kvgate gate: {'PASS' if run.passed else 'FAIL'} - {run.summary['passed']}/{len(run.criteria)} criteria "
          f"in {run.summary['wall_s']} s; checklist {paths['markdown']}")
    for c in run.criteria:
        print(f"  [{c.verdict.label:>7}] {c.name}" + ("" if c.verdict.valid else f"  replay: {c.replay}"))
    sessions = next((c for c in run.criteria if "OFF-ON-ON-OFF" in c.name), None)
    if sessions is not None:
        for part in sessions.verdict.evidence.get("parts", []):
            print(f"  OFF-ON-ON-OFF median TTFT of turns 2-6 (ms): {part['evidence'].get('ttft_median_ms_cross_turns')}")
    return 0 if run.passed else 1


def _run_criteria(run: GateRun, criteria, root: int, seeds: int) -> None:  # noqa: ANN001
    total = len(criteria) * seeds
    done = 0
    for name, check in criteria:
        verdicts = []
        t0 = time.monotonic()
        for i in range(seeds):
            s = derive_seed(root, f"{name}#{i}")
            done += 1
            _say(f"[{done}/{total}] {name} (seed {s}) ...")
            v = check(s)
            _say(f"[{done}/{total}] {name}: {v.label} - {v.reason}")
            verdicts.append(v)
        run.criteria.append(Criterion(name, all_of(verdicts, f"{seeds} seeds"), f"kvgate gate --seed {root} --seeds {seeds}",
                                      time.monotonic() - t0))
