"""The mutation score of each module `make mutation` mutates, from mutmut's results.

    python scripts/mutation_report.py [--out reports/mutation] [--wall-s SECONDS]

Reads what `mutmut run` left in mutants/ (one `<module>.py.meta` per mutated module: each
mutant's exit code and how long its tests ran) and the modules listed in pyproject.toml's
[tool.mutmut] only_mutate, and writes reports/mutation/scores.json and scores.md: per module
the mutants, killed, timeout, survived, no tests (no selected test calls the function),
equivalent, and the score, with the commit and whether the tree was clean
(kvgate.harness.provenance).

  killed      a selected test failed (mutmut's exit codes 1 and 3) or the run crashed (a
              signal other than the CPU limit's)
  timeout     the tests ran past mutmut's limit ((their clean time + 1 s) x 15, CPU): the
              mutant made them hang, which a real run notices too
  survived    every selected test passed
  no tests    no test of the selection called the mutated function (in the test's own process)
  equivalent  listed in reports/mutation/equivalent.md with the reason no test can tell it
              from the original (a table row whose first cell is the mutant's name in
              backquotes); a listed mutant that was killed is reported as a stale entry
  score       (killed + timeout) / (mutants - equivalent)

Exits 1 if a module has mutants left unchecked (the run was interrupted) unless --partial.

Results of several runs, each narrowed to some modules and their tests (a copy of the tree
whose pyproject.toml names fewer modules in only_mutate and fewer tests): one --mutants per
run, each module scored from the first directory that holds its results, with the test
selection of the pyproject.toml beside that directory (the run's own). --carry-over keeps,
for a module no directory holds, its row of the scores.json being replaced, marked with the
commit and date it was measured at, and names a module with neither as not measured (without
--carry-over, a module without results is an error).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tomllib
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvgate.harness.provenance import provenance  # noqa: E402

TARGET = 90.0  # percent killed per module (the target)

# mutmut's exit codes (mutmut.stats.status_by_exit_code, 3.8), folded into the report's columns
_KILLED = {1, 3, -11, -9, 139}
_TIMEOUT = {36, -24, 24, 152, 255}
_SURVIVED = {0}
_NO_TESTS = {5, 33}
_UNCHECKED = {None, 2}


def status(code: int | None) -> str:
    if code in _KILLED:
        return "killed"
    if code in _TIMEOUT:
        return "timeout"
    if code in _SURVIVED:
        return "survived"
    if code in _NO_TESTS:
        return "no tests"
    if code in _UNCHECKED:
        return "not checked"
    return "other"  # skipped, caught by a type check, suspicious: none configured here


def mutmut_config(path: Path) -> dict:
    return tomllib.loads(path.read_text())["tool"]["mutmut"]


def equivalents(path: Path) -> dict[str, str]:
    """Mutant name -> reason, from the table rows of equivalent.md."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\|\s*`([^`]+__mutmut_\d+)`\s*\|(.*)\|\s*$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def score_module(path: str, meta: dict, equivalent: dict[str, str]) -> dict:
    codes: dict[str, int | None] = meta["exit_code_by_key"]
    counts = Counter()
    survivors, no_tests, stale = [], [], []
    for name, code in sorted(codes.items(), key=lambda kv: _natural(kv[0])):
        st = status(code)
        if name in equivalent:
            if st in ("killed", "timeout"):
                stale.append(name)  # listed as equivalent, yet a test tells it apart
            else:
                counts["equivalent"] += 1
                continue
        counts[st] += 1
        if st == "survived":
            survivors.append(name)
        elif st == "no tests":
            no_tests.append(name)
    total = len(codes)
    detected = counts["killed"] + counts["timeout"]
    judged = total - counts["equivalent"]
    return {
        "module": module_name(path),
        "path": path,
        "mutants": total,
        "killed": counts["killed"],
        "timeout": counts["timeout"],
        "survived": counts["survived"],
        "no_tests": counts["no tests"],
        "equivalent": counts["equivalent"],
        "not_checked": counts["not checked"],
        "other": counts["other"],
        "score": round(100.0 * detected / judged, 1) if judged else None,
        "survivors": survivors,
        "no_tests_mutants": no_tests,
        "stale_equivalents": stale,
    }


def run_selection(mutants_dir: Path, default: dict) -> list[str]:
    """The test selection of the run that left `mutants_dir`: its tree's pyproject.toml."""
    conf_path = mutants_dir.parent / "pyproject.toml"
    conf = mutmut_config(conf_path) if conf_path.exists() else default
    return list(conf["pytest_add_cli_args_test_selection"])


def carried_rows(doc: dict) -> dict[str, dict]:
    """The module rows of a previous report, each marked with the commit and date it was
    measured at (kept from an earlier carry-over)."""
    out = {}
    for row in doc.get("modules", []):
        row = dict(row)
        row.setdefault("carried_from", {"commit": doc["provenance"]["commit"], "clean": doc["provenance"]["clean"],
                                        "date": doc["date"], "selection": doc.get("selection")})
        out[row["module"]] = row
    return out


def _natural(name: str) -> tuple[str, int]:
    head, _, n = name.rpartition("__mutmut_")
    return head, int(n) if n.isdigit() else 0


def markdown(doc: dict) -> str:
    prov = doc["provenance"]
    lines = [
        f"# Mutation scores{'' if prov['clean'] else ' (DIRTY TREE)'}",
        "",
        f"Commit `{prov['commit']}` ({'clean tree' if prov['clean'] else 'dirty tree: ' + ', '.join(prov['dirty'])}),"
        f" {doc['date']}, mutmut {doc['mutmut']}. Made by scripts/mutation_report.py from mutmut's results"
        " (`make mutation` runs both). Tests: "
        + ("each module's run's own selection (below)" if any(m.get("selection") for m in doc["modules"])
           else "`" + " ".join(doc["selection"]) + "`")
        + ", each mutant against those of them that called its function.",
        "",
        "Score = (killed + timeout) / (mutants - equivalent); equivalents, with their reasons, in"
        f" [equivalent.md](equivalent.md). Target: {TARGET:.0f}% per module.",
        "",
        "| module | mutants | killed | timeout | survived | no tests | equivalent | score |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in doc["modules"]:
        score = "-" if m["score"] is None else f"{m['score']:.1f}%"
        if m["score"] is not None and m["score"] < TARGET:
            score += " (below target)"
        if m["not_checked"]:
            score += f" ({m['not_checked']} not checked)"
        name = m["module"] + (" (carried over)" if m.get("carried_from") else "")
        lines.append(f"| {name} | {m['mutants']} | {m['killed']} | {m['timeout']} | {m['survived']} | "
                     f"{m['no_tests']} | {m['equivalent']} | {score} |")
    carried = [m for m in doc["modules"] if m.get("carried_from")]
    t = doc["total"]
    lines.append(f"| **all** | {t['mutants']} | {t['killed']} | {t['timeout']} | {t['survived']} | {t['no_tests']} | "
                 f"{t['equivalent']} | {t['score']:.1f}% |")
    if doc.get("not_measured"):
        lines += ["", "Not measured (no results in any run given): "
                  + ", ".join(module_name(p) for p in doc["not_measured"]) + "."]
    if carried:
        lines += ["", "Rows carried over from an earlier report (not measured at this commit): "
                  + "; ".join(f"{m['module']} at `{m['carried_from']['commit'][:12]}`"
                              f"{'' if m['carried_from']['clean'] else ' (dirty tree)'}, {m['carried_from']['date']}"
                              for m in carried) + "."]
    selected = [m for m in doc["modules"] if m.get("selection")]
    if selected:
        lines += ["", "Tests per module (the selection of the run its results come from):", ""]
        lines += [f"- {m['module']}{' (carried over)' if m.get('carried_from') else ''}: `{' '.join(m['selection'])}`"
                  for m in selected]
    if doc.get("note"):
        lines += ["", doc["note"]]
    if doc.get("wall_s"):
        lines += ["", f"Wall time of the run: {doc['wall_s'] / 60:.1f} min."]
    left = [(m["module"], n) for m in doc["modules"] for n in m["survivors"] + m["no_tests_mutants"]]
    if left:
        lines += ["", "## Neither killed nor listed as equivalent", ""]
        lines += [f"- `{n}`" for _, n in left]
    stale = [n for m in doc["modules"] for n in m["stale_equivalents"]]
    if stale:
        lines += ["", "## Listed as equivalent but killed (stale entries of equivalent.md)", ""]
        lines += [f"- `{n}`" for n in stale]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=Path, action="append", default=None,
                    help="a run's mutants/ directory (repeatable: the first holding a module's results wins);"
                         " default: mutants/")
    ap.add_argument("--out", type=Path, default=REPO / "reports" / "mutation")
    ap.add_argument("--wall-s", type=float, default=None, help="the run's wall time, to record")
    ap.add_argument("--partial", action="store_true", help="write the report of an unfinished run")
    ap.add_argument("--config", type=Path, default=REPO / "pyproject.toml",
                    help="the pyproject.toml whose tool.mutmut the run used (its modules and tests)")
    ap.add_argument("--note", default="", help="a line on how the run was made, for the Markdown")
    ap.add_argument("--carry-over", action="store_true",
                    help="a module without results keeps its row of the scores.json in --out (marked as such)")
    args = ap.parse_args(argv)

    import mutmut  # the version the results came from

    equivalent = equivalents(args.out / "equivalent.md")
    rows = []
    conf = mutmut_config(args.config)
    dirs = args.mutants or [REPO / "mutants"]
    previous, unmeasured = {}, []
    if args.carry_over and (args.out / "scores.json").exists():
        previous = carried_rows(json.loads((args.out / "scores.json").read_text()))
    for path in conf["only_mutate"]:
        found = [d for d in dirs if (d / (path + ".meta")).exists()]
        if found:
            row = score_module(path, json.loads((found[0] / (path + ".meta")).read_text()), equivalent)
            if len(dirs) > 1 or args.carry_over:  # a narrowed run, scored beside others
                row["selection"] = run_selection(found[0], conf)
            rows.append(row)
        elif module_name(path) in previous:
            rows.append(previous[module_name(path)])
        elif args.carry_over:
            unmeasured.append(path)  # neither measured now nor before: named as such
        else:
            print(f"no results for {path} (in {', '.join(map(str, dirs))}): run `make mutation` first",
                  file=sys.stderr)
            return 1
    total = {k: sum(m[k] for m in rows) for k in
             ("mutants", "killed", "timeout", "survived", "no_tests", "equivalent", "not_checked", "other")}
    judged = total["mutants"] - total["equivalent"]
    total["score"] = round(100.0 * (total["killed"] + total["timeout"]) / judged, 1) if judged else 0.0
    prov = provenance()
    doc = {
        "date": datetime.date.today().isoformat(),
        "mutmut": getattr(mutmut, "__version__", "unknown"),
        "provenance": {"commit": prov.get("commit"), "clean": prov.get("clean"), "dirty": prov.get("dirty", [])},
        "selection": conf["pytest_add_cli_args_test_selection"],
        "wall_s": args.wall_s,
        "note": args.note,
        "target": TARGET,
        "modules": rows,
        "not_measured": unmeasured,
        "total": total,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scores.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "scores.md").write_text(markdown(doc))
    print(markdown(doc))
    if total["not_checked"] and not args.partial:
        print(f"{total['not_checked']} mutants not checked: the run did not finish", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
