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

PROFILE = "pool"


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
            v = pool_checks.state_machine(seed, examples=100, steps=40, catalog_factory=cls, shrink=False)
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


def run_gate(seed: int | None = None, seeds: int = 3, report_dir: Path = Path("reports/runs/latest")) -> int:
    root = seed if seed is not None else secrets.randbits(32)
    key = {"seed": root, "commit": _commit(), "profile": PROFILE, "seeds": seeds}
    print(f"kvgate gate: replay key seed={root} commit={key['commit']} profile={PROFILE} seeds={seeds}", flush=True)
    run = GateRun(replay_key=key)
    criteria = _pool_criteria()
    t_start = time.monotonic()
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
    run.summary = {"wall_s": round(time.monotonic() - t_start, 1), "criteria": len(run.criteria),
                   "passed": sum(c.verdict.valid is True for c in run.criteria)}
    paths = write_reports(report_dir, run)
    print(f"kvgate gate: {'PASS' if run.passed else 'FAIL'} - {run.summary['passed']}/{len(run.criteria)} criteria "
          f"in {run.summary['wall_s']} s; checklist {paths['markdown']}")
    for c in run.criteria:
        print(f"  [{c.verdict.label:>7}] {c.name}" + ("" if c.verdict.valid else f"  replay: {c.replay}"))
    return 0 if run.passed else 1
