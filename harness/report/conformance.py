"""The correctness table: a conformance matrix (kvgate.harness.conformance.gate's matrix.json,
with the known-red baseline's judgement applied) as Markdown and as one HTML page.

  markdown(doc) -> str     the table: per connector its versions; per scenario and connector
                           the verdict, the baseline's outcome and the wrong-KV count; then one
                           table per connector with every cell's replay command; the baseline's
                           findings; the cells that are not a pass, with their evidence.
  html_page(doc) -> str    the same, one self-contained page.

A document is {"provenance", "seed", "scenarios": {name: what it checks}, "rows": [row],
"judgement": kvgate.harness.conformance.baseline.judge(...) or absent, "sources": [...] where
the rows come from several runs}. Each cell may carry "wrong_kv" (its run's count:
kvgate.harness.conformance.wrong_kv) and each control its own.
"""

from __future__ import annotations

import html
import json
from typing import Any

from kvgate.harness.provenance import title_flag
from kvgate.harness.report.html import _Raw, _table, page
from kvgate.harness.report.render import table

TITLE = "kvgate conformance matrix"


def _controls(cell: dict[str, Any]) -> list[dict[str, Any]]:
    return cell.get("controls") or ([cell["control"]] if cell.get("control") else [])


def wrong_kv_text(cell: dict[str, Any]) -> str:
    """"0 of 36 checked" for the run, then each control's count: "-" where nothing ran."""
    w = cell.get("wrong_kv")
    if not isinstance(w, dict):
        return "-"
    text = f"{w['wrong']} of {w['checked']}"
    if w.get("misplaced"):
        text += f" ({w['misplaced']} another block's KV)"
    if w.get("unverified"):
        text += f" (+{w['unverified']} unverified)"
    ctl = [f"{c['name']}: {c['wrong_kv']['wrong']}" for c in _controls(cell) if isinstance(c.get("wrong_kv"), dict)]
    return text + (f"; controls {', '.join(ctl)}" if ctl else "")


def restarts_text(row: dict[str, Any]) -> list[str]:
    """Each time the row's system was lost and started afresh (kvgate.harness.conformance.gate):
    after which cell, where, and what went wrong stopping the lost one or starting the next."""
    out = []
    for r in row.get("restarts") or []:
        text = f"The system was lost in {r['after']} and started afresh in {r['dir']}/"
        if r.get("stop_error"):
            text = f"The system lost in {r['after']} did not stop cleanly ({r['stop_error']}); nothing was started"
        elif r.get("start_error"):
            text += f", which failed: {r['start_error'][:300]}"
        out.append(text + ".")
    return out


def label(row: dict[str, Any]) -> str:
    """A row's name: its connector, or the connector with its device where one matrix holds the
    connector's rows of two devices (the row's `label`, as the baseline's judgement keys it)."""
    return row.get("label") or row["connector"]


def _outcome(doc: dict[str, Any], connector: str, scenario: str) -> dict[str, Any] | None:
    return ((doc.get("judgement") or {}).get("cells") or {}).get(connector, {}).get(scenario)


def verdict_text(doc: dict[str, Any], connector: str, scenario: str) -> str:
    cell = next((r["cells"].get(scenario) for r in doc["rows"] if label(r) == connector), None)
    if cell is None:
        return "-"
    status = cell["status"]
    text = "FAIL" if status == "fail" else status
    o = _outcome(doc, connector, scenario)
    if o is not None and o["outcome"] not in (status, "pass"):
        text += f" ({o['outcome']}" + (f" {o['entry']}" if o.get("entry") else "") + ")"
    return text


def _bold(text: str) -> str:
    return f"**{text}**" if text.startswith("FAIL") else text


def _versions(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in (row.get("versions") or {}).items())


def _header(doc: dict[str, Any]) -> tuple[str, list[str]]:
    prov = doc["provenance"]
    flag = title_flag(prov)
    if prov.get("mixed"):  # the rows of several earlier runs, each from its own commit (listed below)
        flag = " (ROWS OF SEVERAL COMMITS)" if prov.get("clean") else " (ROWS OF SEVERAL COMMITS, SOME DIRTY)"
    j = doc.get("judgement")
    # the rows' seeds (a matrix of several runs records -1 as its own: it has none)
    seeds = sorted(({r.get("seed") for r in doc["rows"] if r.get("seed") is not None} | {doc.get("seed")}) - {None, -1})
    tree = " (clean tree)" if prov.get("clean") else flag or " (uncommitted changes)"
    what = (f"Commits {', '.join(prov.get('commits') or [])} ({'each tree clean' if prov.get('clean') else 'not every tree clean'})"
            if prov.get("mixed") else f"Commit {prov.get('short', prov.get('commit', 'unknown'))}{tree}")
    lines = [f"{what}; seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}."]
    for src in doc.get("sources") or []:
        sp = src["provenance"]
        lines.append(f"Rows {', '.join(src['connectors'])} from `{src['path']}`: commit {sp.get('short')}, "
                     f"{'clean' if sp.get('clean') else 'uncommitted changes'}, seed {src.get('seed')}.")
    if prov.get("judged_on"):
        jp = prov["judged_on"]
        lines.append(f"Rows read from those runs and judged on commit {jp.get('short')} "
                     f"({'clean tree' if jp.get('clean') else 'uncommitted changes'}).")
    if j is not None:
        lines.append(f"Known-red baseline `{j['baseline']['path']}` (sha256 {j['baseline']['sha256'][:12]}, "
                     f"{j['baseline']['entries']} entries) applied: **{'PASS' if j['passed'] else 'FAIL'}** ({j['why']}).")
    else:
        lines.append("No known-red baseline applied.")
    return flag, lines


_LEGEND = ("Each cell: pass, FAIL, n/a (the connector declares it lacks what the scenario needs: the reason is "
           "given) or not run (kvgate could not run it here: the reason is given; never a pass); in brackets the "
           "baseline's outcome where it is not the status itself (known red, new red, changed, fixed upstream, not reproduced, "
           "not judged). Wrong KV: the complete blocks installed whose bytes are no computation of that block "
           "with the consumer's weights (corrupted or stale bytes, KV of another model or adapter), of "
           "those checked, in the scenario's run with its seeded faults; \"unverified\": installed blocks "
           "nobody computed in the run; then each negative control's count on its own run.")


def markdown(doc: dict[str, Any]) -> str:
    names = list(doc["scenarios"])
    rows = doc["rows"]
    flag, head = _header(doc)
    lines = [f"# {TITLE}{flag}", "", *head, "", _LEGEND, "", "## Connectors", ""]
    lines += table(("connector", "class", "versions", "device", "seed"),
                   [(label(r), f"`{r.get('class', '')}`", _versions(r), r.get("device", ""), r.get("seed", ""))
                    for r in rows])
    lines += ["", "## Verdicts", ""]
    lines += table(["scenario", *(label(r) for r in rows)],
                   [[n, *(_bold(verdict_text(doc, label(r), n)) for r in rows)] for n in names
                    if any(n in r["cells"] for r in rows)])
    lines += ["", "## Wrong KV", ""]
    lines += table(["scenario", *(label(r) for r in rows)],
                   [[n, *(wrong_kv_text(r["cells"][n]) if n in r["cells"] else "-" for r in rows)] for n in names
                    if any(n in r["cells"] for r in rows)])
    for r in rows:
        lines += ["", f"## {label(r)}: every cell", "", f"{r.get('describe', '')}; {_versions(r)}.", ""]
        lines += table(("scenario", "verdict", "wrong KV", "seconds", "replay"),
                       [(n, verdict_text(doc, label(r), n), wrong_kv_text(c), c.get("seconds", ""),
                         f"`{c['replay']}`") for n, c in r["cells"].items()])
        lines += [f"- {t}" for t in restarts_text(r)]
    j = doc.get("judgement")
    if j is not None:
        lines += ["", "## Known red cells and the baseline", ""]
        for c, by in j["cells"].items():
            for s, o in by.items():
                if o["outcome"] not in ("pass", "n/a"):
                    up = f" Upstream: {o['upstream']}." if o.get("upstream") else ""
                    lines.append(f"- **{c} / {s}: {o['outcome']}**" + (f" ({o['entry']})" if o.get("entry") else "")
                                 + f": {o['why']}.{up}")
        for e in j.get("not_asked") or []:
            lines.append(f"- baseline {e}: not asked in this matrix")
    lines += ["", "## Cells that are not a pass", ""]
    for r in rows:
        for n in names:
            cell = r["cells"].get(n)
            if cell is None or cell["status"] == "pass":
                continue
            lines.append(f"- **{label(r)} / {n}: {cell['status']}**: {cell['reason']}")
            ev = cell.get("evidence") or {}
            if cell["status"] == "fail":
                for rep, text in (ev.get("replica_logs") or {}).items():  # the root cause; the tail is in the JSON
                    lines.append(f"  - replica {rep} died: `{(text.splitlines() or [''])[0].strip()[:300]}`")
                brief = {k: v for k, v in ev.items() if k not in ("replica_logs", "output", "traceback")}
                if brief:
                    lines.append(f"  - evidence: `{json.dumps(brief, default=str)[:600]}`")
                if "traceback" in ev:
                    lines.append(f"  - traceback tail: `{ev['traceback'][-400:]}`")
                if cell.get("signature"):
                    lines.append(f"  - signature: {'; '.join(cell['signature'])}")
                lines.append(f"  - replay: `{cell['replay']}`")
    return "\n".join(lines) + "\n"


def _cls(text: str) -> str:
    return "fail" if text.startswith("FAIL") or "new red" in text or "changed" in text else (
        "pass" if text.startswith("pass") else "")


def html_page(doc: dict[str, Any]) -> str:
    names = list(doc["scenarios"])
    rows = doc["rows"]
    _, head = _header(doc)
    body = [f"<p>{html.escape(h).replace('**', '')}</p>" for h in head]
    body.append(f"<p class='meta'>{html.escape(_LEGEND)}</p><h2>Connectors</h2>")
    body.append(_table(["connector", "class", "versions", "device", "seed"],
                       [[label(r), r.get("class", ""), _versions(r), r.get("device", ""), r.get("seed", "")]
                        for r in rows]))

    def grid(render) -> str:  # noqa: ANN001 - (row, scenario) -> text
        out = []
        for n in names:
            if not any(n in r["cells"] for r in rows):
                continue
            cells = []
            for r in rows:
                text = render(r, n)
                cells.append(_Raw(f"<span class='{_cls(text)}'>{html.escape(text)}</span>"))
            out.append([_Raw(f"<span title='{html.escape(doc['scenarios'][n])}'>{html.escape(n)}</span>"), *cells])
        return _table(["scenario", *(label(r) for r in rows)], out)

    body.append("<h2>Verdicts</h2>" + grid(lambda r, n: verdict_text(doc, label(r), n)))
    body.append("<h2>Wrong KV</h2>" + grid(lambda r, n: wrong_kv_text(r["cells"][n]) if n in r["cells"] else "-"))
    for r in rows:
        body.append(f"<h2>{html.escape(label(r))}: every cell</h2>"
                    f"<p class='meta'>{html.escape(r.get('describe', ''))}; {html.escape(_versions(r))}</p>")
        body += [f"<p class='meta'>{html.escape(t)}</p>" for t in restarts_text(r)]
        body.append(_table(["scenario", "verdict", "wrong KV", "reason", "replay"],
                           [[n, _Raw(f"<span class='{_cls(v)}'>{html.escape(v)}</span>"), wrong_kv_text(c),
                             "" if c["status"] == "pass" else str(c.get("reason", ""))[:400],
                             _Raw(f"<code>{html.escape(c['replay'])}</code>")]
                            for n, c in r["cells"].items() for v in (verdict_text(doc, label(r), n),)]))
    j = doc.get("judgement")
    if j is not None:
        items = [f"<li><b>{html.escape(c)} / {html.escape(s)}: {html.escape(o['outcome'])}</b>"
                 f"{' (' + html.escape(o['entry']) + ')' if o.get('entry') else ''}: {html.escape(o['why'])}"
                 + (f" Upstream: {html.escape(o['upstream'])}" if o.get("upstream") else "") + "</li>"
                 for c, by in j["cells"].items() for s, o in by.items() if o["outcome"] not in ("pass", "n/a")]
        body.append("<h2>Known red cells and the baseline</h2><ul>" + "".join(items) + "</ul>")
    return page(TITLE, doc["provenance"], body)
