"""The side-by-side table of `kvgate bench seed003` from one or more runs' result.json: the
seed's figure, kvgate's, their ratio and the host-to-device floor per row, where the ON hits'
time goes, the oracles, and the provenance of every run (commit, clean flag, whether the
carried tree matched its stamp, the command), as Markdown on stdout.

    python scripts/gpu/seed003_table.py RESULT_JSON [RESULT_JSON ...] [--command TEXT]...

With several runs, each part (ttft / sessions / control at one length) is taken from the first
run that measured it (a part a run did not measure, "not run" or raised, is taken from a later
run where there is one), and a column names the run each row comes from. The TTFT parts'
weights oracle (A's cold tokens against B's) is computed again from each part's rows, and a
row whose recorded figure differs says so. A part a run
planned but never reached because the run raised first (its replicas did not start, say) is
reported "not run" with that run's error, unless another run measured it. `--command`: the
commands that made the runs, listed under the table (repeatable). `--why PART=TEXT` adds a
reason to a part no run measured (e.g. `ttft:256000=...`: the measured figures that kept it
from running), which then has a row of its own (repeatable).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from kvgate.harness.bench.seed003 import (  # noqa: E402
    Plan,
    failures,
    h2d_floor_ms,
    memory_line,
    producer_against_cold,
    render_markdown,
    side_by_side,
)


def planned(result: dict) -> list[str]:
    """The parts a run's plan named, in its order ("ttft:128000", ...)."""
    plan = result.get("plan", {})
    lengths = {"ttft": plan.get("ttft_lengths", []), "sessions": plan.get("session_contexts", []),
               "control": plan.get("control_contexts", [])}
    out = []
    for item in plan.get("order", []):
        kind, i = item.split(":")
        if kind in lengths and int(i) < len(lengths[kind]):
            out.append(f"{kind}:{lengths[kind][int(i)]}")
    return out


def _last_error_line(error: str) -> str:
    line = error.strip().splitlines()[-1] if error.strip() else "raised"
    return re.sub(r"^\(\w+ pid=\d+\)\s*", "", line)[:300]


def merge(results: list[dict], why: dict[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """One result whose parts come from the runs (the first that measured each; a part no run
    measured as the last run that had it left it, or as a run that raised before it left it),
    and part -> the run it came from ("run N (commit)"). `why`: part -> a reason added to a
    part no run measured (a row of its own if no run had it)."""
    merged = dict(results[0])
    merged["parts"] = {}
    sources: dict[str, str] = {}
    tags = [f"run {i} ({r.get('env', {}).get('provenance', {}).get('short', '?')[:7]})"
            for i, r in enumerate(results, 1)]
    for tag, r in zip(tags, results):
        for key, part in r.get("parts", {}).items():
            have = merged["parts"].get(key)
            if have is None or "not_run" in have or "error" in have:
                if key.startswith("sessions") and "h2d_floor_ms" not in part and "improvement" in part:
                    part = {**part, "h2d_floor_ms": h2d_floor_ms(int(key.split(":")[1]), r)}  # that run's rate
                merged["parts"][key] = part
                sources[key] = tag
    for tag, r in zip(tags, results):
        if not r.get("error"):
            continue
        for key in planned(r):
            if key not in r.get("parts", {}) and ("not_run" in merged["parts"].get(key, {"not_run": ""})):
                had = merged["parts"].get(key, {}).get("not_run", "")
                raised = f"{tag} raised before it: {_last_error_line(r['error'])}"
                merged["parts"][key] = {"not_run": "; ".join(x for x in (had, raised) if x)}
                sources[key] = tag
    for key, text in (why or {}).items():
        part = merged["parts"].get(key)
        if part is not None and "not_run" not in part and "error" not in part:
            raise SystemExit(f"seed003_table.py: --why {key}: a run measured it")
        had = (part or {}).get("not_run", "")
        merged["parts"][key] = {**(part or {}), "not_run": "; ".join(x for x in (had, text) if x)}
        merged["parts"][key].pop("error", None)
    for key, part in merged["parts"].items():  # the weights oracle again, from the rows, by this code
        o = part.get("oracles")
        if not key.startswith("ttft") or not o or not part.get("rows"):
            continue
        across = producer_against_cold(part["rows"])
        had = (o.get("producer_cold_tokens_equal_B_cold"), o.get("compared_cold"))
        if had != (sum(across), len(across)):
            part["oracles"] = {**o, "producer_cold_tokens_equal_B_cold": sum(across), "compared_cold": len(across)}
            sources[key] += (f"; A's cold tokens against B's recomputed from the rows: {sum(across)} of "
                             f"{len(across)} equal (the run recorded {had[0]} of {had[1]})")
    merged["failures"] = failures(merged, Plan())
    merged.pop("command", None)
    merged.pop("memory", None)  # each run's own, listed under the runs
    provs = [r.get("env", {}).get("provenance", {}) for r in results]
    merged["env"] = {**merged.get("env", {}), "provenance": {
        "short": " / ".join(p.get("short", "?")[:7] for p in provs), "clean": all(p.get("clean") for p in provs),
        "stamped": all(p.get("stamped") for p in provs), "verified": all(p.get("verified") for p in provs)}}
    merged["pinned_h2d_GBps"] = " / ".join(str(r.get("pinned_h2d_GBps")) for r in results)
    return merged, sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--command", action="append", default=[])
    ap.add_argument("--why", action="append", default=[], metavar="PART=TEXT")
    a = ap.parse_args(argv)
    why = {}
    for w in a.why:
        key, sep, text = w.partition("=")
        if not sep or not key.split(":")[-1].isdigit():
            ap.error(f"--why takes PART=TEXT (e.g. ttft:256000=...), not {w!r}")
        why[key] = text
    results = [json.loads(p.read_text()) for p in a.results]
    merged, sources = merge(results, why)
    merged["table"] = side_by_side(merged)
    out = render_markdown(merged, sources if len(results) > 1 else None)
    lines = ["", "## Runs", ""]
    for i, (p, r) in enumerate(zip(a.results, results), 1):
        prov = r.get("env", {}).get("provenance", {})
        lines.append(f"- run {i}: `{p.name}`: commit {prov.get('commit', 'unknown')} (clean: {prov.get('clean')}; "
                     f"stamped: {prov.get('stamped')}; the carried tree verified against its stamp: "
                     f"{prov.get('verified')}); pinned host-to-device copy {r.get('pinned_h2d_GBps')} GB/s; "
                     f"{r.get('wall_s')} s; `{r.get('command', '')}`")
        if r.get("placement"):
            lines.append(f"  - {r['placement']}")
        if r.get("memory"):
            lines.append(f"  - memory after the warm-up: {memory_line(r['memory'])}")
    lines += [f"- `{c}`" for c in a.command]
    sys.stdout.write(out + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
