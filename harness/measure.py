"""What a run measured, read back from its history: each request's time to first token by
the kind of hit it got, miss causes and faults over time. The gate writes them next to its
report (`measurements.json`); `kvgate plan` and the HTML report read them.

  samples(recs) -> list[Sample]   one per request that ended (the harness's `request` ok
                                  records), joined with the connector's own records of
                                  the same tag on the same replica:
        kind   cold      nothing reused: no local prefix-cache hit, nothing loaded
               local     a local prefix-cache hit (the engine's own cache), nothing loaded
               remote    blocks loaded from this host's pool (all it claimed)
               tier      blocks loaded from the network tier (another host's publish)
               fallback  a load was claimed and failed: the blocks were recomputed
        Requests of replicas whose connector writes no lookup records (another
        connector) are left out, as are requests that failed.
        `faulted`: between its send and its end a fault fired on its replica, or the
        nemesis acted (on the pool, a store, a host).
  timeline(recs) -> list[dict]    faults fired and nemesis actions, in time order.
  link_rates(recs) -> {source: B/s}  the loads' own rate (bytes / seconds), medians.
  miss_events(recs) -> list[dict] every miss a lookup or a load recorded, with its cause.
  distributions(samples, by_octave=False) -> {kind: {prefix_tokens: {"n", "p50_ms", "p95_ms"}}}
                                  (by_octave: prompt lengths grouped by their nearest power of two)
  measure(history_dir, system) -> dict   all of the above for one system's history.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from pathlib import Path

from kvpool.connector.history import read_history

KINDS = ("cold", "local", "remote", "tier", "fallback")


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float  # when the request ended (epoch seconds)
    system: str
    replica: str
    tag: str
    prompt_tokens: int
    kind: str
    hit_tokens: int  # tokens the replica did not compute: its local hit plus what it loaded
    ttft_ms: float
    miss_cause: str | None  # why the lookup's run stopped, when it did; for a fallback, why its load failed
    faulted: bool = False  # a fault fired on its replica, or the nemesis acted, while it ran
    dispatch_ms: float | None = None  # from its send to its scheduler's first lookup call (front end, queue)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 1]) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _kind(lookup: dict, loads: list[dict]) -> str:
    failed = any(r.get("failed_block_ids") for r in loads)
    if lookup.get("outcome") == "remote_hit":
        if failed:
            return "fallback"
        return "tier" if lookup.get("tier_blocks") else "remote"
    if lookup.get("outcome") == "local_hit" or int(lookup.get("local_tokens") or 0) > 0:
        return "local"
    return "cold"


def samples(recs: list[dict], system: str = "default") -> list[Sample]:
    lookups: dict[tuple[str, str], dict] = {}
    loads: dict[tuple[str, str], list[dict]] = defaultdict(list)
    sent: dict[tuple[str, str], float] = {}
    first: dict[tuple[str, str], dict] = {}  # a request's first lookup record (written after the call)
    # what can touch a request: a fault its own replica's connector or client fired, or the
    # nemesis (which acts on the pool, the store or a host, under every replica)
    faults = [(r["t"], r.get("replica") if r.get("ev") == "fault" else None)
              for r in recs if r.get("ev") in ("fault", "nemesis")]
    out: list[Sample] = []
    for r in recs:  # time order: a request's last lookup before it ended is the one that counted
        ev = r.get("ev")
        if ev == "request" and r.get("phase") == "invoke":
            sent[(str(r.get("replica", "")), str(r["tag"]))] = float(r["t"])
        elif ev == "lookup" and r.get("role") == "scheduler" and r.get("tag") is not None:
            lookups[(r["replica"], str(r["tag"]))] = r
            first.setdefault((r["replica"], str(r["tag"])), r)
        elif ev in ("load", "tier_load") and r.get("tag") is not None:
            loads[(r["replica"], str(r["tag"]))].append(r)
        elif ev == "request" and r.get("phase") == "ok" and not r.get("error") and r.get("ttft_s") is not None:
            key = (str(r.get("replica", "")), str(r["tag"]))
            lk = lookups.pop(key, None)
            if lk is None:
                continue
            its_loads = loads.pop(key, [])
            kind = _kind(lk, its_loads)
            hit = int(lk.get("local_tokens") or 0) + (int(lk.get("external_tokens") or 0) if kind != "fallback" else 0)
            cause = lk.get("miss_cause")
            if kind == "fallback":  # why its load failed, rather than where the lookup's run stopped
                cause = next((x.get("miss_cause") for x in its_loads if x.get("miss_cause")), cause)
            t0 = sent.pop(key, float(r["t"]) - float(r.get("total_s") or 0))
            faulted = any(t0 <= t <= float(r["t"]) and where in (None, key[0]) for t, where in faults)
            seen = first.pop(key, None)
            dispatch = None
            if seen is not None:  # the record is written when the call returns: its start is lookup_us before
                called = float(seen["t"]) - float(seen.get("lookup_us") or 0) / 1e6
                dispatch = round(max(0.0, called - t0) * 1e3, 2)
            out.append(Sample(round(float(r["t"]), 3), system, key[0], key[1], int(lk.get("prompt_tokens") or 0), kind,
                              hit, round(float(r["ttft_s"]) * 1e3, 2), cause, faulted, dispatch))
    return out


def timeline(recs: list[dict]) -> list[dict]:
    out = []
    for r in recs:
        if r.get("ev") == "fault":
            out.append({"t": r["t"], "what": "fault", "kind": str(r.get("kind", "")), "site": str(r.get("site", "")),
                        "replica": r.get("replica", "")})
        elif r.get("ev") == "nemesis":
            out.append({"t": r["t"], "what": "nemesis", "kind": str(r.get("action", "")), "site": "",
                        "replica": r.get("replica", "")})
    return out


def miss_events(recs: list[dict]) -> list[dict]:
    return [{"t": r["t"], "ev": r["ev"], "replica": r.get("replica", ""), "cause": r["miss_cause"]}
            for r in recs if r.get("ev") in ("lookup", "load", "tier_load") and r.get("miss_cause")]


def bucket(tokens: int) -> int:
    """The power of two nearest to a prompt length (in log scale): a run whose prompts are
    not of a few fixed lengths (a gate run's scenarios) is summarized by octave."""
    return 1 << max(0, round(math.log2(max(1, tokens))))


def distributions(found: list[Sample], by_octave: bool = False) -> dict[str, dict[int, dict[str, float]]]:
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for s in found:
        groups[(s.kind, bucket(s.prompt_tokens) if by_octave else s.prompt_tokens)].append(s.ttft_ms)
    out: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for (kind, n), values in sorted(groups.items()):
        out[kind][n] = {"n": len(values), "p50_ms": round(statistics.median(values), 2),
                        "p95_ms": round(percentile(values, 0.95), 2)}
    return dict(out)


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1, "int8": 1, "uint8": 1}


def kv_geometry(recs: list[dict]) -> dict | None:
    """Bytes per token and block size of the run's model, from a connector's namespace
    record: 2 x layers x KV heads x head size x element bytes (dense attention)."""
    for r in recs:
        if r.get("ev") == "namespace" and isinstance(r.get("ns"), dict):
            ns = r["ns"]
            q = DTYPE_BYTES.get(str(ns.get("kv_dtype", "")).removeprefix("torch."))
            if q is None:
                return None
            return {"bytes_per_token": 2 * int(ns["num_layers"]) * int(ns["num_kv_heads"]) * int(ns["head_size"]) * q,
                    "block_size": int(ns["block_size"]), "model_id": ns.get("model_id", "")}
    return None


def link_rates(recs: list[dict]) -> dict[str, float]:
    """Bytes per second of the loads that installed every block they were asked for, by
    source ("remote": this host's pool, "tier": the network tier), medians."""
    block = {r["replica"]: int(r["block_bytes"]) for r in recs if r.get("ev") == "register" and r.get("block_bytes")}
    rates: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        if r.get("ev") in ("load", "tier_load") and r.get("loaded") and not r.get("miss_cause") \
                and r.get("seconds") and r.get("replica") in block:
            rates["tier" if r["ev"] == "tier_load" else "remote"].append(r["loaded"] * block[r["replica"]] / r["seconds"])
    return {k: round(statistics.median(v)) for k, v in rates.items()}


def measure(history_dir: Path, system: str) -> dict:
    recs = read_history(history_dir)
    found = samples(recs, system)
    return {"system": system, "geometry": kv_geometry(recs), "link_Bps": link_rates(recs),
            "samples": [s.as_dict() for s in found], "timeline": timeline(recs), "misses": miss_events(recs)}
