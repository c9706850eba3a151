"""`kvgate bench scale`: seed 000's scale scenarios, live at the size this machine allows,
then simulated (kvgate.harness.sim) at 8 to 64 replicas, the simulation first checked against the
live run it is calibrated with.

Live (one pool, a warm replica W and three new ones N1-N3, on the machine's cores):
  calibration   at the prefix length, `reps` fresh prompts each: cold prefill (N1, nothing
                reused), local hit (N1 again), remote hit (W computes, N2 loads); the link's
                rate from the loads' own records; the front end's dispatch time (send to the
                scheduler's first lookup), alone and in bursts of six local hits on N1-N3.
                These are the simulation's inputs.
  fanout        W computes 4 hot prefixes; N1-N3 (their prefix caches emptied) each get two
                requests on them at once: six loads of the same blocks together.
  fanout+load_limit     the same, the pool's load limit set to one lease at a time
                        (SetLimits): the loads past it are throttled and recomputed.
  fanout+warm_routing   the same six requests all routed to W, which holds the prefixes.
  spike         twelve requests at once on N1-N3, every other one on a hot prefix (loaded)
                and the rest on prompts nobody computed (recomputed, then published).
Each request's hit kind and TTFT come from the run's history (kvgate.harness.measure).

Each live variant runs `trials` times (interleaved, fresh hot prefixes each time).
Check: the simulation at the live size (4 replicas, the machine's cores shared, W warm,
the same burst), in `sim_seeds` batches of `trials` runs; the live mean of the runs'
median TTFT must lie inside the 95% interval of the batches' means, and the live total of
each hit kind inside the interval of the batches' totals (the report gives the ratio sim
/ live).

Scale: every scenario of kvgate.harness.sim at 8, 16, 32 and 64 replicas, calibrated the same way.
The last line printed is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvgate.harness.client.http import complete, reset_prefix_cache
from kvgate.harness.measure import percentile, samples
from kvgate.harness.plan import Measured
from kvgate.harness.system.cluster import Cluster, ReplicaSpec
from kvgate.harness.system.hosts import IDLE_ENV
from kvgate.harness.workload.prompts import Corpus
from kvpool.connector.history import read_history

NEW = ("N1", "N2", "N3")
SPIKE = 12  # requests of the spike, every other one on a prompt nobody computed before
VARIANTS = ("fanout", "fanout+load_limit", "fanout+warm_routing", "spike")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _burst(cluster: Cluster, jobs: list[tuple[str, str, str]]) -> None:
    """Send every (replica, prompt, tag) at once; wait for all."""
    with ThreadPoolExecutor(len(jobs)) as ex:
        list(ex.map(lambda j: complete(cluster.replicas[j[0]].url, j[1], tag=j[2], replica=j[0], max_tokens=4), jobs))


def _kinds(history: Path, tags: set[str]) -> list[dict]:
    return [s.as_dict() for s in samples(read_history(history)) if s.tag in tags]


def calibrate(cluster: Cluster, corpus: Corpus, rng: random.Random, length: int, reps: int) -> Measured:
    tags: dict[str, set[str]] = {"cold": set(), "local": set(), "remote": set()}
    N1, N2, W = (cluster.replicas[r].url for r in ("N1", "N2", "W"))
    for name in ("W", *NEW):  # every replica's first prefills are slow (allocations, caches): not measured
        url = cluster.replicas[name].url
        for i in range(2):
            complete(url, corpus.text(length, rng), tag=f"warmup-{name}-{i}", replica=name, max_tokens=4)
    for i in range(reps):
        p = corpus.text(length, rng)
        complete(N1, p, tag=f"cal-cold-{i}", replica="N1", load=False, max_tokens=4)
        complete(N1, p, tag=f"cal-local-{i}", replica="N1", max_tokens=4)
        q = corpus.text(length, rng)
        complete(W, q, tag=f"cal-w-{i}", replica="W", max_tokens=4)
        time.sleep(0.3)  # W's publish commits after its response
        complete(N2, q, tag=f"cal-remote-{i}", replica="N2", max_tokens=4)
        tags["cold"].add(f"cal-cold-{i}")
        tags["local"].add(f"cal-local-{i}")
        tags["remote"].add(f"cal-remote-{i}")
    recs = read_history(cluster.history_dir)
    found = {s.tag: s for s in samples(recs)}
    m = Measured(sources=["bench scale calibration"])
    for kind, ts in tags.items():
        vals = [found[t].ttft_ms for t in ts if t in found and found[t].kind == kind]
        if vals:
            m.merge_row(kind, length, statistics.median(vals), percentile(vals, 0.95), len(vals))
    dispatch = [found[t].dispatch_ms for ts in tags.values() for t in ts
                if t in found and found[t].dispatch_ms is not None]
    if dispatch:  # the front end's share of every TTFT above, for the simulation's Tdispatch
        m.merge_row("dispatch", length, statistics.median(dispatch), percentile(dispatch, 0.95), len(dispatch))
    # The front end at the concurrency the scenarios run at (the seed: measure at production
    # concurrency, not one request at a time): bursts of local hits on the new replicas, the
    # same prompt length, each replica's prompts cached first. Their dispatch is what a burst's
    # requests spend before their schedulers see them, contention included.
    burst_tags: set[str] = set()
    for rnd in range(3):
        prompts = {name: corpus.text(length, rng) for name in NEW}
        for name, p in prompts.items():
            complete(cluster.replicas[name].url, p, tag=f"cal-bwarm-{rnd}-{name}", replica=name, max_tokens=2)
        jobs = []
        for i in range(2 * len(NEW)):
            name = NEW[i % len(NEW)]
            tag = f"cal-burst-{rnd}-{i}"
            jobs.append((name, f"{prompts[name]} {corpus.text(32, rng)}", tag))
            burst_tags.add(tag)
        _burst(cluster, jobs)
    burst = [s.dispatch_ms for s in samples(read_history(cluster.history_dir))
             if s.tag in burst_tags and s.dispatch_ms is not None]
    if burst:
        m.merge_row("dispatch_burst", length, statistics.median(burst), percentile(burst, 0.95), len(burst))
    geometry = next((r for r in recs if r.get("ev") == "register"), None)
    block_bytes = int(geometry["block_bytes"]) if geometry else 0
    ns = next(r["ns"] for r in recs if r.get("ev") == "namespace")
    m.block_size = int(ns["block_size"])
    m.bytes_per_token = block_bytes / m.block_size if block_bytes else None
    loads = [r for r in recs if r.get("ev") == "load" and r.get("tag", "").startswith("cal-remote") and r.get("loaded")]
    rates = [r["loaded"] * block_bytes / r["seconds"] for r in loads if r.get("seconds")]
    if rates:
        m.throughput_Bps["remote"] = statistics.median(rates)
    return m


def live_fanout(cluster: Cluster, corpus: Corpus, rng: random.Random, length: int, variant: str) -> list[dict]:
    W = cluster.replicas["W"].url
    hot = [corpus.text(length, rng) for _ in range(4)]
    for i, p in enumerate(hot):
        complete(W, p, tag=f"{variant}-warm-{i}-{rng.random():.6f}", replica="W", max_tokens=4)
    time.sleep(0.5)  # the last publish commits
    for r in NEW:
        reset_prefix_cache(cluster.replicas[r].url)
    admin = None
    if variant == "fanout+load_limit":
        admin = cluster.pool.client(name="bench-scale-admin")
        admin.set_load_limits(per_client=0, total=1)
    jobs, tags = [], set()
    n = SPIKE if variant == "spike" else 2 * len(NEW)
    for i in range(n):
        target = "W" if variant == "fanout+warm_routing" else NEW[i % len(NEW)]
        tag = f"{variant}-{i}-{rng.random():.6f}"
        if variant == "spike" and i % 2:  # a prompt nobody computed before: recomputed, then published
            prompt = corpus.text(length // 2, rng)
        else:
            prompt = f"{hot[rng.randrange(4)]} {corpus.text(32, rng)}"
        jobs.append((target, prompt, tag))
        tags.add(tag)
    try:
        _burst(cluster, jobs)
    finally:
        if admin is not None:
            admin.set_load_limits(0, 0)
            admin.close()
    return _kinds(cluster.history_dir, tags)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def _kind_of(s: dict) -> str:
    """A load the pool's limit refused (recomputed) is the simulation's "throttled"."""
    return "throttled" if s["kind"] == "fallback" and s["miss_cause"] == "throttled" else s["kind"]


def check_against_live(m: Measured, live: dict[str, list[list[dict]]], length: int, cores: int,
                       batches: int) -> list[dict]:
    """Each variant ran `trials` times live. The simulation runs the same variant
    `batches` x `trials` times; over each batch of `trials` runs it takes the mean of the
    runs' median TTFTs and the total of each hit kind, as the live figures are taken. The
    live figures must lie inside the 95% interval of the batches'."""
    from kvgate.harness.sim import SimClass, SimConfig, simulate

    rows = []
    for variant, trials in live.items():
        n = len(trials)
        live_mean = statistics.mean(statistics.median(s["ttft_ms"] for s in t) for t in trials if t)
        live_kinds: dict[str, int] = {}
        for t in trials:
            for s in t:
                live_kinds[_kind_of(s)] = live_kinds.get(_kind_of(s), 0) + 1
        classes = (SimClass("hot", 0.0, length, hot_prefixes=4),)
        if variant == "spike":
            classes += (SimClass("unique", 0.0, length // 2, hot_prefixes=10**9, warm=False),)
        cfg = SimConfig(replicas=4, classes=classes, duration_s=0.0,
                        warm_replicas=1, burst=SPIKE if variant == "spike" else 2 * len(NEW), cores=cores,
                        max_loads=1 if variant == "fanout+load_limit" else 0,
                        warm_routing=variant == "fanout+warm_routing")
        means: list[float] = []
        totals: list[dict[str, int]] = []
        for b in range(batches):
            docs = [simulate(m, dataclasses.replace(cfg, seed=b * n + i)) for i in range(n)]
            means.append(statistics.mean(d["ttft_p50_ms"] for d in docs))
            tot: dict[str, int] = {}
            for d in docs:
                for k, v in d["kinds"].items():
                    tot[k] = tot.get(k, 0) + v["n"]
            totals.append(tot)
        lo, hi = percentile(means, 0.025), percentile(means, 0.975)
        kinds = sorted({k for c in totals for k in c} | set(live_kinds))
        bounds = {k: [percentile([c.get(k, 0) for c in totals], 0.025), percentile([c.get(k, 0) for c in totals], 0.975)]
                  for k in kinds}
        kinds_inside = all(bounds[k][0] <= live_kinds.get(k, 0) <= bounds[k][1] for k in kinds)
        p50_inside = lo <= live_mean <= hi
        rows.append({"scenario": variant, "trials": n, "live_requests": sum(len(t) for t in trials),
                     "live_p50_ms": round(live_mean, 2), "live_kinds": live_kinds,
                     "sim_p50_ms": round(statistics.median(means), 2), "sim_p50_interval_ms": [round(lo, 2), round(hi, 2)],
                     "sim_kinds_interval": bounds, "sim_vs_live": round(statistics.median(means) / live_mean, 3),
                     "p50_inside_interval": p50_inside, "kinds_inside_interval": kinds_inside,
                     "live_inside_interval": p50_inside and kinds_inside})
    return rows


def run_bench(length: int = 4096, reps: int = 20, sim_seeds: int = 200, replica_counts: tuple[int, ...] = (8, 16, 32, 64),
              report_dir: Path | None = None, seed: int = 0, trials: int = 5) -> int:
    from kvgate.fixtures.tiny_model import build_tiny_model
    from kvgate.harness.sim import run_scale
    from tqdm import tqdm

    report_dir = report_dir or Path(tempfile.mkdtemp(prefix="kvgate-bench-scale-"))
    model = build_tiny_model(report_dir / "model" / "tiny", seed=0, revision="r1")
    corpus = Corpus(model)
    rng = random.Random(seed)
    cores = min(2, os.cpu_count() or 1)
    # idle replicas' OpenMP threads sleep instead of spinning on a core another replica needs
    specs = [ReplicaSpec(name, core=str(i % cores), max_model_len=length + 1024, kv_bytes=256 * 2**20,
                         extra_env=IDLE_ENV) for i, name in enumerate(("W", *NEW))]
    cluster = Cluster(model, report_dir / "cluster", page_size=128 * 1024, pool_pages=1024)
    _say(f"kvgate bench scale: starting a pool and {len(specs)} replicas on {cores} cores")
    with cluster.start(specs):
        _say(f"kvgate bench scale: calibrating at {length} tokens ({reps} prompts per kind)")
        m = calibrate(cluster, corpus, rng, length, reps)
        _say(f"  cold {m.by_kind.get('cold')}, local {m.by_kind.get('local')}, remote {m.by_kind.get('remote')}, "
             f"link {m.throughput_Bps}")
        live: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
        with tqdm(total=trials * len(VARIANTS), desc="live scenarios", file=sys.stderr) as bar:
            for _ in range(trials):  # interleaved, so every variant sees the same machine states
                for variant in VARIANTS:
                    live[variant].append(live_fanout(cluster, corpus, rng, length, variant))
                    bar.update(1)
    check = check_against_live(m, live, length, cores, sim_seeds)
    for row in check:
        _say(f"  {row['scenario']}: live mean of {row['trials']} runs' p50 {row['live_p50_ms']} ms, kinds "
             f"{row['live_kinds']}; simulated {row['sim_p50_ms']} ms, 95% of batches in {row['sim_p50_interval_ms']}, kinds in "
             f"{row['sim_kinds_interval']}: {'consistent' if row['live_inside_interval'] else 'OUTSIDE'}")
    total = len(replica_counts) * 6
    with tqdm(total=total, desc="simulated scale", file=sys.stderr) as bar:
        scale = run_scale(m, replica_counts, prefix_tokens=length, seed=seed, progress=bar)
    from kvgate.harness.provenance import provenance

    result = {"prefix_tokens": length, "cores": cores, "live_replicas": len(specs),
              "calibration": {"by_kind": {k: {str(L): v for L, v in rows.items()} for k, rows in m.by_kind.items()},
                              "bytes_per_token": m.bytes_per_token, "throughput_Bps": m.throughput_Bps},
              "live": live, "check": check, "scale": scale,
              "targets": {"sim_consistent_with_live": all(r["live_inside_interval"] for r in check)},
              "provenance": provenance()}
    print(json.dumps(result))
    return 0
