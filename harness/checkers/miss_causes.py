"""The miss-cause oracle: every lookup is a hit or exactly one known cause; every load
accounts for each block (loaded or failed) and names its cause when short; every injected
fault is followed by a load of that replica ending in the fault's expected cause, and no
load ends short without an injected fault to explain it (a pool-side nemesis explains
transport errors while the pool is down).

Which load a firing struck: one of its replica that ended after it; where the firing names
the block it struck (its index in the lease), a load with at least that many blocks, and
first the one that ended with the expected cause at that very block (a shorter load that
happened to end just after the firing is not it: the campaign's soak seed
7303238380334646157, a one-block load ending 1 ms after a timeout firing at block 3). A
corruption written into a page of the pool's shared segment (site pool_arena.page) is in
that page for every reader until its heal: a corrupt load of another replica that read the
same page in that span is explained by it (soak seed 7080717195702607883: B's firing, D's
load of the same page 4 ms later): the load must name the page (its error's "(page N)"), and a
corruption with no heal on record lasts at most SHARED_SPAN_MAX_S. Pages are not told apart by
tenant (the records do not say which segment): a page number of one tenant's segment explains the
same number of another's, within that span.

  miss_causes(recs) -> Verdict
  expected_causes(recs, load_causes, lookup_causes, load_causes_allowed=()) -> Verdict
                     a scenario's declared causes: its loads end in exactly `load_causes`
                     (complete loads aside); its lookups show at least `lookup_causes`
  EXPECTED_CAUSE     fault kind (as injectors record it) -> the cause it must produce
"""

from __future__ import annotations

import re
from collections import Counter

from kvgate.harness.checkers.verdict import Verdict
from kvpool.errors import MissCause

LOOKUP_OUTCOMES = {"local_hit", "remote_hit", "miss", "skipped"}
CAUSES = {c.value for c in MissCause}
# the cause each injected fault must produce in the load it strikes (None: no miss at all)
EXPECTED_CAUSE: dict[str, str | None] = {
    "corrupt": "corrupt", "transport_error": "transport_error", "timeout": "timeout", "evict": "evicted",
    "stream_delay": None, "load_delay": None, "copier_control": None, "lease_hold": None,
    # the transport proxy (kvgate.faults.proxy)
    "reset": "transport_error", "truncate": "transport_error", "drop_reply": "timeout", "stall": "timeout",
    "bitflip": "corrupt", "slow": None,
}


def miss_causes(recs: list[dict]) -> Verdict:
    bad: list[str] = []
    lookups = [r for r in recs if r["ev"] == "lookup"]
    loads = [r for r in recs if r["ev"] == "load"]
    for r in lookups:
        if r["outcome"] not in LOOKUP_OUTCOMES:
            bad.append(f"lookup {r['tag']}: outcome {r['outcome']!r}")
        elif r["outcome"] == "miss" and r.get("miss_cause") not in CAUSES:
            bad.append(f"lookup {r['tag']}: a miss without one known cause ({r.get('miss_cause')!r})")
    for r in loads:
        if r["loaded"] + len(r["failed_block_ids"]) != r["blocks"]:
            bad.append(f"load {r['tag']}: {r['loaded']} loaded + {len(r['failed_block_ids'])} failed != {r['blocks']}")
        if r["loaded"] < r["blocks"] and r.get("miss_cause") not in CAUSES:
            bad.append(f"load {r['tag']}: short without one known cause ({r.get('miss_cause')!r})")
        if r["loaded"] == r["blocks"] and r.get("miss_cause"):
            bad.append(f"load {r['tag']}: complete but names a cause ({r['miss_cause']})")
    # injected faults and the loads they strike, per replica, in time order
    faults = [r for r in recs if r["ev"] == "fault"]
    explained: set[int] = set()
    ended: set[int] = set()  # loads a firing with a cause has ended
    for f in faults:
        kind = f["kind"]
        if f.get("job") in ("store", "report"):
            continue  # store-side faults (and a control's report) strike no load
        if kind not in EXPECTED_CAUSE:
            bad.append(f"fault {kind!r} on {f['replica']}: no expected cause is declared for it")
            continue
        want = EXPECTED_CAUSE[kind]
        # A firing that ends a load (a cause) strikes one load: a load another such firing already
        # ended is not this one's (two loads of one replica running at once, each struck, end in
        # either order). Firings that end nothing (a slow frame, a delay) may strike one load many times.
        after = [r for r in loads if r["replica"] == f["replica"] and r["t"] >= f["t"] - 1e-3
                 and (f.get("tag") is None or r["tag"] == f["tag"]) and (want is None or id(r) not in ended)
                 and (f.get("block") is None or r["blocks"] > f["block"])]
        if not after:
            bad.append(f"fault {kind} on {f['replica']} at {f['t']:.3f}: no load followed it")
            continue
        hit = next((r for r in after if _running_at(f, r) and _ended_there(f, r, want)), after[0])
        if want is not None:
            ended.add(id(hit))
        if hit.get("miss_cause") != want:
            bad.append(f"fault {kind} on {f['replica']}: load {hit['tag']} ended as {hit.get('miss_cause')!r}, "
                       f"expected {want!r}")
        elif want is not None and not _ended_there(f, hit, want):
            bad.append(f"fault {kind} on {f['replica']}: load {hit['tag']} ended {want} at block "
                       f"{hit['miss_index'] - hit.get('first_block', 0)}, the firing struck block {f['block']}")
        explained.add(id(hit))
    down = _pool_down_intervals(recs)
    shared = _shared_page_spans(recs, faults)
    for r in loads:
        if r["loaded"] < r["blocks"] and id(r) not in explained and not _within(r["t"], down) \
                and not _read_a_corrupted_page(r, shared):
            bad.append(f"load {r['tag']} on {r['replica']}: {r.get('miss_cause')} with no injected fault to explain it")
    for r in lookups:
        if r.get("miss_cause") == "transport_error" and not _within(r["t"], down) \
                and not any(f["replica"] == r["replica"] and f["t"] <= r["t"] for f in faults):
            bad.append(f"lookup {r['tag']} on {r['replica']}: transport_error with the pool up and no fault injected")
    causes = Counter(r.get("miss_cause") for r in lookups if r.get("miss_cause"))
    causes_loads = Counter(r.get("miss_cause") for r in loads if r.get("miss_cause"))
    evidence = {"lookups": len(lookups), "loads": len(loads), "faults": len(faults), "misclassified": len(bad),
                "lookup_causes": dict(causes), "load_causes": dict(causes_loads), "first": bad[:5]}
    not_checked = "the pool's own counters (the oracle's lookups move them too); causes of local-only requests"
    if bad:
        return Verdict(False, f"{len(bad)} misclassified: {bad[0]}", evidence, not_checked)
    return Verdict(True, f"{len(lookups)} lookups and {len(loads)} loads each end in a hit or exactly one cause; "
                   f"{len(explained)} injected faults each produced their expected cause", evidence, not_checked)


def _running_at(f: dict, r: dict) -> bool:
    """Load r was under way when firing f fired (where its record says how long it ran)."""
    return "seconds" not in r or r["t"] - float(r["seconds"]) <= f["t"] + 1e-3


def _ended_there(f: dict, r: dict, want: str | None) -> bool:
    """Load r ended with firing f's cause at the block f names (where both say which). An evict
    firing names the first block of its run; a block of it that another load holds leased stays
    (LEASED), so the load ends evicted at that block or after it."""
    if want is None or r.get("miss_cause") != want:
        return False
    index = r.get("miss_index")
    if f.get("block") is None or index is None:
        return True
    at = index - r.get("first_block", 0)
    return at == f["block"] or (f["kind"] == "evict" and at > f["block"])


def _shared_page_spans(recs: list[dict], faults: list[dict]) -> list[tuple[float, float, int | None]]:
    """(from, until, page) of each corruption written into a page of the pool's shared segment:
    from its firing to its heal (the same replica, site and lease; none: to the end)."""
    heals = [r for r in recs if r["ev"] == "heal" and r.get("site") == "pool_arena.page"]
    out = []
    for f in faults:
        if f.get("site") != "pool_arena.page" or f["kind"] != "corrupt":
            continue
        until = min((h["t"] for h in heals if h["replica"] == f["replica"] and h.get("lease") == f.get("lease")
                     and h["t"] >= f["t"]), default=f["t"] + SHARED_SPAN_MAX_S)
        if f.get("page") is not None:
            out.append((f["t"], until, int(f["page"])))
    return out


# A shared page's corruption with no heal on record (its lease dropped unreleased) is taken to
# last at most the pool's default lease TTL (kvpool.pool.config: 60 s), after which the page is reaped.
SHARED_SPAN_MAX_S = 60.0
PAGE_IN_ERROR = re.compile(r"\(page (\d+)\)")


def _read_a_corrupted_page(r: dict, spans: list[tuple[float, float, int | None]]) -> bool:
    """A corrupt load that ran while a page it names (its error's "(page N)") held a corruption."""
    if r.get("miss_cause") != "corrupt":
        return False
    m = PAGE_IN_ERROR.search(str(r.get("error") or ""))
    if m is None:  # a load that names no page is explained by its own replica's faults only
        return False
    start, page = r["t"] - float(r.get("seconds") or 0.0), int(m.group(1))
    return any(start <= until + 1e-3 and r["t"] >= since - 1e-3 and page == p for since, until, p in spans)


def _pool_down_intervals(recs: list[dict]) -> list[tuple[float, float]]:
    out, start = [], None
    for r in recs:
        if r["ev"] == "nemesis" and r.get("action") == "pool_kill":
            start = r["t"]
        elif r["ev"] == "nemesis" and r.get("action") == "pool_restart" and start is not None:
            out.append((start, r["t"]))
            start = None
    if start is not None:
        out.append((start, float("inf")))
    return out


def _within(t: float, intervals: list[tuple[float, float]]) -> bool:
    return any(a <= t <= b for a, b in intervals)


def expected_causes(recs: list[dict], load_causes: tuple[str, ...], lookup_causes: tuple[str, ...],
                    load_causes_allowed: tuple[str, ...] = ()) -> Verdict:
    """The run's load causes are the declared ones, each present, plus at most the allowed
    ones (causes an adversary's timing decides, which the scenario's own checks judge);
    its lookup causes include the declared ones."""
    loads = {r.get("miss_cause") for r in recs if r["ev"] in ("load", "tier_load")} - {None}  # the network tier's too
    lookups = {r.get("miss_cause") for r in recs if r["ev"] == "lookup"} - {None}
    evidence = {"load_causes": sorted(loads), "lookup_causes": sorted(lookups),
                "expected_load_causes": sorted(load_causes), "expected_lookup_causes": sorted(lookup_causes),
                "allowed_load_causes": sorted(load_causes_allowed)}
    problems = []
    if not set(load_causes) <= loads <= set(load_causes) | set(load_causes_allowed):
        problems.append(f"loads ended as {sorted(loads)}, the scenario declares {sorted(load_causes)}"
                        + (f" and allows {sorted(load_causes_allowed)}" if load_causes_allowed else ""))
    if not set(lookup_causes) <= lookups:
        problems.append(f"lookups showed {sorted(lookups)}, the scenario declares at least {sorted(lookup_causes)}")
    if problems:
        return Verdict(False, "; ".join(problems), evidence)
    return Verdict(True, "the run's causes are the ones the scenario declares", evidence)
