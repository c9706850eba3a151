"""The history checkers (kvgate.harness.checkers) on small hand-built histories: each passes a
good history and catches the defect it exists for."""

import json

import pytest

from kvgate.harness.checkers.byte_exact import byte_exact
from kvgate.harness.checkers.history import window
from kvgate.harness.checkers.miss_causes import miss_causes
from kvgate.harness.checkers.outcome import classify
from kvgate.harness.checkers.requests import requests

NS = {"model_id": "m", "model_revision": "r1"}


def rec(ev, t, replica="B", **fields):
    return {"ev": ev, "t": t, "replica": replica, "role": "worker", **fields}


def good_history():
    return [
        rec("namespace", 0.0, "A", ns=NS),
        rec("namespace", 0.0, "B", ns=NS),
        rec("request", 0.5, "harness", phase="invoke", tag="a", replica_name="A"),
        rec("audit", 1.0, "A", kind="produced", tag="a", block_ids=[3, 4], hashes=["h0", "h1"], digests=["d0", "d1"]),
        rec("lookup", 2.0, "B", tag="b", outcome="remote_hit", miss_cause=None),
        rec("fault", 2.1, "B", site="pool_client.read_page", kind="corrupt", block=1),
        rec("load", 2.2, "B", tag="b", blocks=2, loaded=1, failed_block_ids=[8], miss_cause="corrupt"),
        rec("audit", 2.3, "B", kind="seen", tag="b", block_ids=[7, 8], hashes=["h0", "h1"], digests=["d0", "zz"],
            step=5, pid=11),
        rec("audit", 2.4, "B", kind="installed", tag="b", block_ids=[7, 8], hashes=["h0", "h1"], digests=["d0", "zz"],
            step=5, pid=11),
        rec("audit_load_errors", 2.5, "B", block_ids=[8], step=5, pid=11),
    ]


def test_byte_exact_passes_a_good_history_and_exempts_blocks_the_engine_was_told_failed():
    v = byte_exact(good_history())
    assert v.valid is True, v
    assert v.evidence["blocks_checked"] == 2


def test_byte_exact_catches_a_failed_block_the_engine_was_not_told_about():
    history = [r for r in good_history() if r["ev"] != "audit_load_errors"]
    v = byte_exact(history)
    assert v.valid is False and v.evidence["silent_corruptions"] == 2  # seen and installed


def test_byte_exact_exempts_a_failed_block_only_in_the_step_that_installed_it():
    """A later step's load error with a reused block id must not excuse an earlier corrupt
    install (nor one of another worker process)."""
    for other in ({"step": 6, "pid": 11}, {"step": 5, "pid": 12}):
        history = [r for r in good_history() if r["ev"] != "audit_load_errors"]
        history.append(rec("audit_load_errors", 2.5, "B", block_ids=[8], **other))
        v = byte_exact(history)
        assert v.valid is False and v.evidence["silent_corruptions"] == 2, other


def test_byte_exact_is_unknown_for_a_replica_that_loaded_without_an_audit():
    history = good_history() + [rec("load", 3.0, "C", tag="c", blocks=3, loaded=3, failed_block_ids=[],
                                    miss_cause=None)]
    v = byte_exact(history)
    assert v.valid is None and v.evidence["unaudited_replicas"] == ["C"]


def test_byte_exact_catches_a_pooled_copy_that_is_not_the_producers():
    v = byte_exact(good_history(), pool_digest=lambda replica, hashes: {"h0": "d0", "h1": "other"})
    assert v.valid is False and v.evidence["first"][0]["kind"] == "committed"


def test_byte_exact_compares_only_within_one_namespace():
    history = good_history()
    history[0] = rec("namespace", 0.0, "A", ns={**NS, "model_revision": "r2"})
    v = byte_exact(history)
    assert v.valid is None and v.evidence["unverified"] == 2  # no producer of B's namespace


def test_miss_causes_passes_a_fault_with_its_cause():
    v = miss_causes(good_history())
    assert v.valid is True, v


@pytest.mark.parametrize("defect", ["wrong_cause", "unexplained", "two_causes", "no_cause", "accounting"])
def test_miss_causes_catches(defect):
    history = good_history()
    load = next(r for r in history if r["ev"] == "load")
    if defect == "wrong_cause":
        load["miss_cause"] = "timeout"
    elif defect == "unexplained":
        history = [r for r in history if r["ev"] != "fault"]
    elif defect == "two_causes":
        load.update(loaded=2, failed_block_ids=[])  # complete, yet it names a cause
    elif defect == "no_cause":
        next(r for r in history if r["ev"] == "lookup").update(outcome="miss", miss_cause=None)
    else:
        load["failed_block_ids"] = []
    v = miss_causes(history)
    assert v.valid is False and v.evidence["misclassified"] >= 1, v


def test_two_loads_at_once_each_struck_by_its_own_firing_are_both_explained():
    """Two loads of one replica run at once and each is struck by a firing of the evict fault;
    the firings' records carry no tag, and the loads end in either order. Each firing explains
    one load (the campaign's seed 16639218148766447083 of `soak`: the second load was called
    unexplained when both firings were given to the first). Control: one firing for two short
    loads leaves one unexplained."""
    def history(firings: int) -> list[dict]:
        return [rec("fault", 1.0 + 0.001 * i, "B", site="pool_client.acquire", kind="evict", block=3)
                for i in range(firings)] + [
            rec("load", 1.010, "B", tag="x", blocks=6, loaded=3, failed_block_ids=[4, 5, 6], miss_cause="evicted"),
            rec("load", 1.011, "B", tag="y", blocks=6, loaded=3, failed_block_ids=[7, 8, 9], miss_cause="evicted")]
    v = miss_causes(history(2))
    assert v.valid is True, v
    v = miss_causes(history(1))
    assert v.valid is False and "load y on B: evicted with no injected fault" in v.reason, v


def test_many_firings_that_end_nothing_may_strike_one_load():
    """A slow link fires on every page frame of one load, which ends with no miss."""
    history = [rec("fault", 1.0 + 0.001 * i, "D", site="proxy", kind="slow") for i in range(6)] + [
        rec("load", 1.5, "D", tag="s", blocks=6, loaded=6, failed_block_ids=[], miss_cause=None)]
    v = miss_causes(history)
    assert v.valid is True, v


def test_a_firing_strikes_a_load_that_reaches_its_block_not_a_shorter_one_ending_just_after():
    """The campaign's soak seed 7303238380334646157: a timeout firing at block 3 of B's lease,
    a one-block load of B ending 1 ms after it (not struck), the struck twelve-block load ending
    10 s later with a timeout at block 3. Control: the struck load ending at another block is
    caught."""
    def history(miss_index: int) -> list[dict]:
        return [rec("fault", 1.0, "B", site="pool_client.read_page", kind="timeout", block=3, lease=7),
                rec("load", 1.001, "B", tag="short", first_block=0, blocks=1, loaded=1, failed_block_ids=[],
                    miss_cause=None, miss_index=None, seconds=0.004),
                rec("load", 11.25, "B", tag="struck", first_block=0, blocks=12, loaded=miss_index,
                    failed_block_ids=list(range(12 - miss_index)), miss_cause="timeout", miss_index=miss_index,
                    seconds=10.26)]
    v = miss_causes(history(3))
    assert v.valid is True, v
    v = miss_causes(history(5))  # a timeout where the firing was not
    assert v.valid is False and "load struck ended timeout at block 5, the firing struck block 3" in v.reason, v


def test_a_firing_is_not_given_to_a_load_that_started_after_it():
    """A timeout firing at block 3 whose load completes unharmed, and a later load, started long
    after the firing, that times out at block 3 on its own: the firing did not strike it (both
    found in review: the later load was taken as the struck one and the history passed). Caught:
    the firing's load ended with no miss, and the later timeout is unexplained."""
    history = [rec("fault", 1.0, "B", site="pool_client.read_page", kind="timeout", block=3, lease=7),
               rec("load", 1.2, "B", tag="unharmed", first_block=0, blocks=12, loaded=12, failed_block_ids=[],
                   miss_cause=None, miss_index=None, seconds=0.3),
               rec("load", 60.0, "B", tag="later", first_block=0, blocks=12, loaded=3,
                   failed_block_ids=list(range(9)), miss_cause="timeout", miss_index=3, seconds=10.3)]
    v = miss_causes(history)
    assert v.valid is False and "load unharmed ended as None" in v.reason, v


def test_an_evict_firing_explains_a_load_evicted_past_its_first_block_when_that_one_was_leased():
    """The evict fault names the first block of its run; a block another load holds leased stays,
    so the load ends evicted at a later block (a false report found in review). A load evicted
    before the firing's block is still caught."""
    def history(miss_index: int) -> list[dict]:
        return [rec("fault", 1.0, "B", site="pool_client.acquire", kind="evict", block=2, lease=7),
                rec("load", 1.01, "B", tag="e", first_block=0, blocks=6, loaded=miss_index,
                    failed_block_ids=list(range(6 - miss_index)), miss_cause="evicted", miss_index=miss_index,
                    seconds=0.02)]
    assert miss_causes(history(3)).valid is True
    v = miss_causes(history(1))
    assert v.valid is False and "ended evicted at block 1, the firing struck block 2" in v.reason, v


def test_a_corruption_in_a_shared_page_explains_another_replicas_corrupt_load_of_that_page():
    """The campaign's soak seed 7080717195702607883: B's corrupt firing flips a bit in page 466
    of the pool's shared segment and heals it 4 ms later; D's load read page 466 in between and
    ended corrupt. Controls: D's load of another page, or after the heal, stays unexplained."""
    def history(page: int, at: float) -> list[dict]:
        return [rec("fault", 1.000, "B", site="pool_arena.page", kind="corrupt", block=0, lease=9, page=466),
                rec("heal", 1.004, "B", site="pool_arena.page", kind="corrupt", lease=9),
                rec("load", 1.005, "B", tag="b", first_block=0, blocks=3, loaded=0, failed_block_ids=[1, 2, 3],
                    miss_cause="corrupt", miss_index=0, seconds=0.02),
                rec("load", at, "D", tag="d", first_block=0, blocks=3, loaded=0, failed_block_ids=[4, 5, 6],
                    miss_cause="corrupt", miss_index=0, seconds=0.02,
                    error=f"CorruptPage: block 0 (page {page}): installed bytes do not match the published digest")]
    assert miss_causes(history(466, 1.016)).valid is True
    unnamed = history(466, 1.016)
    unnamed[-1]["error"] = "CorruptPage: installed bytes do not match the published digest"
    assert miss_causes(unnamed).valid is False  # a load naming no page: its own replica's faults only
    for page, at in ((467, 1.016), (466, 1.5)):
        v = miss_causes(history(page, at))
        assert v.valid is False and "load d on D: corrupt with no injected fault" in v.reason, (page, at, v)


def test_transport_errors_while_the_pool_is_down_are_explained():
    history = [rec("nemesis", 1.0, "harness", action="pool_kill"),
               rec("lookup", 2.0, "B", tag="x", outcome="miss", miss_cause="transport_error"),
               rec("nemesis", 3.0, "harness", action="pool_restart")]
    assert miss_causes(history).valid is True
    history.append(rec("lookup", 4.0, "B", tag="y", outcome="miss", miss_cause="transport_error"))
    assert miss_causes(history).valid is False


def request_history(*ends):
    out = []
    for i, (phase, finish, replica) in enumerate(ends):
        out.append({"ev": "request", "t": i, "replica": "harness", "phase": "invoke", "tag": f"r{i}"})
        if phase:
            out.append({"ev": "request", "t": i + 0.5, "replica": "harness", "phase": phase, "tag": f"r{i}",
                        "finish_reason": finish, "total_s": 1.0, **({"replica": replica} if replica else {})})
    return out


def test_requests_catches_a_lost_request_and_classifies_it_as_liveness():
    v = requests(request_history(("ok", "length", None), (None, None, None)), {})
    assert v.valid is False and v.evidence["lost"] == 1
    assert classify(crashed=False, liveness=v, correctness=[]) == "liveness"


def test_an_error_is_explained_only_by_policy_fail_and_a_failed_load():
    history = request_history(("ok", "error", "A"))
    assert requests(history, {"A": "recompute"}).valid is False
    history.append({"ev": "load", "t": 0.2, "replica": "A", "tag": "r0", "failed_block_ids": [1]})
    assert requests(history, {"A": "fail"}).valid is True
    assert requests(history, {"A": "recompute"}).valid is False


def test_classify_orders_crash_before_liveness_before_correctness():
    ok = requests([], {})
    bad = byte_exact(good_history(), pool_digest=lambda r, h: {"h0": "x"})
    assert classify(crashed=True, liveness=ok, correctness=[bad]) == "crash"
    assert classify(crashed=False, liveness=ok, correctness=[bad]) == "correctness"
    assert classify(crashed=False, liveness=ok, correctness=[ok]) == "ok"


def test_window_reads_one_scenario_from_the_history(tmp_path):
    lines = [json.dumps(rec("lookup", t, tag=str(t), outcome="skipped")) for t in (1.0, 2.0, 3.0)]
    (tmp_path / "B.scheduler.1.jsonl").write_text("\n".join(lines) + "\n")
    assert [r["tag"] for r in window(tmp_path, 1.5, 3.0)] == ["2.0", "3.0"]


def test_expected_causes_holds_a_run_to_the_causes_its_scenario_declares():
    from kvgate.harness.checkers.miss_causes import expected_causes

    history = good_history()  # one load ended corrupt; its lookup hit
    assert expected_causes(history, ("corrupt",), ()).valid is True
    assert expected_causes(history, (), ()).valid is False  # a cause nobody declared
    assert expected_causes(history, ("corrupt", "timeout"), ()).valid is False  # a declared cause that never came
    assert expected_causes(history, ("corrupt",), ("incompatible",)).valid is False
    assert expected_causes(history, (), (), ("corrupt",)).valid is True  # allowed: an adversary's timing decides
    assert expected_causes(history, (), (), ("timeout",)).valid is False  # allowed, but another cause came
    assert expected_causes([], (), (), ("corrupt",)).valid is True  # allowed, not required


# -- the output oracle (kvgate.harness.checkers.output) over Checks.output's comparisons -------------
def _completion(tokens, logprobs):  # noqa: ANN001, ANN202
    from kvgate.harness.client.http import Completion

    return Completion(tag="t", replica="B", token_ids=list(tokens), text="", finish_reason="length", ttft_s=0.0,
                      total_s=0.0, prompt_tokens=1, logprobs=list(logprobs))


def test_the_output_oracle_fails_on_moved_log_probabilities_with_equal_tokens():
    from kvgate.harness.checkers.output import output, own_checks
    from kvgate.harness.checkers.verdict import Checks

    c = Checks()
    c.check("the load happened", True)
    c.output("same", _completion([5, 6], [-0.5, -0.25]), _completion([5, 6], [-0.5, -0.25]))
    c.output("moved", _completion([5, 6], [-0.5, -0.2500001]), _completion([5, 6], [-0.5, -0.25]))
    v = c.verdict("fine")
    assert v.valid is False
    out, own = output(v), own_checks(v)
    assert out.valid is False and out.evidence["differ"] == 1 and out.evidence["tokens_differ"] == 0
    assert "log-probabilities differ" in out.evidence["first"][0]
    assert own.valid is True  # the scenario's own checks held: only the output oracle is false


def test_the_output_oracle_names_the_first_differing_token_and_a_missing_completion():
    from kvgate.harness.checkers.output import output
    from kvgate.harness.checkers.verdict import Checks

    c = Checks()
    c.output("tokens", _completion([5, 6, 7], [-1, -1, -1]), _completion([5, 9, 7], [-1, -1, -1]))
    c.output("none", None, _completion([5], [-1]))
    v = output(c.verdict("fine"))
    assert v.valid is False and v.evidence["differ"] == 2
    assert "position 1" in v.evidence["first"][0] and "no completion" in v.evidence["first"][1]


def test_own_checks_fail_without_the_output_and_a_run_without_comparisons_passes_the_output_oracle():
    from kvgate.harness.checkers.output import output, own_checks
    from kvgate.harness.checkers.verdict import Checks, Verdict

    c = Checks()
    c.check("the pool held the blocks", False, 3)
    v = c.verdict("fine")
    assert own_checks(v).valid is False and output(v).valid is True and output(v).not_checked
    raised = Verdict(False, "AssertionError: boom")  # a run that raised: no comparisons at all
    assert own_checks(raised).valid is False and output(raised).valid is None


def test_output_across_partitions_requires_tokens_and_reports_the_log_probabilities():
    from types import SimpleNamespace

    from kvgate.harness.checkers.verdict import Checks

    ref = SimpleNamespace(token_ids=[1, 2, 3], logprobs=[-0.5, -0.25, -0.125])
    near = SimpleNamespace(token_ids=[1, 2, 3], logprobs=[-0.5, -0.25, -0.126])
    other = SimpleNamespace(token_ids=[1, 9, 3], logprobs=[-0.5, -0.25, -0.125])
    c = Checks()
    assert not c.output("same partition: to the last bit", near, ref, cached=(1280, 1280))
    assert c.output("other partition: tokens", near, ref, cached=(1280, 1408))
    assert c.outputs[-1]["partitions_differ"] and c.outputs[-1]["max_logprob_diff"] > 0
    assert not c.output("other partition, other tokens", other, ref, cached=(1280, 1408))
    assert "the partitions differ" in c.output_failed[-1] and "position 1" in c.output_failed[-1]


def test_exchange_exact_reads_the_pool_it_is_given_and_sees_a_page_that_differs_there(tmp_path):
    """The pool the oracle reads is the one passed (a GPU keeper's tier in gpu-live's tier
    exchanges), not the cluster's pool daemon: the same history judged against a stand-in
    store holding the producer's bytes passes, and against one where a page differs fails."""
    import contextlib
    import types

    from kvgate.harness.checkers.byte_exact import exchange_exact
    from kvpool.connector.history import HistoryWriter
    from kvpool.pool.digest import page_digest
    from kvpool.pool.keys import Namespace

    ns = Namespace("m", "r", "t", "bfloat16", "nhd", 16, 2, 2, 64)
    pages = {bytes([i]) * 16: bytes([i + 1]) * 64 for i in range(3)}
    keys = [k.hex() for k in pages]
    digests = [page_digest(p).hex() for p in pages.values()]
    for replica in ("A", "B"):
        w = HistoryWriter(tmp_path, replica, "worker")
        w.write("namespace", ns=ns.as_dict())
        kind, tag = ("produced", "a") if replica == "A" else ("installed", "b")
        w.write("audit", kind=kind, tag=tag, first_block=0, hashes=keys, digests=digests)
        w.close()

    class Store:
        def __init__(self, held):  # noqa: ANN001
            self.held = held

        @contextlib.contextmanager
        def client(self, name="oracle"):  # noqa: ANN001, ANN202
            yield self

        def acquire(self, ns_, hashes):  # noqa: ANN001, ANN202
            return types.SimpleNamespace(hits=[self.held[h] for h in hashes], lease_id=0)

        def read_page(self, lease, i):  # noqa: ANN001, ANN202
            return lease.hits[i]

    daemon = types.SimpleNamespace(client=lambda name="oracle": (_ for _ in ()).throw(AssertionError("not this one")))
    cluster = types.SimpleNamespace(history_dir=tmp_path, pool=daemon)
    good = exchange_exact(cluster, ("A", "a"), ("B", "b"), None, pool=Store(pages))
    assert good.valid is True and good.evidence["in_pool"] == 3, good
    moved = dict(pages)
    moved[next(iter(pages))] = b"\x09" * 64
    bad = exchange_exact(cluster, ("A", "a"), ("B", "b"), None, pool=Store(moved))
    assert bad.valid is False and bad.evidence["differs_from_pool"] == 1, bad


def test_read_history_leaves_out_a_record_still_being_written_and_reads_the_files_asked_for(tmp_path):
    """A writer's long line may reach its file in more than one write: a reader during the run
    must not read half of it (a JSONDecodeError, or a record cut short), and reads it once it is
    whole; a pattern names the files (one replica's worker)."""
    from kvpool.connector.history import HistoryWriter, read_history

    w = HistoryWriter(tmp_path, "A", "worker")
    w.write("publish", tag="t", blocks=1)
    w.close()
    HistoryWriter(tmp_path, "B", "worker").write("publish", tag="u", blocks=2)
    (path,) = tmp_path.glob("A.worker.*.jsonl")
    with open(path, "a") as f:
        f.write('{"ev": "store_queued", "t": 9e9, "tag": "t", "blo')  # the first write of a line
    assert [r["tag"] for r in read_history(tmp_path)] == ["t", "u"]
    assert [r["tag"] for r in read_history(tmp_path, "A.worker.*.jsonl")] == ["t"]
    with open(path, "a") as f:
        f.write('cks": 3}\n')  # its second
    assert [(r["ev"], r["tag"]) for r in read_history(tmp_path, "A.worker.*.jsonl")] == [("publish", "t"),
                                                                                         ("store_queued", "t")]
