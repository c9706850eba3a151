"""Live: two real vllm serve replicas sharing one pool (harness.live_scenarios)."""

import pytest

from harness import live_scenarios as S
from harness.workload import Corpus

pytestmark = pytest.mark.live


@pytest.fixture
def corpus(tiny_model):
    return Corpus(tiny_model)


def test_cross_replica_hit_is_byte_exact_and_output_unchanged(live, corpus, test_seed):
    v = S.cross_replica_hit(live, corpus, test_seed)
    assert v.valid is True, v
    assert v.evidence["installed"] == 39 and v.evidence["in_pool"] == 39 and v.evidence["chunks"] == 3


def test_partial_hit_loads_only_complete_common_blocks(live, corpus, test_seed):
    v = S.partial_hit(live, corpus, test_seed)
    assert v.valid is True, v
    assert v.evidence["loaded_blocks"] == 7


def test_shared_system_prompt_is_computed_once(live, corpus, test_seed):
    v = S.shared_system_prompt(live, corpus, test_seed)
    assert v.valid is True, v


def test_local_hit_remote_hit_and_miss_are_told_apart(live, corpus, test_seed):
    v = S.hit_kinds(live, corpus, test_seed)
    assert v.valid is True, v


@pytest.mark.parametrize("kind", [pytest.param(k, marks=getattr(pytest.mark, f"fault_{k}"))
                                  for k in ("corrupt", "transport_error", "timeout", "evict")])
def test_failed_load_is_recomputed_with_unchanged_output(live, corpus, test_seed, kind):
    v = S.load_failure(live, corpus, test_seed, kind)
    assert v.valid is True, v


@pytest.mark.fault_pool_restart
def test_pool_killed_and_restarted_under_live_replicas(live, corpus, test_seed):
    v = S.pool_restart(live, corpus, test_seed)
    assert v.valid is True, v


@pytest.mark.fault_corrupt
def test_policy_fail_ends_the_request_explicitly(live, corpus, test_seed):
    v = S.load_failure_fail(live, corpus, test_seed)
    assert v.valid is True, v


def test_off_on_on_off_six_turn_sessions(live, corpus, test_seed, record_property):
    v = S.sessions(live, corpus, test_seed)
    record_property("ttft_median_ms_cross_turns", v.evidence["ttft_median_ms_cross_turns"])
    assert v.valid is True, v


def test_another_model_revision_finds_the_blocks_incompatible(live, corpus, test_seed, tmp_path_factory):
    from fixtures.tiny_model import build_tiny_model
    from harness.cluster import ReplicaSpec

    r2 = build_tiny_model(tmp_path_factory.mktemp("model-r2") / "tiny", seed=0, revision="r2")
    live.add_replica(ReplicaSpec("C", core="0", model_dir=r2, audit=True, max_num_batched_tokens=2048))
    try:
        v = S.revision_mismatch(live, corpus, test_seed, replica="C")
    finally:
        live.remove_replica("C")
    assert v.valid is True, v


@pytest.mark.fault_stream_delay
def test_delayed_store_keeps_blocks_until_copied_and_control_is_caught(live, small_replica, corpus, test_seed):
    v = S.stream_delay_store(live, corpus, test_seed, replica=small_replica)
    assert v.valid is True, v
    live.reset()
    control = S.stream_delay_store(live, corpus, test_seed, replica=small_replica, control=True)
    assert control.valid is False, f"negative control not caught: {control}"
    assert control.evidence["pooled_blocks_differing"] > 0 and control.evidence["x_blocks_reused_by_y"] > 0, control


@pytest.mark.fault_stream_delay
def test_delayed_load_is_waited_for_and_control_is_caught(live, small_replica, corpus, test_seed):
    v = S.stream_delay_load(live, corpus, test_seed, replica=small_replica)
    assert v.valid is True, v
    live.reset()
    control = S.stream_delay_load(live, corpus, test_seed, replica=small_replica, control=True)
    assert control.valid is False, f"negative control not caught: {control}"
    assert control.evidence["blocks_read_before_copy"] > 0, control
