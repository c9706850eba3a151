"""Where the KV a replica installed came from, over a whole conformance row: each installed block
is looked up among every block computed anywhere in the row (all its cells, the fresh starts
included), from the audit histories in the row's logs (a folder, or the logs.tgz a report keeps).

  python3 scripts/block_sources.py ROW_LOGS [--skip TAG_PREFIX ...] [--examples N]

Each installed block is one of: right (the one computation of that block in the row), one of
several computations of it (other weights, a reload: not judged here), the same prompt's block at
another index ("earlier/later by N blocks"), another prompt's block, or bytes no computation in the
row made. A block is the same prompt's when the request that computed the bytes also computed the
installed block. Every installed request counts, the negative controls' runs included.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import tarfile
from pathlib import Path

BLOCKS_PER_CHUNK = 2


def histories(src: Path) -> dict[str, list[dict]]:
    """Audit-worker records per history folder (the row's own and each restart-N's), in time order."""
    out: dict[str, list[dict]] = collections.defaultdict(list)

    def take(name: str, data: bytes) -> None:
        if "/history/" in f"/{name}" and ".audit-worker." in name and name.endswith(".jsonl"):
            folder = name.rsplit("/history/", 1)[0] if "/history/" in name else "."
            out[folder.strip("./") or "."] += [json.loads(ln) for ln in data.decode().splitlines() if ln.strip()]

    if src.is_dir():
        for f in src.rglob("*.jsonl"):
            take(str(f.relative_to(src)), f.read_bytes())
    else:
        with tarfile.open(src) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    take(m.name, tar.extractfile(m).read())
    return {k: sorted(v, key=lambda r: r["t"]) for k, v in out.items()}


def classify(recs: list[dict], skip: tuple[str, ...]) -> tuple[collections.Counter, dict[str, list[str]]]:
    computed: dict[str, tuple[str, int]] = {}  # digest -> (tag, index)
    by_hash: dict[str, set[str]] = collections.defaultdict(set)
    by_tag: dict[str, set[str]] = collections.defaultdict(set)  # a request's blocks, over all its steps
    for r in recs:
        if r.get("ev") == "audit" and r.get("kind") == "produced":
            by_tag[r["tag"]].update(r["hashes"])
            for i, (h, d) in enumerate(zip(r["hashes"], r["digests"])):
                computed.setdefault(d, (r["tag"], r.get("first_block", 0) + i))
                by_hash[h].add(d)
    counts: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    for r in recs:
        if r.get("ev") != "audit" or r.get("kind") != "installed" or str(r.get("tag", "")).startswith(skip):
            continue
        first = r.get("first_block", 0)
        for i, (h, d) in enumerate(zip(r["hashes"], r["digests"])):
            idx = first + i
            if d in by_hash.get(h, ()):
                # one computation of this block: right; several (other weights, a reload): which is
                # right depends on the installing replica's weights, which this tool does not follow
                kind = "right" if len(by_hash[h]) == 1 else \
                    "one of several computations of this block (other weights: not judged here)"
            elif d in computed:
                tag, j = computed[d]
                if h in by_tag[tag]:  # the producing request computed this very block too: the same prompt
                    off = j - idx
                    kind = (f"the same prompt, {'earlier' if off < 0 else 'later'} by {abs(off)} block(s)"
                            + ("" if off % BLOCKS_PER_CHUNK == 0 else " (not a whole chunk)"))
                else:
                    kind = "another prompt's block"
                examples[kind].append(f"{r['replica']} {r['tag']} block {idx} = {tag} block {j}")
            elif h not in by_hash:
                kind = "unverified (nobody computed this block)"
            else:
                kind = "bytes no computation in the row made"
            counts[kind] += 1
    return counts, examples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", type=Path, help="a row's folder, or its logs.tgz")
    ap.add_argument("--skip", action="append", default=[], help="leave out the requests whose tag starts so")
    ap.add_argument("--examples", type=int, default=3)
    a = ap.parse_args(argv)
    total: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    for folder, recs in sorted(histories(a.logs).items()):
        counts, ex = classify(recs, tuple(a.skip))
        total.update(counts)
        for k, v in ex.items():
            examples[k] += [f"{folder}: {e}" for e in v]
    out = io.StringIO()
    for kind, n in total.most_common():
        out.write(f"{n:6d}  {kind}\n")
        for e in examples.get(kind, [])[: a.examples]:
            out.write(f"          {e}\n")
    print(out.getvalue(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
