"""The side-by-side table of `kvgate bench seed003` from one or more runs' result.json: the
seed's figure, kvgate's, their ratio and the host-to-device floor per row, where the ON hits'
time goes, the oracles, and the provenance of every run (commit, clean flag, whether the
carried tree matched its stamp, the command), as Markdown on stdout.

    python scripts/gpu/seed003_table.py RESULT_JSON [RESULT_JSON ...] [--command TEXT]...

With several runs, each part (ttft / sessions / control at one length) is taken from the first
run that measured it (a part a run did not measure, "not run" or raised, is taken from a later
run where there is one), and a column names the run each row comes from. `--command`: the
commands that made the runs, listed under the table (repeatable).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from kvgate.harness.bench.seed003 import (  # noqa: E402
    Plan,
    failures,
    memory_line,
    render_markdown,
    side_by_side,
)


def merge(results: list[dict]) -> tuple[dict, dict[str, str]]:
    """One result whose parts come from the runs (the first that measured each; a part no run
    measured as the last run that had it left it), and part -> the run it came from ("run N
    (commit)")."""
    merged = dict(results[0])
    merged["parts"] = {}
    sources: dict[str, str] = {}
    for i, r in enumerate(results, 1):
        tag = f"run {i} ({r.get('env', {}).get('provenance', {}).get('short', '?')[:7]})"
        for key, part in r.get("parts", {}).items():
            have = merged["parts"].get(key)
            if have is None or "not_run" in have or "error" in have:
                merged["parts"][key] = part
                sources[key] = tag
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
    a = ap.parse_args(argv)
    results = [json.loads(p.read_text()) for p in a.results]
    merged, sources = merge(results)
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
