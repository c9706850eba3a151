"""Rendering a `kvgate plan` result (kvgate.harness.plan.plan's JSON document) as Markdown.

  markdown(doc) -> str    the benefit per request class and its terms, the byte rates, the
                          capacity and reuse distances, the rule p95 remote < p50 cold per
                          measured length, the warm-up and the recommendation.

It reads the document only: it imports nothing of kvgate.harness.plan (kvgate.harness.plan imports it).
"""

from __future__ import annotations

from kvgate.harness.report.render import table


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f} MB/s"


def markdown(doc: dict) -> str:
    out = ["# kvgate plan", "", f"Inputs: {', '.join(doc['inputs']['measured'])}; mix {doc['inputs']['mix']}. "
           f"{doc['inputs']['bytes_per_token']:.0f} bytes per token, block {doc['inputs']['block_size']} tokens.", "",
           "## Expected benefit per request class (ms per request)", "",
           "E[benefit] = h_remote x (T_recompute - T_remote) - P_stall - P_write - P_eviction", ""]
    out += table(("class", "rate/s", "prefix", "h_remote", "T_recompute", "T_remote", "gain", "P_stall", "P_write",
                  "P_eviction", "E[benefit]", "p95 remote < p50 cold"),
                 [(c["name"], c["rate_rps"], c["prefix_tokens_useful"], c["h_remote"],
                   f"{c['T_recompute_ms']} ({c['T_recompute_how']})", f"{c['T_remote_ms']} ({c['T_remote_how']}, {c['source']})",
                   c["gain_ms"], c["P_stall_ms"], c["P_write_ms"], c["P_eviction_ms"], f"**{c['E_benefit_ms']}**",
                   {True: "yes", False: "no", None: "-"}[c["p95_remote_below_p50_cold"]]) for c in doc["classes"]])
    out += ["", f"E[total] = {doc['E_total_ms_per_s']} ms of prefill saved per second.", "", "Sources of the terms:", ""]
    for c in doc["classes"]:
        out.append(f"- {c['name']}: retention {c['retention']} (Che's LRU approximation, characteristic time "
                   f"{c['characteristic_time_s']} s against a reuse interval of {c['reuse_interval_s']} s); "
                   f"P_stall {c['P_stall_source']}; P_write {c['P_write_source']}; P_eviction: the other classes' "
                   "gain with and without its writes")
    r = doc["rates"]
    out += ["", "## Byte rates", ""]
    out += table(("R_read", "R_write", "R_total", "measured link", "utilization"),
                 [(_mb(r["R_read_Bps"]), _mb(r["R_write_Bps"]), _mb(r["R_total_Bps"]), _mb(r["link_Bps"]),
                   r["utilization"])])
    cap = doc["capacity"]
    out += ["", "## Capacity and reuse distance", "",
            f"Effective capacity {cap['effective'] / 2**20:.1f} MiB = physical {cap['physical'] / 2**20:.1f} - reserved "
            f"{cap['reserved'] / 2**20:.1f} - active decode {cap['active_decode'] / 2**20:.1f} - fragmentation "
            f"{cap['fragmentation'] / 2**20:.1f} MiB.", ""]
    out += table(("class", "reuse distance", "/ effective capacity", "from"),
                 [(c["name"], f"{c['reuse_distance_bytes'] / 2**20:.2f} MiB", c["reuse_distance_vs_capacity"],
                   c["reuse_distance_source"]) for c in doc["classes"]])
    out += ["", "## p95 remote < p50 cold, per measured length", ""]
    out += table(("prefix tokens", "hit kind", "p95 remote ms", "p50 cold ms", "holds"),
                 [(x["prefix_tokens"], x["kind"], x["p95_remote_ms"], x["p50_cold_ms"], "yes" if x["holds"] else "no")
                  for x in doc["rule_p95_remote_below_p50_cold"]])
    w = doc["warmup"]
    if w:
        out += ["", "## Warm-up", "",
                f"{w['new_replicas']} new replicas x {w['hot_bytes'] / 2**20:.2f} MiB hot / {w['window_s']} s = "
                f"{_mb(w['needed_Bps'])} against {_mb(w['link_Bps'])} measured: "
                f"{'fits' if w['fits'] else 'does not fit'}; loading all takes {w['seconds_to_load_all']} s, "
                f"recomputing takes {w['seconds_to_recompute_per_replica']} s per replica: {w['cheaper']} is cheaper."]
    rec = doc["recommendation"]
    out += ["", "## Recommendation", "",
            f"- Remote loads on for: {', '.join(rec['remote_loads_on']) or 'none'}; off for: "
            f"{', '.join(rec['remote_loads_off']) or 'none'}."]
    out += [f"  - {n}: {why}" for n, why in rec["why"].items()]
    out += ["- Publish boundary (tokens; `publish_tokens`): "
            + ", ".join(f"{n} {b}" for n, b in rec["publish_boundary_tokens"].items()),
            f"- Load limit: {rec['load_limit_concurrent']} concurrent loads. {rec['load_limit_note']}."]
    if "link_headroom" in rec:
        out.append(f"- Link headroom at this mix: {rec['link_headroom'] * 100:.1f}%.")
    if "E_total_ms_per_s_applied" in rec:
        out.append(f"- Applied (remote loads and publishing off where recommended): E[total] "
                   f"{doc['E_total_ms_per_s']} -> {rec['E_total_ms_per_s_applied']} ms per second; per class "
                   + ", ".join(f"{n} {v}" for n, v in rec["E_benefit_ms_applied"].items()) + " ms.")
    return "\n".join(out) + "\n"
