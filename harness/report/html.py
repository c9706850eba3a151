"""The HTML reports: one self-contained page per gate run, benchmark or plan, with its
plots as inline SVG (matplotlib), so the page opens anywhere without scripts or network.

  gate_report(run, measured) -> str    a gate run: its criteria, then from its
                                       measurements (kvgate.harness.measure) the TTFT of every
                                       request by hit kind and prefix length, the payback
                                       curve (p95 of each hit kind against the p50 of cold
                                       prefill), miss causes over the run, and the fault
                                       timeline with the requests' TTFT around it.
  bench_report(doc, name) -> str       a `kvgate bench hosts | live | publish | pool` JSON.
  plan_report(doc) -> str              a `kvgate plan` JSON: benefit per class and its terms.
  render_file(path) -> str             whichever of the above the file is (a gate run's
                                       directory or measurements.json, a bench or plan JSON).

Every plot is a <figure class="plot" id="plot-NAME"> holding one <svg>; the page's
provenance (commit, clean tree) is in its header.
"""

from __future__ import annotations

import html
import io
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render to SVG only
import matplotlib.pyplot as plt  # noqa: E402

from kvgate.harness.report.plan import markdown  # noqa: E402

plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "figure.dpi": 96, "axes.grid": True,
                     "grid.alpha": 0.3})

COLORS = {"cold": "#7f7f7f", "local": "#2ca02c", "remote": "#1f77b4", "tier": "#9467bd", "fallback": "#d62728",
          "peer": "#ff7f0e"}
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
.pass { color: #2ca02c; font-weight: bold; } .fail { color: #d62728; font-weight: bold; }
figure.plot { margin: 1em 0; } figure.plot svg { max-width: 100%; height: auto; }
figcaption { font-size: 0.85em; color: #555; } .meta { color: #555; font-size: 0.85em; }
code { background: #f4f4f4; padding: 0 3px; } .wide { overflow-x: auto; }
pre { white-space: pre-wrap; font-size: 0.8em; }
"""


def _svg(fig) -> str:  # noqa: ANN001 - a matplotlib Figure
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline in HTML


def figure(name: str, caption: str, fig) -> str:  # noqa: ANN001
    return (f'<figure class="plot" id="plot-{html.escape(name)}" data-plot="{html.escape(name)}">{_svg(fig)}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _empty(name: str, why: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 1.2))
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center")
    return figure(name, why, fig)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else html.escape(str(c))}</td>" for c in r)
                   + "</tr>" for r in rows)
    return f"<div class='wide'><table><tr>{head}</tr>{body}</table></div>"


class _Raw(str):
    """A cell already in HTML."""


def page(title: str, provenance: dict | None, body: list[str]) -> str:
    prov = provenance or {}
    from kvgate.harness.provenance import title_flag

    flag = title_flag(prov)  # a report from a dirty or unverified tree says so in its title
    meta = (f"commit <code>{html.escape(str(prov.get('short', 'unknown')))}</code>, "
            f"{flag.strip(' ()') if flag else 'clean tree'}")
    title = f"{title}{flag}"
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p class='meta'>{meta}</p>" + "".join(body) + "</body></html>")


# -- plots ---------------------------------------------------------------------------------------


def ttft_plot(samples: list[dict], name: str = "ttft-by-kind") -> str:
    """Every request's TTFT against its prompt length, by hit kind; the median per power of
    two as a line."""
    from kvgate.harness.measure import bucket

    if not samples:
        return _empty(name, "no request with a hit kind was measured")
    fig, ax = plt.subplots(figsize=(8, 4))
    by = defaultdict(list)
    for s in samples:
        by[s["kind"]].append((s["prompt_tokens"], s["ttft_ms"]))
    for kind, pts in sorted(by.items()):
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, s=12, alpha=0.6, color=COLORS.get(kind), label=f"{kind} ({len(pts)})")
        med = defaultdict(list)
        for x, y in pts:
            med[bucket(x)].append(y)
        mx = sorted(med)
        ax.plot(mx, [sorted(med[x])[len(med[x]) // 2] for x in mx], color=COLORS.get(kind), lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.legend(fontsize=8)
    return figure(name, "Time to first token of every request, by hit kind and prompt length (line: the median "
                        "per power of two)", fig)


def payback_plot(by_kind: dict[str, dict[int, dict[str, float]]], name: str = "payback") -> str:
    """Seed 000's rule as a picture: each hit kind's p95 against the p50 of cold prefill; a
    hit pays where its p95 lies under the cold line."""
    cold = by_kind.get("cold") or {}
    if not cold:
        return _empty(name, "no cold prefill measured: no payback curve")
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = sorted(cold)
    ax.plot(xs, [cold[x]["p50_ms"] for x in xs], color=COLORS["cold"], lw=2, marker="o", label="cold p50")
    for kind in ("local", "remote", "tier", "fallback", "peer"):
        rows = by_kind.get(kind) or {}
        if not rows:
            continue
        kx = sorted(rows)
        ax.plot(kx, [rows[x]["p95_ms"] for x in kx], color=COLORS.get(kind), marker="s", ls="--", label=f"{kind} p95")
        for x in kx:
            if x in cold and rows[x]["p95_ms"] < cold[x]["p50_ms"] and kind in ("remote", "tier"):
                ax.fill_between([x * 0.95, x * 1.05], rows[x]["p95_ms"], cold[x]["p50_ms"], color=COLORS[kind],
                                alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    return figure(name, "Payback: a remote hit pays where its p95 lies under the p50 of cold prefill (shaded)", fig)


def misses_plot(misses: list[dict], t0: float, name: str = "miss-causes") -> str:
    if not misses:
        return _empty(name, "no miss was recorded in the run")
    fig, ax = plt.subplots(figsize=(8, 3))
    causes = sorted({m["cause"] for m in misses})
    span = max(1.0, max(m["t"] for m in misses) - t0)
    bins = max(5, min(60, int(span // 10) or 5))
    width = span / bins
    bottoms = [0] * bins
    palette = plt.get_cmap("tab10")
    for i, cause in enumerate(causes):
        counts = Counter(min(bins - 1, int((m["t"] - t0) / width)) for m in misses if m["cause"] == cause)
        heights = [counts.get(b, 0) for b in range(bins)]
        ax.bar([b * width for b in range(bins)], heights, width=width, bottom=bottoms, align="edge",
               color=palette(i % 10), label=f"{cause} ({sum(heights)})")
        bottoms = [a + b for a, b in zip(bottoms, heights)]
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("misses")
    ax.legend(fontsize=7, ncol=2)
    return figure(name, "Misses over the run, by cause (lookups and loads)", fig)


def timeline_plot(events: list[dict], samples: list[dict], t0: float, name: str = "fault-timeline") -> str:
    if not events and not samples:
        return _empty(name, "no fault fired and no request was measured")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True, gridspec_kw={"height_ratios": [2, 2]})
    kinds = sorted({f"{e['what']}:{e['kind']}" for e in events})
    for i, k in enumerate(kinds):
        pts = [e["t"] - t0 for e in events if f"{e['what']}:{e['kind']}" == k]
        ax.scatter(pts, [i] * len(pts), marker="|", s=200, color=plt.get_cmap("tab10")(i % 10))
    ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
    if not kinds:
        ax.text(0.5, 0.5, "no fault fired", transform=ax.transAxes, ha="center")
    for kind in sorted({s["kind"] for s in samples}):
        pts = [(s["t"] - t0, s["ttft_ms"]) for s in samples if s["kind"] == kind]
        ax2.scatter(*zip(*pts), s=8, color=COLORS.get(kind), label=kind)
    if samples:
        ax2.set_yscale("log")
        ax2.legend(fontsize=7, ncol=5)
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_xlabel("seconds into the run")
    return figure(name, "Faults and nemesis actions over the run (top) and every request's TTFT (bottom)", fig)


# -- pages ---------------------------------------------------------------------------------------


def _criteria_table(criteria: list[dict]) -> str:
    rows = []
    for c in criteria:
        ok = c.get("result") == "pass"
        rows.append([_Raw(f"<span class='{'pass' if ok else 'fail'}'>{html.escape(str(c.get('result')))}</span>"),
                     c.get("name", ""), str(c.get("reason", ""))[:300], _Raw(f"<code>{html.escape(c.get('replay', ''))}</code>")])
    return _table(["result", "criterion", "reason", "replay"], rows)


def gate_report(run: Any, measured: dict) -> str:
    """`run`: a kvgate.harness.report.render.GateRun, or the dict of its run.json."""
    from kvgate.harness.measure import Sample, distributions

    doc = run if isinstance(run, dict) else _run_dict(run)
    body = [f"<p>Replay key <code>{html.escape(json.dumps(doc.get('replay_key', {})))}</code>: "
            f"<span class='{'pass' if doc.get('passed') else 'fail'}'>{'PASS' if doc.get('passed') else 'FAIL'}</span>"
            f", {doc.get('summary', {}).get('passed', '?')} of {doc.get('summary', {}).get('criteria', '?')} criteria "
            f"in {doc.get('summary', {}).get('wall_s', '?')} s.</p>",
            "<h2>Criteria</h2>", _criteria_table(doc.get("criteria", []))]
    for sysdoc in measured.get("systems", []):
        samples = sysdoc.get("samples", [])
        times = [s["t"] for s in samples] + [e["t"] for e in sysdoc.get("timeline", [])] + \
                [m["t"] for m in sysdoc.get("misses", [])]
        t0 = min(times) if times else 0.0
        dist = distributions([Sample(**s) for s in samples], by_octave=True)
        body += [f"<h2>System {html.escape(sysdoc.get('system', ''))}</h2>",
                 f"<p>{len(samples)} requests measured; {len(sysdoc.get('timeline', []))} faults and nemesis actions; "
                 f"{len(sysdoc.get('misses', []))} misses.</p>",
                 ttft_plot(samples, f"ttft-by-kind-{sysdoc.get('system')}"),
                 payback_plot(dist, f"payback-{sysdoc.get('system')}"),
                 misses_plot(sysdoc.get("misses", []), t0, f"miss-causes-{sysdoc.get('system')}"),
                 timeline_plot(sysdoc.get("timeline", []), samples, t0, f"fault-timeline-{sysdoc.get('system')}")]
        rows = [[k, L, d["n"], d["p50_ms"], d["p95_ms"]] for k, by in sorted(dist.items()) for L, d in sorted(by.items())]
        body.append(_table(["hit kind", "prompt tokens (nearest power of two)", "requests", "p50 ms", "p95 ms"], rows))
    return page("kvgate gate run", measured.get("provenance") or doc.get("provenance"), body)


def _run_dict(run: Any) -> dict:
    return {"passed": run.passed, "replay_key": run.replay_key, "summary": run.summary,
            "criteria": [{"name": c.name, "result": c.verdict.label, "reason": c.verdict.reason, "replay": c.replay}
                         for c in run.criteria]}


def _by_kind_from_rows(rows: list[dict], keys: dict[str, str]) -> dict[str, dict[int, dict[str, float]]]:
    out: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for r in rows:
        L = int(r.get("prefix_tokens") or r.get("prompt_tokens"))
        for kind, key in keys.items():
            if r.get(key) is not None:
                out[kind][L] = {"p50_ms": r[key], "p95_ms": r.get(f"{key}_p95", r[key]), "n": r.get("runs", 0)}
    return dict(out)


def bench_report(doc: dict, name: str) -> str:
    rows = doc.get("rows") or []
    body: list[str] = []
    if rows and "cross_host_hit_ttft_ms" in rows[0]:
        by = _by_kind_from_rows(rows, {"cold": "cold_prefill_ms", "local": "local_hit_ttft_ms",
                                       "remote": "same_host_hit_ttft_ms", "tier": "cross_host_hit_ttft_ms"})
        body += [payback_plot(by), _fault_bars(doc.get("faults") or {})]
    elif rows and "remote_hit_ttft_ms" in rows[0]:
        by = _by_kind_from_rows(rows, {"cold": "cold_prefill_ms", "local": "local_hit_ttft_ms",
                                       "remote": "remote_hit_ttft_ms", "peer": "peer_hit_ttft_ms"})
        body += [payback_plot(by)]
    elif rows and "own_ttft_publish_vs_none" in rows[0]:
        body += [_bars("publish", [str(r["prompt_tokens"]) for r in rows],
                       {"own TTFT, publishing / not": [r["own_ttft_publish_vs_none"] for r in rows],
                        "next TTFT, after publishing / not": [r["next_ttft_after_publish_vs_after_none"] for r in rows]},
                       "ratio", "The producer's TTFT with publishing against without, per prompt length (1.0: no cost)")]
    elif "sizes" in doc:
        labels = list(doc["sizes"])
        body += [_bars("pool-throughput", labels,
                       {"publish / memcpy": [doc["sizes"][k]["publish_vs_memcpy"] for k in labels],
                        "publish trusted / memcpy": [doc["sizes"][k]["trusted"]["publish_vs_memcpy"] for k in labels],
                        "load / memcpy": [doc["sizes"][k]["load_vs_memcpy"] for k in labels]},
                       "x memcpy", "Publish and load throughput against a plain memcpy of the same pages, same run")]
    elif "check" in doc and "scale" in doc:
        body += _scale_sections(doc)
    elif "phases" in doc:
        phases = doc["phases"]
        hooks = [h for h in phases.get("stalled", {}) if isinstance(phases["stalled"][h], dict)
                 and "worst_call_s" in phases["stalled"][h]]
        body.append(_bars("stall", hooks, {p: [((phases.get(p) or {}).get(h) or {}).get("worst_call_s", 0) * 1e3
                                               for h in hooks] for p in phases},
                          "ms (longest call)", "Each connector hook's longest call, healthy pool against a stopped one"))
    else:
        body.append(_empty("unknown", "this JSON is not a bench kvgate knows how to draw"))
    if rows:
        keys = list(rows[0])
        body.append(_table(keys, [[json.dumps(r.get(k)) if isinstance(r.get(k), (dict, list)) else r.get(k) for k in keys]
                                  for r in rows]))
    targets = doc.get("targets") or {}
    if targets:
        body.append(_table(["target", "met"], [[k, "yes" if v else "no"] for k, v in targets.items()]))
    return page(f"kvgate bench {name}", doc.get("provenance"), body)


def _scale_sections(doc: dict) -> list[str]:
    out = ["<h2>The simulation against the live run</h2>",
           _table(["scenario", "live p50 ms (mean of runs)", "live kinds", "simulated p50 ms", "95% interval",
                   "kinds interval", "consistent"],
                  [[r["scenario"], r["live_p50_ms"], json.dumps(r["live_kinds"]), r["sim_p50_ms"],
                    r["sim_p50_interval_ms"], json.dumps(r.get("sim_kinds_interval", {})),
                    "yes" if r["live_inside_interval"] else "no"] for r in doc["check"]])]
    rows = doc["scale"]["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, name in enumerate(sorted({r["scenario"] for r in rows})):
        pts = sorted((r["replicas"], r["ttft_p50_ms"], r["ttft_p95_ms"]) for r in rows if r["scenario"] == name)
        color = plt.get_cmap("tab10")(i % 10)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=name)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="s", ls="--", color=color, label=name)
    for a, what in ((ax, "p50"), (ax2, "p95")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("replicas")
        a.set_ylabel(f"TTFT {what} (ms)")
    ax.legend(fontsize=7)
    out.append("<h2>Simulated at scale</h2>")
    out.append(figure("scale", "Simulated TTFT p50 (left) and p95 (right) of each scale scenario by replica count", fig))
    out.append(_table(["replicas", "scenario", "requests", "p50 ms", "p95 ms", "kinds", "peak link queue"],
                      [[r["replicas"], r["scenario"], r["requests"], r["ttft_p50_ms"], r["ttft_p95_ms"],
                        ", ".join(f"{k} {v['n']}" for k, v in r["kinds"].items()), r["peak_link_queue"]]
                       for r in rows]))
    return out


def _bars(name: str, labels: list[str], series: dict[str, list[float]], ylabel: str, caption: str) -> str:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    w = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([j + i * w for j in range(len(labels))], ys, width=w, label=label)
    ax.set_xticks([j + w * (len(series) - 1) / 2 for j in range(len(labels))], labels, rotation=20, ha="right")
    ax.axhline(1.0, color="#555", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    return figure(name, caption, fig)


def _fault_bars(faults: dict) -> str:
    rows = faults.get("rows") or {}
    if not rows:
        return _empty("faults", "no fault rows")
    labels = list(rows)
    return _bars("faults", labels, {"TTFT / cold": [rows[k]["vs_cold"] for k in labels]}, "x cold",
                 f"TTFT at {faults.get('prefix_tokens')} tokens under each store fault, against cold prefill")


def plan_report(doc: dict) -> str:
    classes = doc.get("classes", [])
    names = [c["name"] for c in classes]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    terms = {"gain": "gain_ms", "- P_stall": "P_stall_ms", "- P_write": "P_write_ms", "- P_eviction": "P_eviction_ms"}
    w = 0.8 / (len(terms) + 1)
    for i, (label, key) in enumerate(terms.items()):
        sign = 1 if key == "gain_ms" else -1
        ax.bar([j + i * w for j in range(len(names))], [sign * c[key] for c in classes], width=w, label=label)
    ax.bar([j + len(terms) * w for j in range(len(names))], [c["E_benefit_ms"] for c in classes], width=w,
           color="black", label="E[benefit]")
    ax.set_xticks([j + w * len(terms) / 2 for j in range(len(names))], names)
    ax.axhline(0, color="#555", lw=0.8)
    ax.set_ylabel("ms per request")
    ax.legend(fontsize=8)
    body = [figure("plan-benefit", "Each class's expected benefit per request and its terms", fig)]
    body.append("<pre>" + html.escape(markdown(doc)) + "</pre>")
    return page("kvgate plan", doc.get("provenance"), body)


def render_file(path: Path) -> str:
    """A gate run's directory (run.json + measurements.json), a measurements.json, a bench
    JSON or a plan JSON."""
    if path.is_dir():
        return gate_report(json.loads((path / "run.json").read_text()),
                           json.loads((path / "measurements.json").read_text()))
    doc = json.loads(path.read_text())
    if "systems" in doc:
        run = path.parent / "run.json"
        return gate_report(json.loads(run.read_text()) if run.exists() else {}, doc)
    if "classes" in doc and "E_total_ms_per_s" in doc:
        return plan_report(doc)
    return bench_report(doc, path.stem)
