"""The side-by-side table of `kvgate bench seed003` from its result.json: the seed's figure,
kvgate's, their ratio and the host-to-device floor per row, the phases of the ON hits, the
oracles, and the provenance of the run (commit, clean flag, whether the carried tree matched
its stamp, the command), as Markdown on stdout.

    python scripts/gpu/seed003_table.py RESULT_JSON [--provenance PROVENANCE_JSON] [--command TEXT]...

`--provenance`: the stamp check the GPU host wrote (scripts/gpu/seed003.sh: provenance.json);
`--command`: the commands that made the run, listed under the table (repeatable).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from harness.bench.seed003 import render_markdown, side_by_side  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--provenance", type=Path, default=None)
    ap.add_argument("--command", action="append", default=[])
    a = ap.parse_args(argv)
    result = json.loads(a.result.read_text())
    result["table"] = side_by_side(result)
    out = render_markdown(result)
    prov = result.get("env", {}).get("provenance", {})
    lines = ["", "## Provenance", "",
             f"- commit {prov.get('commit', 'unknown')} (clean: {prov.get('clean')}; stamped: {prov.get('stamped')}; "
             f"verified against the stamp on the GPU host: {prov.get('verified')})"]
    if a.provenance is not None:
        check = json.loads(a.provenance.read_text())
        lines.append(f"- stamp check on the GPU host: verified {check.get('verified')}, tree digest "
                     f"{check.get('tree_digest', check.get('tree', '?'))}")
    lines += [f"- `{c}`" for c in a.command]
    sys.stdout.write(out + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
