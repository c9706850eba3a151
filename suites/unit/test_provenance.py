"""A carried tree is checked against its stamp before a report says where it came from:
a tree stamped with `python -m kvgate.harness.provenance --stamp` and carried unchanged is
verified (and clean where the stamp says so); a file changed, removed or a code file added
after stamping, a stamp without the tree's digest and no stamp at all make it unverified,
never clean, and the reports' titles say so."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvgate.harness import provenance as P


def _git(root, *args):  # noqa: ANN001, ANN002, ANN202
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True,
                   capture_output=True)


@pytest.fixture
def carried(tmp_path, monkeypatch):
    """A committed tree, stamped by `--stamp` as on the machine that carries it, then read
    as the carried copy is (KVGATE_PROVENANCE=stamp)."""
    root = tmp_path / "tree"
    (root / "kvpool").mkdir(parents=True)
    (root / "kvpool" / "arena.py").write_text("PAGE = 4096\n")
    (root / "README.md").write_text("kvgate\n")
    (root / ".gitignore").write_text(".provenance.json\nreports/runs/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "tree")
    monkeypatch.setattr(P, "REPO", root)
    monkeypatch.setattr(P, "STAMP", root / ".provenance.json")
    monkeypatch.delenv("KVGATE_PROVENANCE", raising=False)
    P.provenance.cache_clear()
    assert P.main(["--stamp"]) == 0
    monkeypatch.setenv("KVGATE_PROVENANCE", "stamp")
    P.provenance.cache_clear()
    yield root
    P.provenance.cache_clear()


def test_an_unchanged_carried_tree_is_verified_and_clean(carried):
    prov = P.provenance()
    assert prov["stamped"] and prov["verified"] is True and prov["clean"] is True
    assert P.title_flag(prov) == ""
    (carried / "reports" / "runs").mkdir(parents=True)
    (carried / "reports" / "runs" / "out.py").write_text("# a run's own output\n")
    P.provenance.cache_clear()
    assert P.provenance()["verified"] is True


def test_a_file_changed_after_stamping_is_unverified(carried):
    (carried / "kvpool" / "arena.py").write_text("PAGE = 8192\n")  # edited on the carrying host
    prov = P.provenance()
    assert prov["clean"] is False and prov["verified"] is False
    assert prov["unverified"] == ["changed: kvpool/arena.py"]
    assert P.title_flag(prov) == " (UNVERIFIED TREE)"


def test_a_missing_file_or_an_added_code_file_is_unverified(carried):
    (carried / "README.md").unlink()
    (carried / "kvpool" / "extra.py").write_text("import os\n")
    prov = P.provenance()
    assert not prov["verified"] and set(prov["unverified"]) == {"missing: README.md", "added: kvpool/extra.py"}


def test_a_stamp_without_the_trees_digest_or_no_stamp_is_unverified(carried):
    doc = json.loads(P.STAMP.read_text())
    P.STAMP.write_text(json.dumps({k: doc[k] for k in ("commit", "clean", "dirty")}))  # the old stamp
    prov = P.provenance()
    assert prov["commit"] == doc["commit"] and not prov["verified"] and not prov["clean"]
    P.STAMP.unlink()
    P.provenance.cache_clear()
    prov = P.provenance()
    assert prov["commit"] == "unknown" and P.title_flag(prov) == " (UNVERIFIED TREE)"


def test_a_stamp_whose_file_list_was_edited_does_not_match_its_digest(carried):
    doc = json.loads(P.STAMP.read_text())
    (carried / "kvpool" / "arena.py").write_text("PAGE = 8192\n")
    doc["files"]["kvpool/arena.py"] = P.file_digest(carried / "kvpool" / "arena.py")
    P.STAMP.write_text(json.dumps(doc))
    assert not P.provenance()["verified"]


def test_verify_exits_1_on_an_unverified_tree(carried, capsys):
    assert P.main(["--verify"]) == 0
    (carried / "kvpool" / "arena.py").write_text("PAGE = 1\n")
    assert P.main(["--verify"]) == 1
    assert "UNVERIFIED TREE" in capsys.readouterr().err


def test_a_dirty_stamped_tree_is_verified_but_dirty(carried, monkeypatch):
    monkeypatch.delenv("KVGATE_PROVENANCE")
    (carried / "kvpool" / "arena.py").write_text("PAGE = 2\n")  # uncommitted, then stamped
    P.provenance.cache_clear()
    assert P.main(["--stamp"]) == 0
    monkeypatch.setenv("KVGATE_PROVENANCE", "stamp")
    P.provenance.cache_clear()
    prov = P.provenance()
    assert prov["verified"] is True and prov["clean"] is False and P.title_flag(prov) == " (DIRTY TREE)"


def test_the_reports_titles_carry_the_flag(carried, tmp_path):
    from kvgate.harness.conformance.gate import write_matrix
    from kvgate.harness.report.gpu_live import render_markdown

    (carried / "kvpool" / "arena.py").write_text("PAGE = 8192\n")
    prov = P.provenance()
    md = render_markdown({"env": {"gpu": "H200", "provenance": prov}, "seed": 1}, "2026-12-03")
    assert md.splitlines()[0].endswith("(UNVERIFIED TREE)") and "changed: kvpool/arena.py" in md
    row = {"connector": "x", "versions": {}, "cells": {}}
    matrix = write_matrix([row], tmp_path / "m", 1)["markdown"].read_text()
    assert matrix.splitlines()[0] == "# kvgate conformance matrix (UNVERIFIED TREE)"


@pytest.mark.parametrize("change", ["edit", "commit"])
def test_a_tree_that_changes_under_a_run_is_not_clean_and_says_why(carried, tmp_path, monkeypatch, change):
    """The matrix's provenance is the tree when the run started; a tree edited or committed to
    before the matrix is written makes it not clean, with what changed."""
    from kvgate.harness.conformance.gate import write_matrix

    monkeypatch.delenv("KVGATE_PROVENANCE")  # this host's own git tree
    P.provenance.cache_clear()
    assert P.provenance()["clean"] is True  # the run starts
    (carried / "kvpool" / "arena.py").write_text("PAGE = 8192\n")
    if change == "commit":
        _git(carried, "commit", "-qam", "during the run")
    doc = json.loads(write_matrix([{"connector": "x", "versions": {}, "cells": {}}], tmp_path / "m", 1)["json"]
                     .read_text())
    assert doc["provenance"]["clean"] is False
    if change == "edit":
        assert doc["provenance"]["dirty"] == ["kvpool/arena.py"]
    else:
        assert len(doc["provenance"]["dirty"]) == 1 and "during the run" in doc["provenance"]["dirty"][0]
    assert doc["provenance_at_end"]["commit"] == P.provenance.__wrapped__()["commit"]
