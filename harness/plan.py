"""`kvgate plan`: whether a shared KV pool pays, per request class, from measured numbers.

It reads what a run measured (`Measured`: cold prefill, local hit, remote hit and fallback
recompute TTFT by prefix length, bytes per token, link throughput, the cost of a stalled
load and of publishing) and a request mix (`Mix`: classes with their rate, prefix and tail
lengths and reuse; or a trace of requests, from which the classes, their reuse and their
reuse distance are counted), and writes, per class:

  E[benefit] = h_remote x (T_recompute - T_remote) - P_stall - P_write - P_eviction   (ms per request)

with each term's value and where it came from, then E[total] = sum of rate x E[benefit]
(ms of prefill saved per second), the read and write byte rates R_read / R_write /
R_total against the measured throughput, the rule "p95 remote < p50 cold" per measured
prefix length, the effective capacity and each class's reuse distance against it, the
warm-up cost N x W / dt against the measured throughput, and a recommendation (remote loads
on or off per class, the publish boundary, load limits). JSON, and Markdown by
kvgate.harness.report.plan.markdown (which reads the document and imports nothing of this module).

The model (the terms, each a function of measured inputs):
  T_recompute(L), T_remote(L)   medians at prefix length L, interpolated linearly between
                                measured lengths (extrapolated from the nearest two, and
                                flagged, outside them).
  retention                     LRU by Che's approximation: a block re-requested every
                                `reuse_interval_s` stays with probability
                                1 - exp(-T_c / interval), where T_c = C_eff / (bytes written
                                per second) is the pool's characteristic time.
  h_remote = reuse x retention  `reuse`: the share of the class's requests whose prefix
                                another replica computed before.
  P_stall = h x p_fault x penalty
                                penalty: a faulted load's TTFT minus the cold TTFT, measured
                                (bench hosts' degraded store, or the gate's fallbacks).
  P_write = (1 - reuse) x (publishing's own TTFT ratio - 1) x T_recompute(L)
                                the publish of blocks nobody reads (bench publish).
  P_eviction                    what the other classes' benefit loses to this class's writes:
                                their benefit with and without its write stream, per request of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvgate.harness.measure import distributions
from kvgate.harness.report.plan import markdown

KINDS_REMOTE = ("remote", "tier")


class PlanInputError(ValueError):
    """A measurement or mix file kvgate plan cannot use, with the file and the field."""


# -- measured -------------------------------------------------------------------------------


@dataclasses.dataclass
class Measured:
    """Distributions by prefix length: {kind: {L: {"p50_ms", "p95_ms", "n"}}}, kinds cold,
    local, remote (this host's pool), tier (another host's, over the network), fallback."""

    by_kind: dict[str, dict[int, dict[str, float]]] = dataclasses.field(default_factory=dict)
    bytes_per_token: float | None = None
    block_size: int | None = None
    throughput_Bps: dict[str, float] = dataclasses.field(default_factory=dict)  # "remote" / "tier"
    stall: dict[str, Any] | None = None  # {"penalty_ms", "prefix_tokens", "source"}
    publish_overhead: dict[int, float] = dataclasses.field(default_factory=dict)  # L -> own TTFT ratio - 1
    sources: list[str] = dataclasses.field(default_factory=list)

    def merge_row(self, kind: str, length: int, p50: float | None, p95: float | None, n: int) -> None:
        if p50 is None:
            return
        self.by_kind.setdefault(kind, {})[int(length)] = {"n": n, "p50_ms": float(p50),
                                                          "p95_ms": float(p95 if p95 is not None else p50)}

    def at(self, kind: str, length: int, q: str = "p50_ms") -> tuple[float | None, str]:
        """The kind's `q` at `length`, interpolated; and how ("measured", "interpolated",
        "extrapolated", or "none")."""
        rows = self.by_kind.get(kind) or {}
        if not rows:
            return None, "none"
        xs = sorted(rows)
        if length in rows:
            return rows[length][q], "measured"
        if len(xs) == 1:
            x = xs[0]  # one point: scale with length (prefill and transfer grow at least linearly)
            return rows[x][q] * length / x, "extrapolated"
        if length < xs[0]:  # below the shortest: in proportion to it (a line through two points can go negative)
            return rows[xs[0]][q] * length / xs[0], "extrapolated"
        if length > xs[-1]:  # past the longest: the last two points' line, at least in proportion
            a, b = xs[-2], xs[-1]
            ya, yb = rows[a][q], rows[b][q]
            return max(ya + (yb - ya) * (length - a) / (b - a), yb * length / b), "extrapolated"
        hi = next(i for i, x in enumerate(xs) if x > length)
        a, b = xs[hi - 1], xs[hi]
        ya, yb = rows[a][q], rows[b][q]
        return ya + (yb - ya) * (length - a) / (b - a), "interpolated"


_REPO = Path(__file__).resolve().parent.parent


def _shown(path: Path) -> str:
    """A path as a report shows it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(_REPO))
    except ValueError:
        return str(path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanInputError(f"{path}: cannot read as JSON: {exc}") from exc


def _pick(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def load_measured(paths: list[Path]) -> Measured:
    """Any mix of: a gate run's measurements.json (kvgate.harness.measure), `kvgate bench hosts`,
    `bench live`, `bench publish` and `bench pool` JSON. Later files add to earlier ones."""
    m = Measured()
    for path in paths:
        doc = _read_json(path)
        if not isinstance(doc, dict):
            raise PlanInputError(f"{path}: not a JSON object")
        m.sources.append(_shown(path))
        if "systems" in doc:
            _from_gate(m, doc, path)
        elif "rows" in doc and doc["rows"] and "cross_host_hit_ttft_ms" in doc["rows"][0]:
            _from_hosts(m, doc)
        elif "rows" in doc and doc["rows"] and "remote_hit_ttft_ms" in doc["rows"][0]:
            _from_live(m, doc)
        elif "rows" in doc and doc["rows"] and "own_ttft_publish_vs_none" in doc["rows"][0]:
            for row in doc["rows"]:
                m.publish_overhead[int(row["prompt_tokens"])] = max(0.0, float(row["own_ttft_publish_vs_none"]) - 1)
        elif "sizes" in doc and "lookup_p99_us" in doc:
            gbps = (doc["sizes"].get("16MiB") or {}).get("load_GBps")
            if gbps:
                m.throughput_Bps.setdefault("remote", float(gbps) * 1e9)
        else:
            raise PlanInputError(f"{path}: not a measurements.json nor a bench hosts / live / publish / pool JSON")
    if not m.by_kind.get("cold"):
        raise PlanInputError(f"no cold prefill measured in {', '.join(m.sources) or 'no file'}: the benefit of a "
                             "hit is measured against it")
    return m


def _from_gate(m: Measured, doc: dict, path: Path) -> None:
    from kvgate.harness.measure import Sample, bucket

    found = [Sample(**s) for sysdoc in doc["systems"] for s in sysdoc.get("samples", [])]
    healthy = [s for s in found if not s.faulted and s.kind != "fallback"]  # a gate run is mostly faults
    for kind, rows in distributions(healthy, by_octave=True).items():  # a gate run's prompts vary in length
        for length, d in rows.items():
            m.merge_row(kind, length, d["p50_ms"], d["p95_ms"], int(d["n"]))
    for sysdoc in doc["systems"]:
        g = sysdoc.get("geometry") or {}
        if g and m.bytes_per_token is None:
            m.bytes_per_token, m.block_size = float(g["bytes_per_token"]), int(g["block_size"])
        for source, rate in (sysdoc.get("link_Bps") or {}).items():
            m.throughput_Bps.setdefault(source, float(rate))
    fallbacks = [s for s in found if s.kind == "fallback"]
    if fallbacks and m.stall is None:  # each fallback's TTFT against the cold median at its length
        pen = []
        for s in fallbacks:
            cold, _ = m.at("cold", bucket(s.prompt_tokens))
            if cold is not None:
                pen.append(s.ttft_ms - cold)
        if pen:
            m.stall = {"penalty_ms": round(max(0.0, statistics.median(pen)), 2), "prefix_tokens": None,
                       "source": f"{path}: median of {len(pen)} fallback recomputes' TTFT minus cold"}


def _from_hosts(m: Measured, doc: dict) -> None:
    for row in doc["rows"]:
        L, n = int(row["prefix_tokens"]), int(row.get("runs", 0))
        m.merge_row("cold", L, _pick(row, "cold_prefill_ms"), _pick(row, "cold_prefill_ms_p95"), n)
        m.merge_row("local", L, _pick(row, "local_hit_ttft_ms"), _pick(row, "local_hit_ttft_ms_p95"), n)
        m.merge_row("remote", L, _pick(row, "same_host_hit_ttft_ms"), _pick(row, "same_host_hit_ttft_ms_p95"), n)
        m.merge_row("tier", L, _pick(row, "cross_host_hit_ttft_ms"), _pick(row, "cross_host_hit_ttft_ms_p95"), n)
        if row.get("kv_bytes") and m.bytes_per_token is None:
            m.bytes_per_token = float(row["kv_bytes"]) / L
    rates = [float(r["tier_mb_per_s"]) for r in doc["rows"] if r.get("tier_mb_per_s")]
    if rates:
        m.throughput_Bps["tier"] = statistics.median(rates) * 1e6
    faults = doc.get("faults") or {}
    rows = faults.get("rows") or {}
    if "degraded_first" in rows and "cold" in rows:
        pen = float(rows["degraded_first"]["ttft_ms"]) - float(rows["cold"]["ttft_ms"])
        m.stall = {"penalty_ms": round(max(0.0, pen), 2), "prefix_tokens": int(faults.get("prefix_tokens", 0)),
                   "source": "bench hosts: the first request after the store host degraded, minus cold"}
    block = (doc.get("settings") or {}).get("block_size")
    if block and m.block_size is None:
        m.block_size = int(block)


def _from_live(m: Measured, doc: dict) -> None:
    for row in doc["rows"]:
        L, n = int(row["prefix_tokens"]), int(row.get("runs", 0))
        m.merge_row("cold", L, _pick(row, "cold_prefill_ms"), _pick(row, "cold_prefill_ms_p95"), n)
        m.merge_row("local", L, _pick(row, "local_hit_ttft_ms"), _pick(row, "local_hit_ttft_ms_p95"), n)
        m.merge_row("remote", L, _pick(row, "remote_hit_ttft_ms"), _pick(row, "remote_hit_ttft_ms_p95"), n)
        if row.get("kv_bytes_per_token") and m.bytes_per_token is None:
            m.bytes_per_token = float(row["kv_bytes_per_token"])


# -- the request mix --------------------------------------------------------------------------


@dataclasses.dataclass
class RequestClass:
    name: str
    rate_rps: float
    prefix_tokens: int  # the shared prefix: what another replica may have computed
    tail_tokens: int = 0  # the request's own part after it (never shared)
    reuse: float = 0.0  # share of requests whose prefix another replica computed before
    reuse_interval_s: float = 60.0  # time between two requests of the same prefix
    publish: bool = True  # whether its prefix blocks are published
    source: str = "remote"  # where its hits come from: "remote" (this host's pool) or "tier"
    reuse_distance_bytes: float | None = None  # measured from a trace, if there was one


@dataclasses.dataclass
class Mix:
    classes: list[RequestClass]
    capacity_bytes: float
    reserved_bytes: float = 0.0
    active_decode_bytes: float = 0.0
    page_bytes: float | None = None  # a pool page; a block smaller than it wastes the rest
    load_fault_rate: float = 0.0
    warmup: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""
    block_size: int | None = None  # the engine's block, where the measurements do not say


_CLASS_FIELDS = {f.name for f in dataclasses.fields(RequestClass)}


def load_mix(path: Path) -> Mix:
    """A JSON or TOML mix file: {"classes": [...], "pool": {...}, "load_fault_rate", "warmup"};
    or a JSON-lines trace (`.jsonl`): one request per line, {"t", "prefix", "prefix_tokens",
    "tail_tokens", "replica"}, with a first line {"pool": {...}} allowed."""
    if path.suffix == ".jsonl":
        return _mix_from_trace(path)
    try:
        doc = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PlanInputError(f"{path}: cannot read the mix: {exc}") from exc
    classes = []
    for i, c in enumerate(doc.get("classes") or []):
        unknown = set(c) - _CLASS_FIELDS
        if unknown:
            raise PlanInputError(f"{path}: class {i} has unknown fields {sorted(unknown)}; known {sorted(_CLASS_FIELDS)}")
        try:
            rc = RequestClass(**c)
        except TypeError as exc:
            raise PlanInputError(f"{path}: class {i}: {exc}") from exc
        _check_class(path, rc)
        classes.append(rc)
    if not classes:
        raise PlanInputError(f"{path}: no classes")
    return _mix(path, doc, classes)


def _check_class(path: Path, c: RequestClass) -> None:
    if c.rate_rps < 0 or c.prefix_tokens < 0 or c.tail_tokens < 0 or c.reuse_interval_s <= 0:
        raise PlanInputError(f"{path}: class {c.name!r}: rates, lengths and the reuse interval must be positive")
    if not 0.0 <= c.reuse <= 1.0:
        raise PlanInputError(f"{path}: class {c.name!r}: reuse {c.reuse} is not a share in [0, 1]")
    if c.source not in KINDS_REMOTE:
        raise PlanInputError(f"{path}: class {c.name!r}: source {c.source!r} is not one of {KINDS_REMOTE}")


def _mix(path: Path, doc: dict, classes: list[RequestClass]) -> Mix:
    pool = doc.get("pool") or {}
    if "capacity_bytes" not in pool:
        raise PlanInputError(f"{path}: pool.capacity_bytes is required (the pool's physical capacity)")
    return Mix(classes, float(pool["capacity_bytes"]), float(pool.get("reserved_bytes", 0)),
               float(pool.get("active_decode_bytes", 0)), pool.get("page_bytes"),
               float(doc.get("load_fault_rate", 0.0)), dict(doc.get("warmup") or {}), _shown(path),
               int(doc["block_size"]) if doc.get("block_size") else None)


def _mix_from_trace(path: Path) -> Mix:
    """Classes from a trace, one per prefix: its rate over the trace's span, its reuse (the
    share of its requests that came after another replica had computed it), its mean reuse
    interval and its reuse distance: the bytes of other prefixes first seen between two of
    its requests (the unique KV written meanwhile), median over its reuses (x bytes per
    token at planning time; counted here in tokens)."""
    head: dict = {}
    reqs = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                r = json.loads(line)
                if "pool" in r and "t" not in r:
                    head = r
                    continue
                for key in ("t", "prefix", "prefix_tokens"):
                    if key not in r:
                        raise PlanInputError(f"{path}:{n}: a trace request needs {key!r}")
                reqs.append(r)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanInputError(f"{path}: cannot read the trace: {exc}") from exc
    if not reqs:
        raise PlanInputError(f"{path}: no requests")
    reqs.sort(key=lambda r: r["t"])
    span = max(1e-9, reqs[-1]["t"] - reqs[0]["t"])
    seen_by: dict[str, set] = defaultdict(set)
    last_t: dict[str, float] = {}
    written_at_last: dict[str, int] = {}
    written = 0  # unique prefix tokens first seen so far
    stats: dict[str, dict] = defaultdict(lambda: {"n": 0, "reused": 0, "gaps": [], "dist": [], "tail": []})
    for r in reqs:
        p, replica = str(r["prefix"]), str(r.get("replica", ""))
        st = stats[p]
        st["n"] += 1
        st["tokens"] = int(r["prefix_tokens"])
        st["tail"].append(int(r.get("tail_tokens", 0)))
        if seen_by[p] - {replica}:
            st["reused"] += 1
        if p in last_t:
            st["gaps"].append(r["t"] - last_t[p])
            st["dist"].append(written - written_at_last[p])
        else:
            written += int(r["prefix_tokens"])
        seen_by[p].add(replica)
        last_t[p], written_at_last[p] = r["t"], written
    classes = []
    for p, st in stats.items():
        classes.append(RequestClass(
            name=p, rate_rps=st["n"] / span, prefix_tokens=st["tokens"],
            tail_tokens=int(statistics.median(st["tail"])), reuse=st["reused"] / st["n"],
            reuse_interval_s=statistics.mean(st["gaps"]) if st["gaps"] else span,
            reuse_distance_bytes=float(statistics.median(st["dist"])) if st["dist"] else None))
    return _mix(path, head or {"pool": {}}, classes)


# -- the model ------------------------------------------------------------------------------


def _floor_blocks(tokens: int, block: int | None) -> int:
    return tokens if not block else tokens // block * block


def effective_capacity(mix: Mix, m: Measured) -> dict[str, float]:
    frag = 0.0
    if mix.page_bytes and m.bytes_per_token and m.block_size:
        block_bytes = m.bytes_per_token * m.block_size
        if block_bytes < mix.page_bytes:
            frag = (mix.capacity_bytes - mix.reserved_bytes - mix.active_decode_bytes) * (1 - block_bytes / mix.page_bytes)
    eff = max(0.0, mix.capacity_bytes - mix.reserved_bytes - mix.active_decode_bytes - frag)
    return {"physical": mix.capacity_bytes, "reserved": mix.reserved_bytes, "active_decode": mix.active_decode_bytes,
            "fragmentation": round(frag), "effective": round(eff)}


def _benefit(c: RequestClass, m: Measured, write_Bps: float, cap: float, bpt: float, block: int | None,
             fault_rate: float) -> dict[str, Any]:
    L = _floor_blocks(c.prefix_tokens, block)
    t_re, how_re = m.at("cold", L)
    t_rm, how_rm = m.at(c.source, L)
    if t_rm is None and c.source == "tier":
        t_rm, how_rm = m.at("remote", L)
    t_c = cap / write_Bps if write_Bps > 0 else math.inf  # Che's characteristic time
    retention = 1.0 if math.isinf(t_c) else 1.0 - math.exp(-t_c / c.reuse_interval_s)
    h = c.reuse * retention
    gain = h * ((t_re or 0.0) - (t_rm if t_rm is not None else (t_re or 0.0)))
    stall = 0.0
    stall_src = "no fault rate in the mix"
    if fault_rate > 0 and m.stall is not None:
        stall = h * fault_rate * m.stall["penalty_ms"]
        stall_src = f"{fault_rate} x {m.stall['penalty_ms']} ms ({m.stall['source']})"
    over = _nearest(m.publish_overhead, L)
    write = (1 - c.reuse) * over * (t_re or 0.0) if c.publish and over is not None else 0.0
    return {"prefix_tokens_useful": L, "T_recompute_ms": _r(t_re), "T_recompute_how": how_re,
            "T_remote_ms": _r(t_rm), "T_remote_how": how_rm, "retention": round(retention, 4),
            "characteristic_time_s": None if math.isinf(t_c) else round(t_c, 2), "h_remote": round(h, 4),
            "gain_ms": round(gain, 3), "P_stall_ms": round(stall, 3), "P_stall_source": stall_src,
            "P_write_ms": round(write, 3),
            "P_write_source": "no bench publish measured" if over is None else
            f"(1 - reuse) x publishing's own TTFT overhead {over:.3f} x T_recompute (bench publish)",
            "load_bytes": L * bpt}


def _nearest(d: dict[int, float], L: int) -> float | None:
    if not d:
        return None
    return d[min(d, key=lambda x: abs(x - L))]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _write_rate(classes: list[RequestClass], h: dict[str, float], bpt: float, block: int | None) -> float:
    """Bytes per second of pages written: the published prefixes of requests that did not hit."""
    return sum(c.rate_rps * (1 - h.get(c.name, 0.0)) * _floor_blocks(c.prefix_tokens, block) * bpt
               for c in classes if c.publish)


def _solve(classes: list[RequestClass], m: Measured, cap: float, bpt: float, block: int | None,
           fault_rate: float) -> dict[str, dict]:
    """h depends on retention, retention on the write rate, the write rate on h: iterate."""
    h: dict[str, float] = {}
    rows: dict[str, dict] = {}
    for _ in range(50):
        w = _write_rate(classes, h, bpt, block)
        rows = {c.name: _benefit(c, m, w, cap, bpt, block, fault_rate) for c in classes}
        new = {n: r["h_remote"] for n, r in rows.items()}
        if all(abs(new[n] - h.get(n, -1)) < 1e-6 for n in new):
            break
        h = new
    return rows


def plan(m: Measured, mix: Mix, _applied: bool = False) -> dict[str, Any]:
    bpt = m.bytes_per_token
    if not bpt:
        raise PlanInputError("no bytes per token measured (a gate run's namespace or a bench's kv_bytes)")
    block = m.block_size or mix.block_size
    if m.block_size is None:
        m.block_size = block
    cap = effective_capacity(mix, m)
    rows = _solve(mix.classes, m, cap["effective"], bpt, block, mix.load_fault_rate)
    for c in mix.classes:  # P_eviction: the others' gain with and without this class's writes
        others = [o for o in mix.classes if o.name != c.name]
        if not c.publish or not others or c.rate_rps <= 0:
            rows[c.name]["P_eviction_ms"] = 0.0
            continue
        without = _solve([*others, dataclasses.replace(c, publish=False)], m, cap["effective"], bpt, block,
                         mix.load_fault_rate)
        lost = sum(o.rate_rps * (without[o.name]["gain_ms"] - rows[o.name]["gain_ms"]) for o in others)
        rows[c.name]["P_eviction_ms"] = round(max(0.0, lost) / c.rate_rps, 3)
    classes = []
    total = 0.0
    r_read = r_write = 0.0
    h = {n: r["h_remote"] for n, r in rows.items()}
    write_Bps = _write_rate(mix.classes, h, bpt, block)
    for c in mix.classes:
        r = rows[c.name]
        e = r["gain_ms"] - r["P_stall_ms"] - r["P_write_ms"] - r["P_eviction_ms"]
        total += c.rate_rps * e
        read = c.rate_rps * r["h_remote"] * r["load_bytes"]
        write = c.rate_rps * (1 - r["h_remote"]) * r["load_bytes"] if c.publish else 0.0
        r_read += read
        r_write += write
        reuse_distance = c.reuse_distance_bytes * bpt if c.reuse_distance_bytes is not None else write_Bps * c.reuse_interval_s
        verdict = _rule_at(m, c.source, r["prefix_tokens_useful"])
        classes.append({
            "name": c.name, "rate_rps": c.rate_rps, "prefix_tokens": c.prefix_tokens, "tail_tokens": c.tail_tokens,
            "reuse": c.reuse, "reuse_interval_s": c.reuse_interval_s, "source": c.source, **r,
            "E_benefit_ms": round(e, 3),
            "R_read_Bps": round(read), "R_write_Bps": round(write),
            "reuse_distance_bytes": round(reuse_distance),
            "reuse_distance_vs_capacity": round(reuse_distance / cap["effective"], 3) if cap["effective"] else None,
            "reuse_distance_source": "trace (unique prefixes first seen between two of its requests)"
            if c.reuse_distance_bytes is not None else "write rate x reuse interval",
            "p95_remote_below_p50_cold": verdict,
            "load_concurrency": round(c.rate_rps * r["h_remote"] * (r["T_remote_ms"] or 0) / 1e3, 3),
        })
    thr = {k: v for k, v in m.throughput_Bps.items()}
    link = thr.get("tier") if any(c.source == "tier" for c in mix.classes) else thr.get("remote")
    rules = [{"prefix_tokens": L, "kind": kind, "p95_remote_ms": m.by_kind[kind][L]["p95_ms"],
              "p50_cold_ms": m.by_kind["cold"][L]["p50_ms"],
              "holds": m.by_kind[kind][L]["p95_ms"] < m.by_kind["cold"][L]["p50_ms"]}
             for kind in KINDS_REMOTE for L in sorted(m.by_kind.get(kind, {})) if L in m.by_kind["cold"]]
    doc = {
        "classes": classes,
        "E_total_ms_per_s": round(total, 2),
        "rates": {"R_read_Bps": round(r_read), "R_write_Bps": round(r_write), "R_replica_Bps": 0,
                  "R_total_Bps": round(r_read + r_write), "link_Bps": round(link) if link else None,
                  "utilization": round((r_read + r_write) / link, 4) if link else None},
        "capacity": cap,
        "rule_p95_remote_below_p50_cold": rules,
        "warmup": _warmup(mix, m, classes, link),
        "recommendation": _recommend(mix, classes, link, r_read + r_write),
        "inputs": {"measured": m.sources, "mix": mix.source, "bytes_per_token": bpt, "block_size": block,
                   "throughput_Bps": thr, "stall": m.stall, "load_fault_rate": mix.load_fault_rate},
    }
    if not _applied:  # the same mix with the recommendation applied: the sign can change for the others too
        rec = doc["recommendation"]
        on = set(rec["remote_loads_on"])
        applied = dataclasses.replace(mix, classes=[dataclasses.replace(
            c, reuse=c.reuse if c.name in on else 0.0,
            publish=c.publish and rec["publish_boundary_tokens"][c.name] > 0) for c in mix.classes])
        after = plan(m, applied, _applied=True)
        rec["E_total_ms_per_s_applied"] = after["E_total_ms_per_s"]
        rec["E_benefit_ms_applied"] = {c["name"]: c["E_benefit_ms"] for c in after["classes"]}
    return doc


def _rule_at(m: Measured, kind: str, L: int) -> bool | None:
    """p95 of the remote hit below p50 of cold at the measured length nearest to L."""
    rows = m.by_kind.get(kind) or {}
    common = [x for x in rows if x in m.by_kind.get("cold", {})]
    if not common:
        return None
    x = min(common, key=lambda v: abs(v - L))
    return rows[x]["p95_ms"] < m.by_kind["cold"][x]["p50_ms"]


def _warmup(mix: Mix, m: Measured, classes: list[dict], link: float | None) -> dict[str, Any] | None:
    w = mix.warmup
    if not w:
        return None
    n, dt = int(w.get("new_replicas", 0)), float(w.get("window_s", 60))
    hot = [c for c in classes if c["name"] in set(w.get("hot_classes") or [c["name"] for c in classes])]
    W = sum(c["load_bytes"] for c in hot)
    need = n * W / dt if dt > 0 else math.inf
    recompute_s = sum((c["T_recompute_ms"] or 0) for c in hot) / 1e3  # each new replica computes each hot prefix once
    load_s = n * W / link if link else None
    return {"new_replicas": n, "window_s": dt, "hot_bytes": round(W), "needed_Bps": round(need),
            "link_Bps": round(link) if link else None, "fits": bool(link and need <= link),
            "seconds_to_load_all": round(load_s, 3) if load_s is not None else None,
            "seconds_to_recompute_per_replica": round(recompute_s, 3),
            "cheaper": None if load_s is None else ("load" if load_s / max(1, n) < recompute_s else "recompute")}


def _recommend(mix: Mix, classes: list[dict], link: float | None, r_total: float) -> dict[str, Any]:
    enable = [c["name"] for c in classes if c["E_benefit_ms"] > 0 and c["p95_remote_below_p50_cold"] is not False]
    off = [c["name"] for c in classes if c["name"] not in enable]
    publish = {c["name"]: (c["prefix_tokens_useful"] if c["name"] in enable and c["reuse"] > 0 else 0)
               for c in classes}
    rec: dict[str, Any] = {"remote_loads_on": enable, "remote_loads_off": off,
                           "publish_boundary_tokens": publish, "why": {}}
    for c in classes:
        if c["name"] in enable:
            rec["why"][c["name"]] = (f"saves {c['E_benefit_ms']} ms per request (h_remote {c['h_remote']}, "
                                     f"{c['T_recompute_ms']} -> {c['T_remote_ms']} ms)")
        elif c["p95_remote_below_p50_cold"] is False:
            rec["why"][c["name"]] = "remote p95 is not below cold p50 at this length: recompute"
        else:
            rec["why"][c["name"]] = f"E[benefit] {c['E_benefit_ms']} ms <= 0: recompute"
    conc = sum(c["load_concurrency"] for c in classes if c["name"] in enable)
    rec["load_limit_concurrent"] = max(1, math.ceil(2 * conc))  # twice Little's law's mean, a burst's headroom
    rec["load_limit_note"] = (f"Little's law: {conc:.2f} loads in flight on average; limit at twice that "
                              "(the pool's --max-loads), so a burst queues instead of saturating the link")
    if link:
        rec["link_headroom"] = round(1 - r_total / link, 4)
    return rec


# -- output ---------------------------------------------------------------------------------


DEFAULT_MIX = Path(__file__).resolve().parent.parent / "fixtures" / "plan" / "mix.json"


def default_measured() -> list[Path]:
    """The latest gate run's measurements if there is one, else the committed bench reports."""
    root = Path(__file__).resolve().parent.parent
    latest = root / "reports" / "runs" / "latest" / "measurements.json"
    if latest.exists():
        return [latest]
    bench = root / "reports" / "bench"
    picks = []
    for pattern in ("*-hosts.json", "*-publish.json", "*-pool.json"):
        found = sorted(bench.glob(pattern))
        if found:
            picks.append(found[-1])
    return picks


def run_plan(measured: list[Path], mix_path: Path, out_json: Path | None, out_md: Path | None,
             out_html: Path | None = None) -> int:
    m = load_measured(measured or default_measured())
    mix = load_mix(mix_path)
    doc = plan(m, mix)
    from kvgate.harness.provenance import provenance

    doc["provenance"] = provenance()
    md = markdown(doc)
    if out_json:
        out_json.write_text(json.dumps(doc, indent=1))
    if out_md:
        out_md.write_text(md)
    if out_html:
        from kvgate.harness.report.html import plan_report

        out_html.write_text(plan_report(doc))
    print(md)
    return 0
