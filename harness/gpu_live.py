"""`kvgate gpu-live`: kvgate live on GPUs with vLLM 0.24 (the GPU bundle), its parts run
together and judged as one.

  main(report_dir, seed, bench, sessions, exchanges, ...) -> int
      starts the tiny replicas (the live exchanges), the session replicas (`sessions`) and
      the bench replicas (`bench`) at the same time, runs the exchanges
      (kvgate.harness.scenarios.gpu_live.run_live), with `tier_exchanges` the same exchanges
      on replicas sharing a GPU keeper's tier (tier.json), then the OFF-ON-ON-OFF sessions
      (kvgate.harness.scenarios.gpu_live.run_sessions), then the bench rows
      (kvgate.harness.bench.gpu_live.measure) while time is left; writes live.json,
      sessions.json, result.json and checklist.md (kvgate.harness.report.gpu_live) under
      report_dir as each part finishes.
The exit status is 0 only when kvgate.harness.scenarios.gpu_live.failures finds nothing: a part
asked for that failed, raised or did not run fails the run. Under `--no-exchanges` the
live exchanges are "not run" and the exit status is that of the parts that were asked for
(nothing asked for at all fails). The last line printed is the result as one JSON object.

This module sits above both the scenarios and the bench it composes; neither imports it.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvgate.harness.bench import gpu_live as bench_live
from kvgate.harness.report.gpu_live import render_markdown
from kvgate.harness.scenarios import gpu_live as live
from kvgate.harness.system.cluster import Cluster, OrphanError


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))[-4000:]


def _stop(cluster: Cluster) -> str:
    """Stop a cluster; an OrphanError is returned for the result (and fails the run)."""
    try:
        cluster.stop()
    except OrphanError as exc:
        return str(exc)
    return ""


def _run_part(result: dict, name: str, started, body) -> None:  # noqa: ANN001 - a Future, Cluster -> value
    """One part on its own cluster, once `started` (its start's future) resolves: body's value
    under result[name]; an exception of the start or of the body under result[name_error]
    (recorded, and it fails the run; the other parts still run); the cluster stopped either
    way (an orphan under result[name_stop_error])."""
    try:
        cluster = started.result()
    except Exception as exc:  # recorded in the result and the exit code
        result[f"{name}_error"] = _trace(exc)
        cluster = None
    if cluster is not None:
        try:
            result[name] = body(cluster)
        except Exception as exc:  # recorded in the result and the exit code
            result[f"{name}_error"] = _trace(exc)
        finally:
            result[f"{name}_stop_error"] = _stop(cluster)
    if f"{name}_error" in result:
        _say(f"kvgate gpu-live: {name} raised:\n{result[f'{name}_error']}")


def main(report_dir: Path, seed: int = 20261129, bench: bool = False, bench_reps: int = 1,
         bench_lengths: tuple[int, ...] = (8192, 32768, 65536), deadline_s: float = 540.0, gpus: int = 1,
         sessions: bool = False, session_contexts: tuple[int, ...] = (32768,), session_count: int = 2,
         turns: int = 6, exchanges: bool = True, session_audit: bool = False, bench_tier: bool = False,
         bench_tier_only: bool = False, bench_tier_extra: dict | None = None, tier_exchanges: bool = False,
         tier_extra: dict | None = None) -> int:
    """Start the tiny replicas (and, with `sessions`, the session replicas; with `bench`, the
    bench replicas, and with `bench_tier` the GPU tier's keeper and its pair too) at the same
    time, run the live exchanges, then the sessions, then the bench rows while time is left; write live.json (and the rest) under report_dir as each part
    finishes. `tier_exchanges`: the same exchanges again on tiny replicas whose pool is a GPU
    keeper's tier in device memory (kvgate.harness.scenarios.gpu_live.tiny_tier_cluster), the
    oracle reading the tier's pages; under result["tier"], tier.json."""
    bench_tier = bench_tier or bench_tier_only
    if bench and bench_tier:  # a tier too large for the GPU is refused before anything starts
        bench_live.tier_gib(bench_reps * sum(bench_lengths), bench_tier_only)
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    report_dir.mkdir(parents=True, exist_ok=True)
    cluster, specs, model = live.tiny_cluster(report_dir / "live", gpus)
    bench_f = sess_f = tier_f = None
    result: dict = {"passed": False, "gpus": gpus}
    with ThreadPoolExecutor(4) as ex:
        live_f = ex.submit(cluster.start, specs, 400.0) if exchanges else None
        if tier_exchanges:
            tier_f = ex.submit(live.start_tier_cluster, report_dir / "tier", gpus, tier_extra)
            result["tier_settings"] = tier_extra or {}
        if sessions:
            sess_f = ex.submit(live.start_sessions, report_dir / "sessions", gpus, max(session_contexts), turns,
                               session_audit)
        if bench:
            bench_f = ex.submit(bench_live.start_bench, report_dir / "bench", max(bench_lengths), bench_tier,
                                bench_reps * sum(bench_lengths), bench_tier_only, bench_tier_extra)
        if live_f is not None:
            try:
                live_f.result()
                _say(f"kvgate gpu-live: tiny replicas {list(cluster.replicas)} up after {time.monotonic() - t0:.0f} s")
                result.update(live.run_live(cluster, model, seed))
            except Exception as exc:  # recorded in the result and the exit code; the other parts still run
                result["error"] = _trace(exc)
                _say(f"kvgate gpu-live: live part raised:\n{result['error']}")
            finally:
                result["stop_error"] = _stop(cluster)
            (report_dir / "live.json").write_text(json.dumps(result, indent=1, default=str))
            _say(f"kvgate gpu-live: live part {'PASS' if result['passed'] else 'FAIL'} after "
                 f"{time.monotonic() - t0:.0f} s")
        else:
            # not run is neither a pass nor a fail: the run's verdict is "ok"
            result.update(passed=None, seed=seed, env=live.environment(), exchanges_skipped=True)
        if tier_f is not None:
            _run_part(result, "tier", tier_f, lambda c: live.run_live(c, c.model_dir, seed, pool=c.tier_oracle))
            (report_dir / "tier.json").write_text(json.dumps(result.get("tier"), indent=1, default=str))
            _say(f"kvgate gpu-live: tier exchanges {'PASS' if (result.get('tier') or {}).get('passed') else 'FAIL'} "
                 f"after {time.monotonic() - t0:.0f} s")
        if sess_f is not None:
            _run_part(result, "sessions", sess_f,
                      lambda c: live.run_sessions(c, seed, session_contexts, session_count, turns, deadline - 30,
                                                  audit=session_audit))
            (report_dir / "sessions.json").write_text(json.dumps(result.get("sessions"), indent=1, default=str))
        if bench_f is not None:
            _run_part(result, "bench", bench_f,
                      lambda c: (bench_live.measure_tier if bench_tier_only else bench_live.measure)(
                          c, bench_lengths, bench_reps, deadline_s=deadline - time.monotonic()))
    result["wall_s"] = round(time.monotonic() - t0)
    result["failures"] = live.failures(result, exchanges=exchanges, sessions=sessions, bench=bench,
                                  session_contexts=session_contexts, bench_lengths=bench_lengths,
                                  bench_reps=bench_reps, tier_exchanges=tier_exchanges)
    result["ok"] = not result["failures"]
    (report_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (report_dir / "checklist.md").write_text(render_markdown(result, time.strftime("%Y-%m-%d")))
    print(json.dumps(result, default=str))
    for f in result["failures"]:
        _say(f"kvgate gpu-live: FAIL: {f}")
    _say(f"kvgate gpu-live: {'PASS' if result['ok'] else 'FAIL'}")
    return 0 if result["ok"] else 1
