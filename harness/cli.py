"""The `kvgate` command.

  kvgate bench pool [...]   the pool benchmark (ratios against baselines of the same run)
  kvgate bench stall [...]  each connector hook's longest call against a stalled pool (SIGSTOP), next to
                            the healthy pool and a scheduler that waits for its lookups
  kvgate bench hosts [...]  the network tier on hosts made of network namespaces: cross-host, same-host,
                            local and cold TTFT by prefix length, and under a degraded, dead, partitioned store
  kvgate bench gpu [...]    the GPU transfer engine against a plain pinned cudaMemcpy (needs CUDA);
                            --gpus N: N GPUs loading from one pool at once
  kvgate bench seed003 [...]  seed 003's experiment on a 27B-class architecture (dummy weights), two replicas on
                            one GPU: four-block cross-replica TTFT, sessions, control, next to the seed's table
  kvgate gpu-live [...]     kvgate live on GPUs with vLLM 0.24: cross-replica hits both ways, stream delay,
                            control; --gpus N places one replica per GPU; --sessions: OFF-ON-ON-OFF
  kvgate gate [...]         the main job: start the embedded default system, run the gate
  kvgate soak [...]         the default system under concurrent streams with seeded faults for minutes:
                            requests, errors, lost requests, silent corruptions, RSS / fd / shm growth
  kvgate plan [...]         whether the pool pays per request class, from measured distributions and a mix
  kvgate html PATH          the HTML report (plots) of a gate run, a bench JSON or a plan JSON
  kvgate sim [...]          the scale scenarios simulated at 8-64 replicas from measured distributions
  kvgate bench scale [...]  fan-out live (a warm and three new replicas), the simulation checked against it
  kvgate explain --tag T | --key K   why a request or a block was not a hit (history, and the pool)
  kvgate conformance [...]  the conformance matrix (connector x connector-agnostic scenario) and its
                            correctness table, judged against the known-red baseline: exit 1 on a new
                            red cell, a known one failing differently, or a cell not run
  kvgate scenarios          list the scenario catalog
  kvgate replay NAME --seed N   rerun one scenario with one seed, print the same verdicts
The pool daemon itself is kvpool's: `kvpool serve` (kvpool.pool.cli).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path


def cmd_bench_pool(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.pool import run_bench

    return run_bench(quick=args.quick, blocks=args.catalog_blocks)


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.gpu import run_bench

    paths = tuple(p for p in args.paths.split(",") if p)
    if not args.gpus:
        return run_bench(quick=args.quick, paths=paths, reps=args.reps, max_blocks=args.max_blocks,
                         lanes=args.lanes, hash_threads=args.hash_threads, io_threads=args.pool_io_threads,
                         chunk_mib=args.chunk_mib, commit_mib=args.commit_mib, seed=args.seed)
    from kvgate.harness.bench.gpu import run_concurrent

    sizes = tuple(int(x) for x in args.concurrent_blocks.split(",") if x)
    return run_concurrent(gpus=args.gpus, sizes=sizes, reps=args.reps, lanes=args.lanes,
                          hash_threads=args.hash_threads, io_threads=args.pool_io_threads, chunk_mib=args.chunk_mib,
                          commit_mib=args.commit_mib, seed=args.seed, path=paths[0] if paths else "torch")


def cmd_bench_seed003(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.seed003 import plan_from_args, run

    return run(args.report_dir, plan_from_args(args), command="kvgate " + " ".join(sys.argv[1:]))


def cmd_bench_stall(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.stall import main

    return main(args.out)


def cmd_soak(args: argparse.Namespace) -> int:
    from kvgate.harness.soak import soak

    return soak(args.report_dir, minutes=args.minutes, seed=args.seed, streams=args.streams, sample_s=args.sample)


def cmd_bench_live(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.live import LENGTHS, run_bench

    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else LENGTHS
    return run_bench(reps=args.reps, lengths=lengths, report_dir=args.report_dir)


def cmd_bench_hosts(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.hosts import LENGTHS, run_bench

    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else LENGTHS
    return run_bench(reps=args.reps, lengths=lengths, fault_length=args.fault_length,
                     degraded_rate=args.degraded_rate, report_dir=args.report_dir, out=args.out)


def cmd_plan(args: argparse.Namespace) -> int:
    from kvgate.harness.plan import DEFAULT_MIX, PlanInputError, run_plan

    try:
        return run_plan(args.measured, args.mix or DEFAULT_MIX, args.json, args.markdown, args.html)
    except PlanInputError as exc:
        print(f"kvgate plan: {exc}", file=sys.stderr)
        return 2


def cmd_explain(args: argparse.Namespace) -> int:
    import json
    import os

    from kvgate.harness.explain import ExplainError, explain_key, explain_request
    from kvpool.errors import PoolError
    from kvpool.connector.history import read_history

    if not args.history.is_dir():
        print(f"kvgate explain: no history at {args.history}", file=sys.stderr)
        return 2
    recs = read_history(args.history)
    try:
        if args.tag:
            out = explain_request(recs, args.tag, args.replica)
        else:
            client = None
            if args.pool:
                from kvpool.client.pool_client import PoolClient

                client = PoolClient(args.pool, args.tenant, args.token or os.environ.get("KVPOOL_TOKEN", ""),
                                    name="kvgate-explain")
            try:
                out = explain_key(recs, args.key, client)
            finally:
                if client is not None:
                    client.close()
    except (ExplainError, PoolError, ValueError) as exc:
        print(f"kvgate explain: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out.as_dict(), indent=1, default=str) if args.json else out.text())
    return 0


def cmd_html(args: argparse.Namespace) -> int:
    from kvgate.harness.report.html import render_file

    if not args.path.exists():
        print(f"kvgate html: {args.path} does not exist", file=sys.stderr)
        return 2
    out = args.out or (args.path / "report.html" if args.path.is_dir() else args.path.with_suffix(".html"))
    try:
        out.write_text(render_file(args.path))
    except (OSError, ValueError, KeyError) as exc:  # json's errors are ValueErrors
        print(f"kvgate html: cannot render {args.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.scale import run_bench

    counts = tuple(int(x) for x in args.replicas.split(",") if x)
    return run_bench(length=args.length, reps=args.reps, sim_seeds=args.sim_seeds, replica_counts=counts,
                     report_dir=args.report_dir, seed=args.seed, trials=args.trials)


def cmd_sim(args: argparse.Namespace) -> int:
    import json

    from kvgate.harness.plan import PlanInputError, default_measured, load_measured
    from kvgate.harness.sim import run_scale

    try:
        m = load_measured(args.measured or default_measured())
        doc = run_scale(m, tuple(int(x) for x in args.replicas.split(",") if x), args.length, args.seed)
    except (PlanInputError, ValueError) as exc:
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    for r in doc["rows"]:
        kinds = ", ".join(f"{k} {v['n']} (p50 {v['p50_ms']} ms)" for k, v in r["kinds"].items())
        print(f"{r['replicas']:>3} replicas  {r['scenario']:<22} TTFT p50 {r['ttft_p50_ms']} ms, p95 {r['ttft_p95_ms']} ms; "
              f"{kinds}; peak link queue {r['peak_link_queue']}", file=sys.stderr)
    print(json.dumps(doc))
    return 0


def cmd_bench_publish(args: argparse.Namespace) -> int:
    from kvgate.harness.bench.publish import LENGTHS, run_bench

    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else LENGTHS
    return run_bench(pairs=args.pairs, lengths=lengths, report_dir=args.report_dir)


def cmd_gpu_live(args: argparse.Namespace) -> int:
    from kvgate.harness.gpu_live import main as gpu_live

    lengths = tuple(int(x) for x in args.bench_lengths.split(",") if x)
    contexts = tuple(int(x) for x in args.session_contexts.split(",") if x)
    return gpu_live(args.report_dir, seed=args.seed, bench=args.bench, bench_reps=args.bench_reps,
                    bench_lengths=lengths, deadline_s=args.deadline, gpus=args.gpus, sessions=args.sessions,
                    session_contexts=contexts, session_count=args.session_count, turns=args.turns,
                    exchanges=not args.no_exchanges, session_audit=args.session_audit, bench_tier=args.bench_tier,
                    bench_tier_only=args.bench_tier_only, bench_tier_extra=_connector_extra(args.bench_tier_config),
                    tier_exchanges=args.tier_exchanges, tier_extra=_connector_extra(args.tier_config))


def _connector_extra(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"kvgate: --connector-config is not JSON: {exc}") from exc
    if not isinstance(extra, dict):
        raise SystemExit("kvgate: --connector-config must be a JSON object (the connector's extra config)")
    return extra


def _conformance(names: list[str], extra: dict | None, seed: int | None, report_dir: Path,
                 scenarios: list[str] | None, request_timeout_s: float = 600.0,
                 baseline: object = None) -> tuple[list[dict], dict | None]:
    """Run the matrix, judge it against `baseline` (a kvgate.harness.conformance.baseline.Baseline,
    or None) and write it; (rows, judgement or None)."""
    import secrets

    from kvgate.harness.conformance.baseline import judge
    from kvgate.harness.conformance.gate import row_verdict, run_connector, write_matrix
    from kvgate.harness.conformance.scenarios import SCENARIOS
    from kvgate.harness.provenance import provenance

    unknown = sorted(set(scenarios or ()) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"kvgate: no connector scenarios {unknown}; known: {sorted(SCENARIOS)}")
    root = seed if seed is not None else secrets.randbits(32)
    started = provenance()  # the code that runs is the tree as it is now: the matrix records this
    print(f"kvgate conformance: replay key seed={root} connectors={','.join(names)} commit={started['short']}"
          f"{'' if started['clean'] else ' (dirty)'}", flush=True)
    rows = [run_connector(n, extra, root, report_dir / n.replace(":", "_").replace("/", "_"), scenarios,
                          request_timeout_s=request_timeout_s) for n in names]
    judgement = judge(rows, baseline) if baseline is not None else None
    paths = write_matrix(rows, report_dir, root, judgement)
    from kvgate.harness.report.conformance import label

    for row in rows:
        cells = row["cells"].values()
        passed, why = row_verdict(row)
        print(f"  {label(row):<12} {'PASS' if passed else 'FAIL'} ({why}): "
              + "  ".join(f"{c['scenario']}={c['status']}" for c in cells))
    print(f"kvgate conformance: matrix {paths['markdown']} (and .json, .html)")
    return rows, judgement


def _print_judgement(judgement: dict) -> int:
    """The baseline's judgement, one line per cell that is not a plain pass or n/a; 0 when
    nothing blocks."""
    for connector, by in judgement["cells"].items():
        for scenario, o in by.items():
            if o["outcome"] not in ("pass", "n/a"):
                block = "BLOCKS" if o["blocking"] else "tracked"
                up = f" [{o['upstream']}]" if o.get("upstream") else ""
                print(f"  {block:<7} {connector} / {scenario}: {o['outcome']}: {o['why'][:300]}{up}")
    for entry in judgement["not_asked"]:
        print(f"  {'':<7} baseline {entry}: not asked")
    verdict = "PASS" if judgement["passed"] else "FAIL"
    print(f"kvgate conformance: {verdict} against the baseline {judgement['baseline']['path']} ({judgement['why'][:600]})")
    return 0 if judgement["passed"] else 1


def cmd_gate(args: argparse.Namespace) -> int:
    from kvgate.harness.gate import run_gate

    if args.connector:
        rows, _ = _conformance([args.connector], _connector_extra(args.connector_config), args.seed,
                               args.report_dir, args.scenario or None, args.request_timeout)
        from kvgate.harness.conformance.gate import row_verdict

        passed, why = row_verdict(rows[0])  # not run (a connector that does not import) is never a pass
        print(f"kvgate gate --connector {args.connector}: {'PASS' if passed else 'FAIL'} ({why})")
        return 0 if passed else 1
    return run_gate(seed=args.seed, report_dir=args.report_dir, seeds=args.seeds, profile=args.profile,
                    scenarios=args.scenario or None, pool_checks=not args.no_pool_checks)


def cmd_campaign(args: argparse.Namespace) -> int:
    from kvgate.harness.campaign import run_campaign

    return run_campaign(seed=args.seed, seeds=args.seeds, minutes=args.minutes, report_dir=args.report_dir,
                        profile=args.profile, scenarios=args.scenario or None, soak_s=args.soak_s)


def _default_connectors() -> str:
    """kvpool and the peers that run here: OffloadingConnector only where a GPU is."""
    from kvgate.harness.conformance.gate import detect_device

    return "kvpool,example,lmcache-mp" + (",offloading" if detect_device() == "cuda" else "")


def cmd_conformance(args: argparse.Namespace) -> int:
    from kvgate.harness.conformance.baseline import BaselineError, load

    try:
        baseline = None if args.no_baseline else load(args.baseline) if args.baseline else load()
    except BaselineError as exc:
        raise SystemExit(f"kvgate conformance: {exc}") from exc
    if args.sources:
        return _conformance_from(args.sources, args.report_dir, baseline)
    names = [n for n in (args.connectors or _default_connectors()).split(",") if n]
    _, judgement = _conformance(names, None, args.seed, args.report_dir, args.scenario or None, args.request_timeout,
                                baseline)
    return 0 if judgement is None else _print_judgement(judgement)


def _conformance_from(sources: list[Path], report_dir: Path, baseline: object) -> int:
    """The matrix of rows that earlier runs wrote (their matrix.json), judged and written
    again under `report_dir`: each source's tree and seed are recorded; the matrix's tree is
    theirs where they all ran one commit clean, else it says uncommitted changes."""
    from kvgate.harness.conformance.baseline import judge
    from kvgate.harness.conformance.gate import write_matrix

    rows: list[dict] = []
    recorded = []
    for path in sources:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"kvgate conformance --from {path}: {exc}") from exc
        # one row per connector and device: the rows of one connector on two devices stay apart
        by_name = {(r["connector"], r.get("device")): r for r in rows}
        replaced: list[str] = []
        for row in doc["rows"]:
            have = by_name.get((row["connector"], row.get("device")))
            if have is None:
                row = {**row, "cells": dict(row["cells"])}
                row.pop("label", None)
                rows.append(row)
                by_name[(row["connector"], row.get("device"))] = row
                continue
            # a later run of the same connector, versions and device: its cells join the row,
            # replacing the earlier run's cell of the same scenario (the source says which)
            if have.get("versions") != row.get("versions"):
                raise SystemExit(f"kvgate conformance --from {path}: {row['connector']} ran {row.get('versions')} on "
                                 f"{row.get('device')} there, {have.get('versions')} on {have.get('device')} in an "
                                 f"earlier source: one row is one set of versions")
            for name, cell in row["cells"].items():
                if name in have["cells"]:
                    replaced.append(f"{row['connector']}/{name}")
                have["cells"][name] = cell
        recorded.append({"path": str(path), "provenance": doc["provenance"], "seed": doc.get("seed"),
                         "connectors": [r["connector"] for r in doc["rows"]],
                         "cells": sorted(f"{r['connector']}/{c}" for r in doc["rows"] for c in r["cells"]),
                         **({"replaced": replaced} if replaced else {})})
    devices: dict[str, set] = {}
    for row in rows:
        devices.setdefault(row["connector"], set()).add(row.get("device"))
    for row in rows:  # a connector run on two devices: each row named with its device
        if len(devices[row["connector"]]) > 1:
            row["label"] = f"{row['connector']} ({row.get('device')})"
    provs = [s["provenance"] for s in recorded]
    one = len({p["commit"] for p in provs}) == 1 and all(p.get("clean") for p in provs)
    # rows of several commits: no one commit to name; "clean" then says each source ran a clean tree
    prov = dict(provs[0]) if one else {**provs[0], "clean": all(p.get("clean") for p in provs), "mixed": True,
                                       "commits": sorted({p.get("short") or str(p.get("commit"))[:12] for p in provs})}
    from kvgate.harness.provenance import provenance

    from kvgate.harness.conformance.baseline import byte_oracle

    for row in rows:  # the cells of earlier runs answer to this tree's byte oracle too
        row["cells"] = {name: byte_oracle(cell) for name, cell in row["cells"].items()}
    seeds = {s["seed"] for s in recorded}
    prov = {**prov, "judged_on": provenance()}  # the tree (and so the baseline) this judgement was made on
    judgement = judge(rows, baseline) if baseline is not None else None
    paths = write_matrix(rows, report_dir, seeds.pop() if len(seeds) == 1 else -1, judgement, provenance_of=prov,
                         sources=recorded)
    print(f"kvgate conformance: matrix {paths['markdown']} (and .json, .html) from {len(recorded)} runs"
          f"{'' if one else ' of different commits or uncommitted trees'}")
    return 0 if judgement is None else _print_judgement(judgement)


def cmd_scenarios(args: argparse.Namespace) -> int:
    from kvgate.harness.scenarios.catalog import load_catalog

    for sc in load_catalog():
        control = f" [control: {sc.control.name}]" if sc.control else ""
        print(f"{sc.name:<24} {sc.fault or 'none':<18} {'+'.join(sc.replicas):<8}{control}\n    {sc.description}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from kvgate.harness.system.default import start_for
    from kvgate.harness.scenarios.catalog import ScenarioError, find
    from kvgate.harness.scenarios.runner import run_scenario
    from kvgate.harness.workload.prompts import Corpus

    try:
        sc = find(args.scenario)
    except ScenarioError as exc:
        raise SystemExit(f"kvgate replay: {exc}") from exc
    if args.schedule is not None:  # a failing run's schedule (the gate writes it next to its report)
        doc = json.loads(args.schedule.read_text())
        if doc.get("scenario") not in (None, sc.name):
            raise SystemExit(f"kvgate replay: {args.schedule} is the schedule of {doc['scenario']!r}, not {sc.name!r}")
        args.seed = int(doc["seed"])
        from kvgate.faults.schedule import FaultSchedule, pin

        try:  # its parameters as written (an edited file replays its edits), not drawn again from the seed
            pin(FaultSchedule.from_json(json.dumps({k: v for k, v in doc.items() if k != "scenario"})))
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"kvgate replay: {args.schedule} is not a fault schedule: {exc}") from exc
    print(f"kvgate replay: {sc.name} --seed {args.seed} (fault {sc.fault or 'none'}; replicas {'+'.join(sc.replicas)})",
          flush=True)
    report_dir = args.report_dir or Path("reports/runs/replay") / f"{sc.name}-{args.seed}"
    from kvgate.harness.scenarios.catalog import store_of

    cluster, model = start_for(report_dir, set(sc.replicas), store_of(sc))
    try:
        r = run_scenario(cluster, Corpus(model), sc, args.seed)
    finally:
        cluster.stop()
    for part in r.verdict.evidence.get("parts", []):
        label = {True: "pass", False: "FAIL", None: "unknown"}[part["valid"]]
        print(f"  [{label:>7}] {part['reason'][:400]}")
    print(f"  outcome: {r.outcome}; counts: {json.dumps(r.counts)}")
    (report_dir / "replay.json").write_text(json.dumps({"scenario": sc.name, "seed": args.seed, "valid": r.verdict.valid,
                                                        "outcome": r.outcome, "counts": r.counts, "control": r.control,
                                                        "verdict": r.verdict.evidence}, indent=2, default=str))
    print(f"kvgate replay: {'PASS' if r.verdict.valid is True else 'FAIL'} ({r.seconds:.0f} s); history and logs "
          f"in {report_dir}")
    if r.verdict.valid is not True:
        print(f"  replay: {r.replay}")
    return 0 if r.verdict.valid is True else 1


class _Tee(io.TextIOBase):
    def __init__(self, *streams: io.TextIOBase) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _bench_with_html(func):  # noqa: ANN001, ANN202
    """A bench command that also writes its HTML report (kvgate.harness.report.html) with --html FILE,
    from the JSON object it prints last."""

    def run(args: argparse.Namespace) -> int:
        path = getattr(args, "html", None)
        if path is None:
            return func(args)
        captured = io.StringIO()
        with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
            rc = func(args)
        text = captured.getvalue()
        start = text.rfind("\n{") + 1 if not text.startswith("{") else 0  # its last object: one line or indented
        try:
            doc = json.loads(text[start:])
        except json.JSONDecodeError:
            print(f"kvgate bench: no JSON result to draw into {path}", file=sys.stderr)
            return rc or 1
        from kvgate.harness.report.html import bench_report

        path.write_text(bench_report(doc, args.bench_command))
        print(f"kvgate bench: HTML report {path}", file=sys.stderr)
        return rc

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bp = bench.add_parser("pool", help="lookup latency, load/publish vs memcpy, catalog memory")
    bp.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    bp.add_argument("--catalog-blocks", type=int, default=1_000_000)
    bp.set_defaults(func=cmd_bench_pool)

    bg = bench.add_parser("gpu", help="GPU transfer engine: store/load vs plain pinned cudaMemcpy, 27B KV load time")
    bg.add_argument("--quick", action="store_true", help="smaller arena and sizes, two repetitions (smoke run)")
    bg.add_argument("--paths", default="torch,driver,torch-xxh3",
                    help="copy paths to measure (torch, driver; '-xxh3': with host digests, the baseline of "
                         "the GPU digests); the first gives the headline")
    bg.add_argument("--reps", type=int, default=3, help="repetitions per size (medians reported)")
    bg.add_argument("--max-blocks", type=int, default=4096, help="largest transfer of the sweep, in blocks")
    bg.add_argument("--lanes", type=int, default=8, help="pool connections the engine commits on")
    bg.add_argument("--hash-threads", type=int, default=8, help="digest threads of the engine")
    bg.add_argument("--pool-io-threads", type=int, default=8, help="verify threads of the bench's pool daemon")
    bg.add_argument("--chunk-mib", type=int, default=128, help="staged copy chunk")
    bg.add_argument("--commit-mib", type=int, default=32, help="reservation / commit unit")
    bg.add_argument("--seed", type=int, default=0, help="seed of the KV bytes and block choices")
    bg.add_argument("--gpus", type=int, default=0,
                    help="N >= 1: the concurrent bench instead of the sweep: N GPUs (one process each) load from one "
                         "pool at once, against each GPU's plain pinned copy of the same run")
    bg.add_argument("--concurrent-blocks", default="64,256,1024",
                    help="transfer sizes of the concurrent bench, in 4 MiB blocks per GPU")
    bg.set_defaults(func=cmd_bench_gpu)

    from kvgate.harness.bench.seed003 import add_arguments as seed003_arguments

    b3 = bench.add_parser("seed003", help="seed 003's experiment on a 27B-class architecture (dummy weights) on one "
                                          "GPU: four-block cross-replica TTFT, sessions, control, side by side")
    seed003_arguments(b3)
    b3.set_defaults(func=cmd_bench_seed003)

    bs = bench.add_parser("stall", help="how long each connector hook holds the engine while the pool is stalled")
    bs.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    bs.set_defaults(func=cmd_bench_stall)

    bl = bench.add_parser("live", help="cold / local / remote / peer TTFT by prefix length on live replicas")
    bl.add_argument("--reps", type=int, default=5, help="fresh prompts per length (half at 16k, 3 at least)")
    bl.add_argument("--lengths", default="", help="comma-separated prefix lengths (default 1k..16k)")
    bl.add_argument("--report-dir", type=Path, default=None, help="logs and history (default: a temp dir)")
    bl.set_defaults(func=cmd_bench_live)
    bh = bench.add_parser("hosts", help="cross-host / same-host / local / cold TTFT on namespace hosts, and under "
                                        "a degraded, dead and partitioned store host (needs root: ip netns)")
    bh.add_argument("--reps", type=int, default=3, help="fresh prompts per length and per fault")
    bh.add_argument("--lengths", default="", help="comma-separated prefix lengths (default 1k..8k)")
    bh.add_argument("--fault-length", type=int, default=4096, help="the prefix length of the degradation table")
    bh.add_argument("--degraded-rate", default="256kbit", help="the degraded store link's rate (tc tbf)")
    bh.add_argument("--report-dir", type=Path, default=None, help="logs and history (default: a temp dir)")
    bh.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    bh.set_defaults(func=cmd_bench_hosts)

    bsc = bench.add_parser("scale", help="fan-out live on a warm and three new replicas, the simulation checked "
                                          "against it, then simulated at 8-64 replicas")
    bsc.add_argument("--length", type=int, default=4096, help="the hot prefixes' length in tokens")
    bsc.add_argument("--reps", type=int, default=20, help="calibration prompts per kind")
    bsc.add_argument("--trials", type=int, default=5, help="live runs of each scenario")
    bsc.add_argument("--sim-seeds", type=int, default=200, help="simulated batches (of --trials runs each) per scenario")
    bsc.add_argument("--replicas", default="8,16,32,64", help="replica counts of the simulated scale")
    bsc.add_argument("--seed", type=int, default=0)
    bsc.add_argument("--report-dir", type=Path, default=None, help="logs and history (default: a temp dir)")
    bsc.set_defaults(func=cmd_bench_scale)

    bpub = bench.add_parser("publish", help="the producer's next-request TTFT with publishing on and off")
    bpub.add_argument("--pairs", type=int, default=8, help="request pairs per length (half of them publishing)")
    bpub.add_argument("--lengths", default="", help="comma-separated prompt lengths (default 1k,4k,16k)")
    bpub.add_argument("--report-dir", type=Path, default=None, help="logs and history (default: a temp dir)")
    bpub.set_defaults(func=cmd_bench_publish)

    pl = sub.add_parser("plan", help="whether the pool pays, per request class, from measured distributions and a mix")
    pl.add_argument("--measured", type=Path, action="append", default=[],
                    help="a gate run's measurements.json or a bench hosts / live / publish / pool JSON (repeatable; "
                         "default: reports/runs/latest/measurements.json, else the newest committed bench reports)")
    pl.add_argument("--mix", type=Path, default=None,
                    help="the request mix: JSON or TOML classes, or a JSON-lines trace (default fixtures/plan/mix.json)")
    pl.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")
    pl.add_argument("--markdown", type=Path, default=None, help="also write the Markdown here")
    pl.add_argument("--html", type=Path, default=None, help="also write the HTML report (with its plot) here")
    pl.set_defaults(func=cmd_plan)

    ex = sub.add_parser("explain", help="why a request or a block's key was not a hit, from a run's history and the pool")
    ex.add_argument("--history", type=Path, default=Path("reports/runs/latest/history"),
                    help="a run's history directory (default: the latest gate run's)")
    what = ex.add_mutually_exclusive_group(required=True)
    what.add_argument("--tag", help="the request's tag (kv_transfer_params.kvpool.tag)")
    what.add_argument("--key", help="a block's pool key, hex (the audit records them)")
    ex.add_argument("--replica", default=None, help="the replica, where the tag was sent to several")
    ex.add_argument("--pool", default="", help="unix:PATH or tcp:HOST:PORT: also ask the pool about the key now")
    ex.add_argument("--tenant", default="default")
    ex.add_argument("--token", default="", help="the tenant's token (or KVPOOL_TOKEN)")
    ex.add_argument("--json", action="store_true", help="print JSON")
    ex.set_defaults(func=cmd_explain)

    sm = sub.add_parser("sim", help="the scale scenarios simulated (SimPy) at many replicas, from measured distributions")
    sm.add_argument("--measured", type=Path, action="append", default=[],
                    help="as kvgate plan's (default: the latest gate run's measurements, else the committed benches)")
    sm.add_argument("--replicas", default="8,16,32,64")
    sm.add_argument("--length", type=int, default=4096, help="the hot prefixes' length in tokens")
    sm.add_argument("--seed", type=int, default=0)
    sm.set_defaults(func=cmd_sim)

    ht = sub.add_parser("html", help="the HTML report (inline SVG plots) of a gate run, a bench JSON or a plan JSON")
    ht.add_argument("path", type=Path, help="a gate run's directory or measurements.json, a bench JSON, a plan JSON")
    ht.add_argument("-o", "--out", type=Path, default=None, help="where (default: beside it, .html)")
    ht.set_defaults(func=cmd_html)

    from kvgate.harness.soak import bounds_text

    so = sub.add_parser("soak", help="concurrent request streams with seeded faults for minutes; leaks and losses",
                        description="The default system under concurrent request streams with seeded faults. It "
                                    "fails (exit 1) on a silent corruption, a lost request, an oracle that failed or "
                                    "could not judge (unknown is not a pass), a run that sent no request, and a "
                                    f"growth bound exceeded: {bounds_text()}.")
    so.add_argument("--minutes", type=float, default=10.0)
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--streams", type=int, default=3, help="concurrent request streams")
    so.add_argument("--sample", type=float, default=15.0, help="seconds between resource samples")
    so.add_argument("--report-dir", type=Path, default=Path("reports/runs/soak"))
    so.set_defaults(func=cmd_soak)

    gl = sub.add_parser("gpu-live", help="live replicas on GPUs (vLLM 0.24): hits both ways, stream delay, control")
    gl.add_argument("--report-dir", type=Path, default=Path("reports/runs/gpu-live"))
    gl.add_argument("--seed", type=int, default=20261129, help="seed of the prompts")
    gl.add_argument("--bench", action="store_true", help="also the live rows of bench gpu part 2")
    gl.add_argument("--bench-reps", type=int, default=1)
    gl.add_argument("--bench-tier", action="store_true",
                    help="also the GPU tier in the bench: a keeper in device memory and a replica pair on it "
                         "(gpu_tier_* keys: against the local hit and OffloadingConnector's CPU-tier hit)")
    gl.add_argument("--bench-tier-only", action="store_true",
                    help="the GPU tier's rows alone: OffloadingConnector (C), the keeper, T publishing, U loading "
                         "asynchronously and V with load_mode sync (fewer replicas: fits an 80 GiB GPU)")
    gl.add_argument("--bench-tier-config", default=None,
                    help='JSON: more connector settings of the tier\'s replicas, e.g. {"gpu_chunk_mib": 512}')
    gl.add_argument("--tier-config", default=None,
                    help='JSON: more connector settings of the tier exchanges\' replicas, e.g. '
                         '{"gpu_install_direct": false}')
    gl.add_argument("--bench-lengths", default="8192,32768,65536")
    gl.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run (bench stops early)")
    gl.add_argument("--gpus", type=int, default=1,
                    help="1: two replicas share the one GPU; N >= 2: one replica per GPU (A on GPU 0, B on GPU 1, ...)")
    gl.add_argument("--sessions", action="store_true",
                    help="also OFF-ON-ON-OFF six-turn sessions alternating replicas (the bench model, same placement)")
    gl.add_argument("--session-contexts", default="32768", help="initial context lengths of the sessions, in tokens")
    gl.add_argument("--session-count", type=int, default=2, help="sessions per block")
    gl.add_argument("--turns", type=int, default=6, help="turns per session")
    gl.add_argument("--no-exchanges", action="store_true", help="skip the tiny replicas' exchanges (sessions only)")
    gl.add_argument("--tier-exchanges", action="store_true",
                    help="also the exchanges (hit, stream delay, its control) on tiny replicas sharing a GPU keeper's "
                         "tier in device memory instead of the host pool; the oracle reads the tier's pages")
    gl.add_argument("--session-audit", action="store_true",
                    help="audit the session replicas (kvpool.connector.audit): loaded blocks against their producer's bytes, "
                         "and the KV bytes of the OFF blocks and of the ON blocks compared with each other")
    gl.set_defaults(func=cmd_gpu_live)

    ca = sub.add_parser("campaign", help="every fault kind over many derived seeds within a time budget",
                        description="Round-robin over fault kinds: round i runs each kind's next scenario with the "
                                    "seed derived from the root seed, the kind and i; no run starts past the budget. "
                                    "It fails (exit 1) on a failed run, on a kind that ran fewer seeds than asked "
                                    "(not run is never a pass) and when nothing ran. Writes campaign.json and "
                                    "campaign.md, every failure with its replay command and fault schedule.")
    ca.add_argument("--seed", type=int, default=None, help="root seed (default: drawn and printed)")
    ca.add_argument("--seeds", type=int, default=20, help="seeds per fault kind (rounds)")
    ca.add_argument("--minutes", type=float, default=60.0, help="time budget; no run starts past it")
    ca.add_argument("--profile", default="all", help="fault kinds, as kvgate gate --profile, and `soak` (the soak's "
                                                     "streams: one window a round; in `all`)")
    ca.add_argument("--soak-s", type=float, default=60.0, help="seconds of each round's soak window (0: none)")
    ca.add_argument("--scenario", action="append", default=[], help="only this scenario (repeatable)")
    ca.add_argument("--report-dir", type=Path, default=Path("reports/runs/campaign"))
    ca.set_defaults(func=cmd_campaign)

    gate = sub.add_parser("gate", help="run the gate on the embedded default system")
    gate.add_argument("--seed", type=int, default=None, help="root seed (default: drawn and printed)")
    gate.add_argument("--seeds", type=int, default=2, help="seeds per scenario (2: about 15 minutes here)")
    gate.add_argument("--report-dir", type=Path, default=Path("reports/runs/latest"))
    gate.add_argument("--profile", default="all",
                      help="fault kinds to run, comma-separated ('none': the fault-free scenarios), 'hosts' (the multi-host "
                           "system's scenarios), or 'all'")
    gate.add_argument("--scenario", action="append", default=[], help="only this scenario (repeatable)")
    gate.add_argument("--no-pool-checks", action="store_true", help="skip the pool criteria (no live system)")
    gate.add_argument("--connector", default="",
                      help="gate this V1 connector instead (kvpool, example, offloading, lmcache-mp, lmcache-mp-cuda, "
                           "lmcache-mp-cuda-engine, or "
                           "module:Class) "
                           "on the connector-agnostic scenarios; it fails (exit 1, the reason printed) when a cell "
                           "failed, when the connector cannot run here (it does not import, or needs a GPU this "
                           "machine lacks: every cell 'not run', nothing started), or when no cell passed")
    gate.add_argument("--connector-config", default="", help="the connector's extra config, JSON (with module:Class)")
    gate.add_argument("--request-timeout", type=float, default=600.0,
                      help="with --connector: seconds one request may take (a hung request fails its cell)")
    gate.set_defaults(func=cmd_gate)

    cf = sub.add_parser("conformance", help="the conformance matrix: connector x connector-agnostic scenario")
    cf.add_argument("--connectors", default="",
                    help="comma-separated (default: kvpool,example,lmcache-mp, and offloading where a GPU is)")
    cf.add_argument("--baseline", type=Path, default=None,
                    help="the known red cells (default: the committed kvgate/harness/conformance/known_red.toml); "
                         "the command fails on a new red cell, a known one failing differently, a known one not "
                         "judged, or a cell not run, and reports a known one that passes as fixed upstream "
                         "(or, for an entry that is wholly a race in the peer, as not reproduced)")
    cf.add_argument("--no-baseline", action="store_true", help="judge nothing: write the matrix, exit 0")
    cf.add_argument("--from", dest="sources", type=Path, action="append", default=[],
                    help="run nothing: the rows of this earlier run's matrix.json (repeatable), judged and written "
                         "again under --report-dir")
    cf.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds one request may take (a hung request fails its cell)")
    cf.add_argument("--seed", type=int, default=None)
    cf.add_argument("--scenario", action="append", default=[], help="only this scenario (repeatable)")
    cf.add_argument("--report-dir", type=Path, default=Path("reports/runs/conformance"))
    cf.set_defaults(func=cmd_conformance)

    sc = sub.add_parser("scenarios", help="list the scenario catalog (fixtures/scenarios)")
    sc.set_defaults(func=cmd_scenarios)

    rp = sub.add_parser("replay", help="rerun one scenario of the catalog with one seed; print its verdicts")
    rp.add_argument("scenario", help="a scenario name (kvgate scenarios lists them)")
    which = rp.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=int, help="the scenario run's seed (every failing line prints it)")
    which.add_argument("--schedule", type=Path, help="a failing run's schedule file (reports/.../schedules/)")
    rp.add_argument("--report-dir", type=Path, default=None, help="default reports/runs/replay/SCENARIO-SEED")
    rp.set_defaults(func=cmd_replay)
    for name, sp in bench.choices.items():  # every bench can also write its HTML report
        if name != "gpu":
            sp.add_argument("--html", type=Path, default=None, help="also write the HTML report (plots) here")
            sp.set_defaults(func=_bench_with_html(sp.get_default("func")))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
