"""kvgate soak: the default system under load for a long run, with seeded faults firing.

Several request streams (threads, each its own seeded generator) send prompts of mixed
lengths to replicas A, B and D for `minutes`: a shared prefix (a new one a quarter of the
time, else one of the recent ones, the newest most often) and a suffix of its own, so that
replicas keep loading each other's blocks and the pool keeps evicting. A nemesis thread
arms one seeded fault at a time on B (a load fault: corrupt, timeout, evict) or on D's
transport proxy (a reset, a truncated frame, a bit flip on page frames) for a few seconds
and heals it, and now and then empties a replica's prefix cache (its next requests load
from the pool). A sampler records each process tree's private and shared resident memory
and open descriptors, and the host's Shmem (/dev/shm and memfd segments), every
`sample_s`.

The run is judged as a scenario is (kvgate.harness.scenarios.runner): byte-exact over the
audit's records of the whole window (silent corruptions), miss causes, and the requests
checker (lost requests; an error is allowed only where the replica's policy says fail).
Every oracle must say valid: an unknown verdict (None: the oracle could not judge) fails
the soak, as does a run that sent no request; not run is never a pass.

The soak also judges its own growth (judge_growth), from the first sample under load (the
warm-up: `sample_s` after the streams start) to the last (after they stop), against
BOUNDS, per process tree (each replica's, the pool daemon's):
  private RSS (RssAnon + RssFile)   at most `private_mib` + `private_mib_per_1k` for every
                                    1000 requests sent after the warm-up sample
  shared RSS (RssShmem)             at most the pool's segment (its pages are touched once,
                                    then reused) + `shared_slack_mib`
  open descriptors                  at most `fds` more
and the host's Shmem at most the pool's segment + HOST_SHM_SLACK_MIB. A bound exceeded
fails the soak, with the measurement and the bound in the report.

  GrowthBound                     one process tree's bound (frozen)
  BOUNDS, HOST_SHM_SLACK_MIB      the stated bounds (replicas, the pool daemon, the host)
  judge_growth(samples, segment_bytes) -> (growth, exceeded)
  judge(outcome, counts, verdicts, exceeded) -> [failures]   empty when the soak passed

Output under REPORT_DIR: soak.json (counts, verdicts, growth and its bounds, failures,
samples, the command, provenance) and soak.md (the tables).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.harness.plugin import derive_seed

if TYPE_CHECKING:  # the run's modules are imported where it runs: `kvgate --help` stays light
    from kvgate.harness.workload.prompts import Corpus

REPLICAS = ("A", "B", "D")
PREFIX_TOKENS = (48, 160, 400, 800, 1600)
RECENT = 40
LOAD_FAULTS = ("corrupt", "timeout", "evict")
PROXY_FAULTS = ("reset", "truncate", "bitflip")


@dataclasses.dataclass(frozen=True)
class GrowthBound:
    """The most one process tree may grow from the warm-up sample to the end."""

    private_mib: float  # private RSS, whatever the number of requests
    private_mib_per_1k: float  # and this much more per 1000 requests after the warm-up sample
    fds: int  # open descriptors
    shared_slack_mib: float  # shared RSS beyond the pool's segment size


# Measured on the committed 10-minute CPU soak (3040 requests): replicas grew 7-9 MiB of
# private RSS and 0 descriptors, the daemon 0.5 MiB and 0; the host's Shmem grew by the
# segment (128 MiB) as its pages were first touched. A leak of one page or one descriptor
# per request exceeds these bounds within a few thousand requests.
BOUNDS = {"replica": GrowthBound(private_mib=64.0, private_mib_per_1k=8.0, fds=16, shared_slack_mib=16.0),
          "pool": GrowthBound(private_mib=16.0, private_mib_per_1k=2.0, fds=8, shared_slack_mib=16.0)}
HOST_SHM_SLACK_MIB = 32.0
MIB = 2**20


def bounds_text() -> str:
    """The bounds in words (the help text and the report say the same)."""
    r, p = BOUNDS["replica"], BOUNDS["pool"]
    return (f"growth from the warm-up sample to the end, per process tree: private RSS at most {r.private_mib:g} MiB "
            f"+ {r.private_mib_per_1k:g} MiB per 1000 requests (replicas), {p.private_mib:g} MiB + "
            f"{p.private_mib_per_1k:g} MiB per 1000 requests (the pool daemon); shared RSS at most the pool's segment "
            f"+ {r.shared_slack_mib:g} MiB; descriptors at most +{r.fds} (replicas), +{p.fds} (the pool daemon); "
            f"the host's Shmem at most the pool's segment + {HOST_SHM_SLACK_MIB:g} MiB")


def judge_growth(samples: list[dict], segment_bytes: int, names: tuple[str, ...] = (*REPLICAS, "pool"),
                 ) -> tuple[dict, list[str]]:
    """(growth per process tree and of the host's Shmem, with the bound each was judged
    against; the bounds exceeded, in words). `samples` as _sample writes them, each with
    the requests sent so far; the first after start-up is the warm-up sample."""
    if len(samples) < 2:
        return {}, [f"{len(samples)} resource samples: growth not judged (the soak ran too briefly)"]
    first, last = samples[1] if len(samples) > 2 else samples[0], samples[-1]
    requests = max(0, int(last.get("requests", 0)) - int(first.get("requests", 0)))
    growth: dict = {}
    exceeded: list[str] = []
    for name in names:
        b = BOUNDS["pool" if name == "pool" else "replica"]
        rss = (last[name]["rss_bytes"] - first[name]["rss_bytes"]) / MIB
        shm = (last[name]["shm_rss_bytes"] - first[name]["shm_rss_bytes"]) / MIB
        fds = last[name]["fds"] - first[name]["fds"]
        rss_bound = b.private_mib + b.private_mib_per_1k * requests / 1000
        shm_bound = segment_bytes / MIB + b.shared_slack_mib
        growth[name] = {"rss_mib": round(rss, 1), "rss_mib_at_end": round(last[name]["rss_bytes"] / MIB, 1),
                        "shm_rss_mib": round(shm, 1), "fds": fds, "bound_rss_mib": round(rss_bound, 1),
                        "bound_shm_rss_mib": round(shm_bound, 1), "bound_fds": b.fds}
        if rss > rss_bound:
            exceeded.append(f"{name}: private RSS grew {rss:.1f} MiB over {requests} requests, bound {rss_bound:.1f} MiB")
        if shm > shm_bound:
            exceeded.append(f"{name}: shared RSS grew {shm:.1f} MiB, bound {shm_bound:.1f} MiB (the segment + "
                            f"{b.shared_slack_mib:g})")
        if fds > b.fds:
            exceeded.append(f"{name}: {fds} more open descriptors, bound {b.fds}")
    host = (last["shmem_bytes"] - first["shmem_bytes"]) / MIB
    host_bound = segment_bytes / MIB + HOST_SHM_SLACK_MIB
    growth["host shared memory"] = {"mib": round(host, 1), "bound_mib": round(host_bound, 1)}
    if host > host_bound:
        exceeded.append(f"host shared memory (Shmem) grew {host:.1f} MiB, bound {host_bound:.1f} MiB")
    growth["requests_after_warmup"] = requests
    return growth, exceeded


def judge(outcome: str, counts: dict, verdicts: dict[str, dict], exceeded: list[str]) -> list[str]:
    """Every reason the soak did not pass: an outcome other than ok, a silent corruption,
    a lost request, an oracle whose verdict is not valid (False, or None: unknown), a run
    that sent no request, a growth bound exceeded."""
    out = []
    if counts.get("requests", 0) == 0:
        out.append("no request was sent: nothing was judged")
    if outcome != "ok":
        out.append(f"outcome {outcome}")
    if counts.get("silent_corruptions"):
        out.append(f"{counts['silent_corruptions']} silent corruptions")
    if counts.get("lost_requests"):
        out.append(f"{counts['lost_requests']} lost requests")
    for name, v in verdicts.items():
        if v["valid"] is not True:
            out.append(f"{name}: {'FAIL' if v['valid'] is False else 'unknown (not judged)'}: {v['reason'][:200]}")
    return out + list(exceeded)


def _pids(root: int) -> list[int]:
    """The process and every descendant (a replica: its API server, engine core, workers)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _usage(pid: int) -> tuple[int, int, int]:
    """(private resident bytes, shared-memory resident bytes, open descriptors) of one
    process; zeros if it is gone. Private: anonymous and file-backed pages (RssAnon +
    RssFile); shared: its mapped shared-memory pages (RssShmem: the pool's segment, which
    grows as pages are first written, up to the segment's size)."""
    try:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024
                  for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith(("RssAnon:", "RssFile:", "RssShmem:"))}
        fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return 0, 0, 0
    return fields.get("RssAnon", 0) + fields.get("RssFile", 0), fields.get("RssShmem", 0), fds


def _shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def _sample(cluster) -> dict:  # noqa: ANN001
    row: dict = {"t": round(time.time(), 2), "shmem_bytes": _shmem()}
    procs = {name: r.proc.pid for name, r in cluster.replicas.items() if name in REPLICAS}
    procs["pool"] = cluster.pool.proc.pid
    for name, pid in procs.items():
        rss = shm = fds = 0
        for p in _pids(pid):
            r, s, f = _usage(p)
            rss, shm, fds = rss + r, shm + s, fds + f
        row[name] = {"rss_bytes": rss, "shm_rss_bytes": shm, "fds": fds}
    return row


def _stream(cluster, corpus: Corpus, prefixes: list[str], seed: int, k: int, stop: threading.Event,  # noqa: ANN001
            out: dict) -> None:
    from kvgate.harness.client.http import complete

    rng = random.Random(derive_seed(seed, f"stream:{k}"))
    i = 0
    while not stop.is_set():
        replica = rng.choice(REPLICAS)
        if rng.random() < 0.25:  # a new prefix (the streams share the list: the others may load it)
            prefixes.append(corpus.text(rng.choice(PREFIX_TOKENS), rng))
        recent = prefixes[-RECENT:]
        prefix = recent[-min(int(rng.paretovariate(1.0)), len(recent))]  # the newest most often
        prompt = prefix + " " + corpus.text(rng.randint(1, 120), rng)
        c = complete(cluster.replicas[replica].url, prompt, tag=f"soak-{k}-{i}", replica=replica,
                     max_tokens=rng.randint(1, 8), timeout_s=300)
        out["requests"] += 1
        out["errors"] += c.error is not None
        i += 1


def _nemesis(cluster, seed: int, stop: threading.Event, fired: list) -> None:  # noqa: ANN001
    from kvgate.harness.client.http import reset_prefix_cache
    from kvgate.harness.scenarios.nemesis import arm

    rng = random.Random(derive_seed(seed, "soak:nemesis"))
    n = 0
    while not stop.wait(rng.uniform(5, 15)):
        n += 1
        if rng.random() < 0.3:  # a replica forgets its prefix cache: its next requests load from the pool
            victim = rng.choice(REPLICAS)
            reset_prefix_cache(cluster.replicas[victim].url)
            cluster.nemesis("reset_prefix_cache", replica=victim)
            fired.append({"t": round(time.time(), 2), "fault": "reset_prefix_cache", "replica": victim})
            continue
        sseed = derive_seed(seed, f"soak:fault:{n}")
        if rng.random() < 0.5:
            kind = rng.choice(LOAD_FAULTS)
            arm(cluster, "B", kind=kind, block=rng.randrange(4), seed=rng.randrange(2**32), p=0.5,
                schedule_seed=sseed)
            where = "B"
        else:
            kind = rng.choice(PROXY_FAULTS)
            cluster.arm_proxy("D", {kind: {"ops": ["read", "acquire"], "direction": "reply", "times": 2, "p": 0.5,
                                           "schedule_seed": sseed, "schedule_kind": "soak",
                                           "seed": rng.randrange(2**32)}})
            where = "D"
        fired.append({"t": round(time.time(), 2), "fault": kind, "replica": where})
        stop.wait(rng.uniform(3, 8))
        arm(cluster, "B", None)
        cluster.arm_proxy("D", {})


@dataclasses.dataclass
class Window:
    """One soak window's result (soak_window)."""

    seed: int
    seconds: float
    counts: dict  # requests, errors, faults, loads, silent corruptions, lost, misclassified
    verdicts: dict  # oracle -> {"valid", "reason"}
    outcome: str  # ok | correctness | liveness | crash
    fired: list  # what the nemesis armed, in order
    samples: list  # resource samples (start, every sample_s, end)
    parts: list  # the oracles' verdicts (kvgate.harness.scenarios.runner.ORACLES order)


def soak_window(cluster, corpus: Corpus, seed: int, seconds: float, streams: int = 3,  # noqa: ANN001
                sample_s: float = 15.0, say=None) -> Window:  # noqa: ANN001
    """`streams` seeded request streams and the seeded nemesis on a running default system
    (replicas A, B and D) for `seconds`, then every fault healed and the window judged by
    the oracles; `say(samples, requests, faults)` after each resource sample."""
    from kvgate.harness.checkers import history as H
    from kvgate.harness.checkers.verdict import Verdict
    from kvgate.harness.scenarios.nemesis import arm
    from kvgate.harness.scenarios.runner import ORACLES, _judge, _Run

    rng = random.Random(derive_seed(seed, "soak:prefixes"))
    prefixes = [corpus.text(rng.choice(PREFIX_TOKENS), rng) for _ in range(10)]
    cluster.reset()
    t0 = time.time()
    cluster.nemesis("scenario_start", scenario="soak", seed=seed, params={"seconds": seconds, "streams": streams})
    stop = threading.Event()
    tallies = [{"requests": 0, "errors": 0} for _ in range(streams)]
    fired: list = []
    threads = [threading.Thread(target=_stream, args=(cluster, corpus, prefixes, seed, k, stop, tallies[k]),
                                name=f"soak-stream-{k}") for k in range(streams)]
    threads.append(threading.Thread(target=_nemesis, args=(cluster, seed, stop, fired), name="soak-nemesis"))
    samples = [{**_sample(cluster), "requests": 0}]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(min(sample_s, max(0.0, end - time.monotonic())))
            done = sum(x["requests"] for x in tallies)
            samples.append({**_sample(cluster), "requests": done})
            if say is not None:
                say(seconds - max(0.0, end - time.monotonic()), done, len(fired))
    finally:  # every fault healed, whatever happened
        stop.set()
        for t in threads:
            t.join(600)
        arm(cluster, "B", None)
        cluster.arm_proxy("D", {})
    time.sleep(2.0)
    samples.append({**_sample(cluster), "requests": sum(x["requests"] for x in tallies)})
    cluster.nemesis("scenario_end", scenario="soak", seed=seed, crashed=cluster.crashed())
    time.sleep(0.5)
    history = H.read_history(cluster.history_dir)
    run = _Run(Verdict(True, "the soak ran"), H.within(history, t0, time.time()), H.namespaces(history),
               bool(cluster.crashed()), None)
    parts, outcome = _judge(cluster, run)
    recs = run.recs
    counts = {
        "requests": sum(x["requests"] for x in tallies),
        "request_errors": sum(x["errors"] for x in tallies),
        "faults_armed": sum(1 for f in fired if f["fault"] != "reset_prefix_cache"),
        "prefix_cache_resets": sum(1 for f in fired if f["fault"] == "reset_prefix_cache"),
        "prefixes": len(prefixes),
        "faults_fired": sum(1 for r in recs if r["ev"] == "fault"),
        "loads": sum(1 for r in recs if r["ev"] == "load"),
        "blocks_loaded": sum(int(r.get("loaded") or 0) for r in recs if r["ev"] == "load"),
        "loads_failed": sum(1 for r in recs if r["ev"] == "load" and r.get("miss_cause")),
        "blocks_published": sum(int(r.get("committed") or 0) for r in recs if r["ev"] == "publish"),
        "silent_corruptions": int(parts[ORACLES.index("byte-exact")].evidence.get("silent_corruptions", 0)),
        "lost_requests": int(parts[ORACLES.index("requests")].evidence.get("lost", 0)),
        "misclassified": int(parts[ORACLES.index("miss causes")].evidence.get("misclassified", 0)),
    }
    verdicts = {n: {"valid": p.valid, "reason": p.reason[:300]} for n, p in zip(ORACLES, parts)}
    return Window(seed, seconds, counts, verdicts, outcome, fired, samples, parts)


def soak(report_dir: Path, minutes: float = 10.0, seed: int = 0, streams: int = 3, sample_s: float = 15.0) -> int:
    from kvgate.harness.provenance import provenance
    from kvgate.harness.system.default import start_system
    from kvgate.harness.workload.prompts import Corpus

    def say(elapsed: float, done: int, faults: int) -> None:
        print(f"kvgate soak: {elapsed / 60:.1f} of {minutes} min, {done} requests, {faults} faults",
              file=sys.stderr, flush=True)

    report_dir.mkdir(parents=True, exist_ok=True)
    cluster, model = start_system(report_dir / "system", set(REPLICAS))
    try:
        w = soak_window(cluster, Corpus(model), seed, minutes * 60, streams, sample_s, say)
    finally:
        cluster.stop()
    growth, exceeded = judge_growth(w.samples, cluster.page_size * cluster.pool_pages)
    failures = judge(w.outcome, w.counts, w.verdicts, exceeded)
    ok = not failures
    result = {"pass": ok, "outcome": w.outcome, "minutes": minutes, "seed": seed, "streams": streams,
              "command": f"kvgate soak --minutes {minutes} --seed {seed} --streams {streams}",
              "counts": w.counts, "growth_after_warmup": growth, "bounds": bounds_text(),
              "bounds_exceeded": exceeded, "failures": failures, "verdicts": w.verdicts, "faults": w.fired,
              "samples": w.samples, "provenance": provenance()}
    (report_dir / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (report_dir / "soak.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0 if ok else 1


def _markdown(r: dict) -> str:
    c, g = r["counts"], r["growth_after_warmup"]
    from kvgate.harness.provenance import title_flag

    flag = title_flag(r["provenance"])
    lines = [f"# kvgate soak: {'PASS' if r['pass'] else 'FAIL'}{flag}", "",
             f"`{r['command']}` — {r['provenance'].get('commit', '?')[:12]}{flag}", "",
             "| requests | request errors | faults armed | faults fired | prefix caches emptied | loads | loads "
             "failed | blocks loaded | blocks published | silent corruptions | lost requests | misclassified misses |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|",
             f"| {c['requests']} | {c['request_errors']} | {c['faults_armed']} | {c['faults_fired']} "
             f"| {c['prefix_cache_resets']} | {c['loads']} | {c['loads_failed']} | {c['blocks_loaded']} "
             f"| {c['blocks_published']} | {c['silent_corruptions']} | {c['lost_requests']} | {c['misclassified']} |",
             "", f"Growth from the first sample under load (the warm-up) to the end, over "
             f"{g.get('requests_after_warmup', '?')} requests (private: RssAnon + RssFile of the process tree; "
             "shared: its RssShmem, the pool's segment pages it has touched), each against its bound "
             f"({r.get('bounds', bounds_text())}):", "",
             "| process | private RSS growth (MiB) | bound | private RSS at end (MiB) | shared RSS growth (MiB) "
             "| bound | descriptors growth | bound |", "|---|---|---|---|---|---|---|---|"]
    for name, row in g.items():
        if isinstance(row, dict) and "rss_mib" in row:
            lines.append(f"| {name} | {row['rss_mib']} | {row.get('bound_rss_mib', '-')} | {row['rss_mib_at_end']} "
                         f"| {row['shm_rss_mib']} | {row.get('bound_shm_rss_mib', '-')} | {row['fds']} "
                         f"| {row.get('bound_fds', '-')} |")
    host = g.get("host shared memory", {})
    lines += [f"| host shared memory (Shmem) | | | | {host.get('mib', '-')} | {host.get('bound_mib', '-')} | | |", "",
              "Verdicts: " + "; ".join(f"{n}: " + ("ok" if v["valid"] is True else
                                                   ("FAIL " if v["valid"] is False else "UNKNOWN ") + v["reason"])
                                       for n, v in r["verdicts"].items()), ""]
    if r.get("failures"):
        lines += ["Not a pass:", "", *(f"- {f}" for f in r["failures"]), ""]
    return "\n".join(lines)
