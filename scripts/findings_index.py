"""The index of the conformance matrix's findings, made from the known-red baseline
(harness/conformance/known_red.toml): one row per finding report, with the cells it explains (connector,
device, versions, scenario, baseline id) and its upstream reference, or "not yet reported" (new). Reports
under reports/conformance/*/findings/ that no cell names yet (a finding reproduced outside the matrix) are
listed after them, with what their own `- **Upstream**:` and `- **New**:` lines say.

  python3 scripts/findings_index.py [--check]     writes reports/conformance/FINDINGS.md
                                                   (--check: exit 1 if the file is not what it would write)
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "reports" / "conformance" / "FINDINGS.md"


def render() -> str:
    sys.path.insert(0, str(REPO))
    from kvgate.harness.conformance.baseline import NOT_REPORTED, load

    base = load()
    by_report: dict[str, list] = collections.defaultdict(list)
    for e in base.entries:
        by_report[e.report].append(e)

    def new(entries: list) -> bool:
        return all(e.upstream == NOT_REPORTED for e in entries)

    named = {str(Path(r)) for r in by_report}
    loose = []  # (report, new, upstream) of the reports no cell names
    for path in sorted((REPO / "reports" / "conformance").glob("*/findings/*.md")):
        report = str(path.relative_to(REPO))
        if path.name == "README.md" or report in named:
            continue
        text = path.read_text()
        up, is_new = (re.search(rf"^- \*\*{k}\*\*: (.+)$", text, re.M) for k in ("Upstream", "New"))
        if up is None or is_new is None:
            raise SystemExit(f"{report}: a finding with no cell must say `- **Upstream**:` and `- **New**:`")
        upstream = up.group(1).split(". ")[0].rstrip(".").replace("|", "\\|")
        unreported = upstream.startswith(NOT_REPORTED)
        if is_new.group(1).lower().startswith("yes") != unreported:
            raise SystemExit(f"{report}: `- **New**: {is_new.group(1)}` and `- **Upstream**: {upstream}` disagree")
        loose.append((report, unreported, upstream))
    n_new = sum(new(v) for v in by_report.values()) + sum(n for _, n, _ in loose)
    lines = ["# The conformance matrix's findings", "",
             f"Made by `scripts/findings_index.py` from `{base.path}` (sha256 {base.sha256[:12]}, "
             f"{len(base.entries)} known red cells), which `kvgate conformance` judges every matrix against. "
             "One row per finding's report: the cells it explains and where upstream stands. "
             "\"not yet reported\": new, nothing found upstream when it was written; each report says what "
             "was searched and gives a reproduction.", "",
             f"{n_new} of {len(by_report) + len(loose)} reports are new to upstream"
             + (f" ({len(loose)} with no cell in the table yet, listed last)." if loose else "."), "",
             "| report | new | upstream | cells (connector / scenario, device, versions: baseline id) |",
             "|---|---|---|---|"]
    for report in sorted(by_report, key=lambda r: (not new(by_report[r]), r)):
        entries = sorted(by_report[report], key=lambda e: (e.connector, e.scenario))
        ups = sorted({e.upstream for e in entries})
        cells = "<br>".join(
            f"{e.connector} / {e.scenario}, {e.device or 'any device'}, "
            f"{', '.join(v for v in e.versions.values())}: `{e.id}`" + (" (racy)" if e.racy else "")
            for e in entries)
        lines.append(f"| [{Path(report).name}]({Path(report).relative_to('reports/conformance')}) | "
                     f"{'**new**' if new(entries) else 'known'} | "
                     f"{'<br>'.join(u if u == NOT_REPORTED else f'<{u}>' for u in ups)} | {cells} |")
    if loose:
        lines += ["", "## Findings with no cell in the table yet", "",
                  "Reproduced outside the matrix (each report gives its reproduction); no known-red entry names them.",
                  "", "| report | new | upstream |", "|---|---|---|"]
        lines += [f"| [{Path(r).name}]({Path(r).relative_to('reports/conformance')}) | {'**new**' if n else 'known'} "
                  f"| {up} |" for r, n, up in loose]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is not what the baseline gives: run python3 scripts/findings_index.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"findings_index: {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
