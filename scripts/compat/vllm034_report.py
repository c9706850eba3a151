"""The record of a `make compat-vllm034` run: what ran, against which versions, from which tree.

    python scripts/compat/vllm034_report.py JUNIT_XML OUT_DIR

Writes OUT_DIR/run.json and OUT_DIR/summary.md: the versions of vLLM, torch, Python and the
GPU-only requirements left out (scripts/compat/vllm_requirements.py), the commit and whether
the tree was clean (kvgate.harness.provenance), and each test of suites/compat with its
outcome (passed, failed, error, skipped with its reason). Exits 1 unless at least one test ran
and none failed, errored or was skipped: a suite that checked nothing is no pass.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kvgate.harness.provenance import provenance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_requirements import GPU_ONLY  # noqa: E402


def outcomes(junit: Path) -> list[dict]:
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, detail = {"failure": "failed"}.get(tag, tag), (node.get("message") or "")[:400]
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), **({"detail": detail} if detail else {})})
    return tests


def installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    tests = outcomes(args.junit)
    prov = provenance()
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    ok = bool(tests) and counts["passed"] == len(tests)
    doc = {"suite": "suites/compat", "ok": ok, "counts": counts,
           "versions": {"vllm": installed("vllm"), "torch": installed("torch"), "python": platform.python_version(),
                        "transformers": installed("transformers")},
           "left_out": {name: installed(name) or f"not installed: {why}" for name, why in GPU_ONLY.items()},
           "commit": prov.get("commit"), "clean": prov.get("clean"), "dirty": prov.get("dirty", [])[:20],
           "tests": tests}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# kvpool against vLLM {doc['versions']['vllm']} (CPU): {'PASS' if ok else 'FAIL'}", "",
             f"commit {doc['commit']} ({'clean' if doc['clean'] else 'DIRTY TREE'}); torch "
             f"{doc['versions']['torch']}; Python {doc['versions']['python']}", "",
             " | ".join(f"{k} {v}" for k, v in counts.items()), "", "| test | outcome | s |", "| --- | --- | --- |"]
    lines += [f"| `{t['test']}` | {t['outcome']} | {t['seconds']:.1f} |" for t in tests]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"{counts} -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
