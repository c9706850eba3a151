"""Live: a load that fails is recomputed (policy recompute) or fails explicitly (policy
fail); nothing hangs and no request is lost. Faults are injected by wrapping the
replica's pool client (faults.backend), switched on without restarting the replica."""

import pytest

from harness.live_checks import records
from harness.workload import Corpus, complete

from .conftest import arm

pytestmark = pytest.mark.live


@pytest.mark.parametrize("kind,cause", [("corrupt", "corrupt"), ("transport_error", "transport_error"),
                                        ("timeout", "timeout")])
def test_policy_recompute_gives_the_baseline_output(live, tiny_model, rng, test_seed, kind, cause):
    corpus = Corpus(tiny_model)
    prompt = corpus.text(1500, rng)
    tag = f"r{kind[:3]}{test_seed % 10**8}"
    complete(live.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A")
    arm(live, "B", kind=kind, block=3)
    b = complete(live.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")
    cold = complete(live.replicas["B"].url, prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    h = live.history_dir
    (load,) = records(h, "load", tag=f"{tag}-b", replica="B")
    assert load["miss_cause"] == cause and load["loaded"] == 3 and load["miss_index"] == 3
    assert len(load["failed_block_ids"]) == load["blocks"] - 3
    assert [r["kind"] for r in records(h, "fault", replica="B") if r["t"] >= records(h, "lookup", tag=f"{tag}-b")[0]["t"]] == [kind]
    assert b.finish_reason == "length" and b.token_ids == cold.token_ids


def test_policy_fail_ends_the_request_explicitly(live, tiny_model, rng, test_seed):
    corpus = Corpus(tiny_model)
    prompt = corpus.text(1500, rng)
    tag = f"f{test_seed % 10**8}"
    complete(live.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")
    arm(live, "A", kind="corrupt", block=0)
    a = complete(live.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A", timeout_s=120)
    (load,) = records(live.history_dir, "load", tag=f"{tag}-a", replica="A")
    assert load["miss_cause"] == "corrupt" and load["loaded"] == 0
    assert a.finish_reason == "error" and a.token_ids == []
    # the replica still serves: the next request (fault healed after one firing) is fine
    again = complete(live.replicas["A"].url, prompt, tag=f"{tag}-a2", replica="A", timeout_s=120)
    assert again.finish_reason == "length" and len(again.token_ids) == 16
