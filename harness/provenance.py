"""Where a run's code came from, for every report and replay key.

  provenance() -> {"commit": full sha, "short": 12 hex, "clean": bool, "dirty": [paths]}
      from git in the repository; the tree is clean when `git status --porcelain` lists
      nothing outside reports/runs/ (a run's own output). On a copy of the tree carried to
      another host (KVGATE_PROVENANCE=stamp, as scripts/gpu/reports.sh sets, or no git at
      all), from `.provenance.json` at the repository root, which `python -m
      harness.provenance --stamp` wrote before the copy: the copy's own git, if it has one,
      does not know which commit the tree came from. Else commit "unknown", clean False.
"""

from __future__ import annotations

import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAMP = REPO / ".provenance.json"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


@lru_cache(maxsize=1)
def provenance() -> dict:
    use_stamp = os.environ.get("KVGATE_PROVENANCE") == "stamp"
    if use_stamp and not STAMP.exists():
        return {"commit": "unknown", "short": "unknown", "clean": False, "dirty": [], "stamped": False}
    commit = None if use_stamp else _git("rev-parse", "HEAD")
    if commit is not None:
        status = _git("status", "--porcelain", "--untracked-files=all") or ""
        dirty = [line[3:] for line in status.splitlines()
                 if line[3:] and not line[3:].startswith("reports/runs/") and line[3:] != STAMP.name]
        commit = commit.strip()
        return {"commit": commit, "short": commit[:12], "clean": not dirty, "dirty": dirty[:20]}
    if STAMP.exists():
        stamp = json.loads(STAMP.read_text())
        return {"commit": stamp["commit"], "short": stamp["commit"][:12], "clean": bool(stamp["clean"]),
                "dirty": list(stamp.get("dirty", [])), "stamped": True}
    return {"commit": "unknown", "short": "unknown", "clean": False, "dirty": []}


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.provenance` prints the provenance as JSON; `--stamp` also writes
    .provenance.json, for a copy of the tree carried to a host without git."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m harness.provenance", description=main.__doc__.splitlines()[0])
    parser.add_argument("--stamp", action="store_true", help=f"write {STAMP.name} at the repository root")
    args = parser.parse_args(argv)
    prov = provenance()
    if args.stamp:
        STAMP.write_text(json.dumps({k: prov[k] for k in ("commit", "clean", "dirty")}))
    print(json.dumps(prov))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
