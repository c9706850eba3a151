"""Where a run's code came from, for every report and replay key.

  provenance() -> {"commit": full sha, "short": 12 hex, "clean": bool, "dirty": [paths], ...}
      from git in the repository; the tree is clean when `git status --porcelain` lists
      nothing outside reports/runs/ (a run's own output). On a copy of the tree carried to
      another host (KVGATE_PROVENANCE=stamp, as scripts/gpu/reports.sh sets, or no git at
      all), from `.provenance.json` at the repository root, which `python -m
      kvgate.harness.provenance --stamp` wrote before the copy (the copy's own git, if it has one,
      does not know which commit the tree came from), and only after the copy was checked
      against it (verify_stamp): "stamped": True, "verified": whether every stamped file's
      contents still have their stamped digest and no code file was added; an unverified
      copy is never "clean". With no stamp: commit "unknown", clean False, verified False.
  stamp(root) -> dict       what `--stamp` writes: the commit, clean, dirty, and a SHA-256
                            of every file git would carry (tracked, and untracked files
                            that are not ignored; the stamp itself and reports/runs/ left
                            out), with the tree digest over them all.
  verify_stamp(stamp, root) -> (verified, [what differs])
                            recomputes each stamped file's SHA-256 from its contents (a
                            changed, missing or unreadable file differs), the tree digest,
                            and looks for code files (*.py, *.sh) the stamp does not list,
                            outside hidden folders, __pycache__ and reports/runs/.
  title_flag(prov) -> str   "" for a clean tree, " (DIRTY TREE)" for a dirty one,
                            " (UNVERIFIED TREE)" for a carried copy that does not match
                            its stamp or has none: every report's title carries it.

Digests: hashlib.sha256 over each file's bytes; the tree digest is SHA-256 over the sorted
lines "path NUL file digest". A stamp proves nothing against someone who can rewrite the
stamp too: it catches a tree that changed after stamping (an edit on the GPU host, a
partial or stale copy), not a forger.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAMP = REPO / ".provenance.json"
CODE_SUFFIXES = (".py", ".sh")


def _git(*args: str, cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd or REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _left_out(path: str) -> bool:
    """Paths no stamp covers: a run's own output and the stamp itself."""
    return path.startswith("reports/runs/") or path == STAMP.name


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(files: dict[str, str]) -> str:
    """SHA-256 over the sorted (path, file digest) pairs."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}\0{files[path]}\n".encode())
    return h.hexdigest()


def digest_files(root: Path, paths: list[str]) -> dict[str, str]:
    """path -> SHA-256 of its contents, for the paths that exist as files under root."""
    out = {}
    for p in paths:
        f = root / p
        if f.is_file() and not f.is_symlink():
            out[p] = file_digest(f)
    return out


def _carried_files(root: Path) -> list[str] | None:
    """The files git would carry: tracked ones and untracked ones that are not ignored."""
    text = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=root)
    if text is None:
        return None
    return sorted({p for p in text.split("\0") if p and not _left_out(p)})


def _git_provenance(root: Path | None = None) -> dict | None:
    commit = _git("rev-parse", "HEAD", cwd=root)
    if commit is None:
        return None
    status = _git("status", "--porcelain", "--untracked-files=all", cwd=root) or ""
    dirty = [line[3:] for line in status.splitlines() if line[3:] and not _left_out(line[3:])]
    commit = commit.strip()
    return {"commit": commit, "short": commit[:12], "clean": not dirty, "dirty": dirty[:20]}


def stamp(root: Path | None = None) -> dict:
    """The stamp of the tree at root (default the repository; needs git): its commit,
    whether it is clean, and the digest of every file a copy of it carries."""
    root = root or REPO
    prov = _git_provenance(root)
    paths = _carried_files(root)
    if prov is None or paths is None:
        raise RuntimeError(f"cannot stamp {root}: git does not answer there")
    files = digest_files(root, paths)
    return {"commit": prov["commit"], "clean": prov["clean"], "dirty": prov["dirty"], "files": files,
            "tree_digest": tree_digest(files)}


def _extra_code(root: Path, listed: set[str]) -> list[str]:
    """Code files under root that the stamp does not list (hidden folders, __pycache__
    and reports/runs/ left out)."""
    extra = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                       and not _left_out(f"{(rel_dir / d).as_posix()}/")]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if name.endswith(CODE_SUFFIXES) and rel not in listed and not _left_out(rel):
                extra.append(rel)
    return sorted(extra)


def verify_stamp(doc: dict, root: Path) -> tuple[bool, list[str]]:
    """(whether the tree under root is the one stamped, what differs: changed, missing or
    added files, or why it cannot be checked)."""
    files = doc.get("files")
    if not isinstance(files, dict) or not isinstance(doc.get("tree_digest"), str):
        return False, ["the stamp carries no digest of the tree (made by an older kvgate.harness.provenance)"]
    if tree_digest(files) != doc["tree_digest"]:
        return False, ["the stamp's file list does not match its own tree digest"]
    found = digest_files(root, list(files))
    differs = [f"changed: {p}" for p in sorted(files) if p in found and found[p] != files[p]]
    differs += [f"missing: {p}" for p in sorted(files) if p not in found]
    differs += [f"added: {p}" for p in _extra_code(root, set(files))]
    return not differs, differs


def _from_stamp(root: Path, path: Path) -> dict:
    if not path.exists():
        return {"commit": "unknown", "short": "unknown", "clean": False, "dirty": [], "stamped": False,
                "verified": False, "unverified": [f"no stamp ({path.name}) beside the carried tree"]}
    try:
        doc = json.loads(path.read_text())
        commit = str(doc["commit"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"commit": "unknown", "short": "unknown", "clean": False, "dirty": [], "stamped": True,
                "verified": False, "unverified": [f"the stamp cannot be read: {type(exc).__name__}: {exc}"]}
    verified, differs = verify_stamp(doc, root)
    out = {"commit": commit, "short": commit[:12], "clean": bool(doc.get("clean")) and verified,
           "dirty": list(doc.get("dirty", [])), "stamped": True, "verified": verified,
           "tree_digest": doc.get("tree_digest")}
    if not verified:
        out["unverified"] = differs[:20]
    return out


@lru_cache(maxsize=1)
def provenance() -> dict:
    if os.environ.get("KVGATE_PROVENANCE") != "stamp":
        prov = _git_provenance()
        if prov is not None:
            return prov
        if not STAMP.exists():
            return {"commit": "unknown", "short": "unknown", "clean": False, "dirty": []}
    return _from_stamp(REPO, STAMP)


def title_flag(prov: dict) -> str:
    """What a report's title says about the tree it was made from."""
    if prov.get("verified") is False:
        return " (UNVERIFIED TREE)"
    return "" if prov.get("clean") else " (DIRTY TREE)"


def main(argv: list[str] | None = None) -> int:
    """`python -m kvgate.harness.provenance` prints the provenance as JSON; `--stamp` also writes
    .provenance.json, for a copy of the tree carried to a host without git; `--verify`
    checks a carried copy against its stamp and exits 1 when it does not match."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m kvgate.harness.provenance", description=main.__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--stamp", action="store_true", help=f"write {STAMP.name} at the repository root")
    what.add_argument("--verify", action="store_true",
                      help=f"check this tree against {STAMP.name} (every stamped file's SHA-256, no code file "
                           "added); exit 1 when it does not match or there is no stamp")
    args = parser.parse_args(argv)
    if args.stamp:
        doc = stamp()
        STAMP.write_text(json.dumps(doc, indent=0, sort_keys=True))
        print(json.dumps({k: doc[k] for k in ("commit", "clean", "dirty", "tree_digest")}))
        return 0
    prov = _from_stamp(REPO, STAMP) if args.verify else provenance()
    print(json.dumps(prov))
    if args.verify and not prov["verified"]:
        print(f"kvgate.harness.provenance: UNVERIFIED TREE: {'; '.join(prov['unverified'][:5])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
