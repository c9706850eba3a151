"""The connector's scheduler side against a real pool, driven with the scheduler
outputs a chunked prefill produces (no engine needed): which blocks are published in
which step, which are loaded, and what the history says."""

from types import SimpleNamespace

import numpy as np
import pytest

from suites.connector.engine_calls import ask_matched
from kvgate.harness.system.pool import thread_pool
from kvpool.client.transfer import publish
from kvpool.connector.settings import ConnectorSettings, namespace_for
from kvpool.connector.scheduler import KVPoolScheduler

B = 128


def vllm_config(tmp_path):
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
    return SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1),
                           device_config=SimpleNamespace(device_type="cpu"))


def request(rid, tokens, **kvpool):
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                           kv_transfer_params={"kvpool": kvpool} if kvpool else None)


def step(new=(), cached=(), scheduled=None):
    """new: [(rid, block_ids, num_computed)], cached: [(rid, new_block_ids, num_computed)]."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=[ids], num_computed_tokens=n) for r, ids, n in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              new_block_ids=[[ids] if ids is not None else None for _, ids, _ in cached],
                                              num_computed_tokens=[n for _, _, n in cached], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled or {})


@pytest.fixture
def pool():
    d = thread_pool(page_size=128 * 1024, num_pages=64)
    yield d
    d.stop_thread()


def scheduler(pool, tmp_path, **kw):
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", history_dir=str(tmp_path / "h"), **kw)
    return KVPoolScheduler(vllm_config(tmp_path), settings)


def test_chunked_prefill_publishes_every_chunks_complete_blocks(pool, tmp_path):
    s = scheduler(pool, tmp_path)
    tokens = list(range(5001))
    r = request("r", tokens)
    assert ask_matched(s, r, 0) == (0, False)
    s.update_state_after_alloc(r, None, 0)
    ids = list(range(100, 140))
    m1 = s.build_connector_meta(step(new=[("r", ids[:16], 0)], scheduled={"r": 2048}))
    m2 = s.build_connector_meta(step(cached=[("r", ids[16:32], 2048)], scheduled={"r": 2048}))
    m3 = s.build_connector_meta(step(cached=[("r", ids[32:40], 4096)], scheduled={"r": 905}))
    m4 = s.build_connector_meta(step(cached=[("r", None, 5001)], scheduled={"r": 1}))
    assert [(x.first_block, x.block_ids) for x in m1.stores] == [(0, ids[:16])]
    assert [(x.first_block, x.block_ids) for x in m2.stores] == [(16, ids[16:32])]
    assert [(x.first_block, x.block_ids) for x in m3.stores] == [(32, ids[32:39])]  # 5001 // 128 = 39: no tail
    assert m4.stores == [] and not any(m.loads for m in (m1, m2, m3, m4))


def test_a_pooled_prefix_is_loaded_and_not_republished(pool, tmp_path):
    s = scheduler(pool, tmp_path)
    tokens = list(range(1000))  # 7 complete blocks
    with pool_client(pool) as c:
        ns = namespace_for(vllm_config(tmp_path), s.settings)
        publish(c, ns, s_hashes(s, tokens)[:5], [np.zeros(128 * 1024, np.uint8)] * 5)
    r = request("r", tokens, tag="t1")
    assert ask_matched(s, r, 0) == (5 * B, False)
    s.update_state_after_alloc(r, None, 5 * B)
    ids = list(range(8))
    m = s.build_connector_meta(step(new=[("r", ids, 5 * B)], scheduled={"r": 1000 - 5 * B}))
    assert [(x.first_block, x.block_ids, x.tag) for x in m.loads] == [(0, ids[:5], "t1")]
    assert [(x.first_block, x.block_ids) for x in m.stores] == [(5, ids[5:7])]


def test_publish_boundary_and_load_switch_per_request(pool, tmp_path):
    s = scheduler(pool, tmp_path)
    r = request("r", list(range(1000)), publish_tokens=300, load=False)
    assert ask_matched(s, r, 0) == (0, False)
    m = s.build_connector_meta(step(new=[("r", list(range(8)), 0)], scheduled={"r": 1000}))
    assert [(x.first_block, len(x.block_ids)) for x in m.stores] == [(0, 2)]  # 300 // 128 blocks


def test_unknown_settings_are_an_error():
    with pytest.raises(ValueError, match="unknown kvpool connector settings"):
        ConnectorSettings.from_extra({"pool": "unix:/x", "colour": "red"})
    with pytest.raises(ValueError, match="needs 'pool'"):
        ConnectorSettings.from_extra({})


def pool_client(pool):
    from kvpool.client.pool_client import PoolClient

    return PoolClient(f"unix:{pool.unix_path}", "default", "tok")


def s_hashes(s, tokens):
    from kvpool.pool.keys import block_hashes

    return block_hashes(tokens[: len(tokens) // B * B], B)


def _with(tmp_path, field):
    """The tiny config with one thing changed that changes the KV bytes."""
    cfg = vllm_config(tmp_path)
    if field == "model_revision":
        cfg.model_config.revision = "r2"
    elif field == "tokenizer_hash":
        other = tmp_path / "other-tokenizer"
        other.mkdir()
        (other / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
        cfg.model_config.tokenizer = str(other)
    elif field == "kv_dtype":
        cfg.cache_config.cache_dtype = "fp8_e4m3"
    elif field == "num_kv_heads":
        cfg.model_config.get_num_kv_heads = lambda pc: 4
    return cfg


def other_field_outcome(pool, tmp_path, field, key_control: bool = False):  # noqa: ANN001, ANN201
    """A producer of the tiny config publishes a prompt's blocks; a scheduler whose config
    differs in `field` looks the prompt up. Returns (tokens it would load, its lookup record).
    `key_control`: both reach the pool through kvgate.faults.backend with the namespace control
    that leaves the revision out of the key (as the live revision-mismatch control does)."""
    import json

    from kvgate.faults.backend import FaultyBackend
    from kvpool.connector.settings import connect_backend
    from kvpool.pool.keys import block_hashes

    factory = connect_backend
    if key_control:
        control = tmp_path / "faults.json"
        control.write_text(json.dumps({"namespace": {"drop": ["model_revision"]}}))

        def factory(settings, role, history, metrics):  # noqa: ANN001, ANN202
            return FaultyBackend(connect_backend(settings, role, history, metrics), control, history)

    tokens = list(range(1001))
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", history_dir=str(tmp_path / "h"))
    producer = KVPoolScheduler(vllm_config(tmp_path), settings, factory)
    keys = block_hashes(tokens[:896], B)
    publish(producer.backend, producer.ns, keys, [np.zeros(2 * 2 * B * 128 * 2, np.uint8) for _ in keys])
    s = KVPoolScheduler(_with(tmp_path, field), settings, factory)
    matched, _ = ask_matched(s, request("r", tokens), 0)
    lookup = [json.loads(line) for f in (tmp_path / "h").glob("*.jsonl") for line in f.read_text().splitlines()
              if '"lookup"' in line][-1]
    return matched, lookup


def isolated(matched: int, lookup: dict, field: str) -> bool:
    """The check: nothing would load, and the miss is `incompatible` naming exactly `field`."""
    return matched == 0 and lookup["miss_cause"] == "incompatible" and lookup["miss_fields"] == [field]


@pytest.mark.fault_revision_mismatch
@pytest.mark.parametrize("field", ["model_revision", "tokenizer_hash", "kv_dtype", "num_kv_heads"])
def test_a_replica_differing_in_one_kv_relevant_field_finds_the_blocks_incompatible(pool, tmp_path, field):
    matched, lookup = other_field_outcome(pool, tmp_path, field)
    assert isolated(matched, lookup, field), lookup


def test_control_a_key_without_the_revision_fails_the_same_check(pool, tmp_path):
    """The negative control of the test above, through the same check: with the revision
    left out of the key, the other revision would load the blocks and the check fails."""
    matched, lookup = other_field_outcome(pool, tmp_path, "model_revision", key_control=True)
    assert not isolated(matched, lookup, "model_revision")
    assert matched == 896 and lookup["outcome"] == "remote_hit", lookup  # it shares the other revision's KV


@pytest.mark.parametrize("params", [
    {"kvpool": {"publish_tokens": "x"}}, {"kvpool": "on"}, {"kvpool": {"load": "yes"}}, {"kvpool": {"tag": [1]}},
    {"kvpool": {"publish_tokens": -5}}, {"kvpool": {"typo": 1}}, "not a dict",
])
def test_a_malformed_request_is_served_without_the_pool_not_raised(pool, tmp_path, params):
    """An exception in a scheduler hook would end vLLM's engine core for every request: a
    malformed kv_transfer_params makes that one request skip the pool, and says why."""
    import json

    s = scheduler(pool, tmp_path)
    tokens = list(range(1001))
    keys = s_hashes(s, tokens)
    publish(s.backend, s.ns, keys, [np.zeros(2 * 2 * B * 128 * 2, np.uint8) for _ in keys])
    r = SimpleNamespace(request_id="bad", prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                        kv_transfer_params=params)
    assert ask_matched(s, r, 0) == (0, False)  # nothing loaded, although the blocks are pooled
    s.update_state_after_alloc(r, None, 0)
    meta = s.build_connector_meta(step(new=[("bad", list(range(8)), 0)], scheduled={"bad": 1001}))
    assert meta.stores == [] and meta.loads == []  # nothing published
    recs = [json.loads(line) for f in (tmp_path / "h").glob("*.jsonl") for line in f.read_text().splitlines()]
    bad = [x for x in recs if x["ev"] == "invalid_params"]
    assert len(bad) == 1 and bad[0]["error"], recs


# -- everything that changes KV is in the key ------------------------------------------------
def _lora(name, int_id, path):
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=str(path))


def _adapter(folder, weights: bytes):
    """An adapter folder of PEFT's layout whose weight file holds `weights`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA"}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _image(ident, offset, length):
    return SimpleNamespace(identifier=ident, mm_hash=ident, modality="image",
                           mm_position=SimpleNamespace(offset=offset, length=length))


def _hits_after_publishing(pool, tmp_path, producer, consumer):
    """Publish `producer`'s complete blocks under the keys its scheduler computed; return how
    many tokens `consumer` then finds."""
    s = scheduler(pool, tmp_path)
    ask_matched(s, producer, 0)
    hashes = s._reqs[producer.request_id].hashes
    with pool_client(pool) as c:
        ns = namespace_for(vllm_config(tmp_path), s.settings)
        publish(c, ns, hashes, [np.zeros(128 * 1024, np.uint8)] * len(hashes))
    return ask_matched(s, consumer, 0)[0]


@pytest.mark.parametrize("other,shared", [("same-content", True), ("same-name-id-path-other-content", False),
                                          ("no-adapter", False)])
def test_an_adapter_is_part_of_every_key_by_its_content(pool, tmp_path, other, shared):
    """The same adapter content under another name, id and path shares (the positive
    control); other weights rewritten into the same folder, loaded under the same name and
    id (vLLM's in-place reload), share nothing; nor does the base model."""
    tokens = list(range(1000))  # 7 complete blocks, all loadable (a token is left to compute)
    folder = _adapter(tmp_path / "ad", b"w1" * 64)
    a = request("a", tokens)
    a.lora_request = _lora("ad", 1, folder)
    b = request("b", tokens)
    s = scheduler(pool, tmp_path)
    ask_matched(s, a, 0)  # a's keys are taken under w1
    if other == "same-content":
        b.lora_request = _lora("another", 7, _adapter(tmp_path / "copy", b"w1" * 64))
    elif other == "same-name-id-path-other-content":
        _adapter(folder, b"w2" * 64)
        b.lora_request = _lora("ad", 1, folder)
    else:
        b.lora_request = None
    hashes = s._reqs["a"].hashes
    with pool_client(pool) as c:
        publish(c, namespace_for(vllm_config(tmp_path), s.settings), hashes,
                [np.zeros(128 * 1024, np.uint8)] * len(hashes))
    assert ask_matched(s, b, 0)[0] == (7 * B if shared else 0)


def test_an_adapter_whose_content_cannot_be_read_is_served_without_the_pool(pool, tmp_path):
    from kvpool.connector.history import read_history

    s = scheduler(pool, tmp_path)
    r = request("l", list(range(1000)))
    r.lora_request = _lora("gone", 1, tmp_path / "no-such-adapter")
    assert ask_matched(s, r, 0) == (0, False)
    assert s._reqs["l"].publish_blocks == 0 and not s._reqs["l"].load_allowed
    recs = [x for x in read_history(tmp_path / "h") if x["ev"] == "unsupported"]
    assert len(recs) == 1 and "LoRA adapter" in recs[0]["reason"], recs


@pytest.mark.parametrize("ident,hit_blocks", [("img-1", 7), ("img-2", 2)], ids=["same-image-control", "other-image"])
def test_a_multimodal_item_keys_the_blocks_it_overlaps_and_all_after(pool, tmp_path, ident, hit_blocks):
    tokens = list(range(1000))
    a = request("a", tokens)
    a.mm_features = [_image("img-1", 300, 100)]  # tokens 300-399: blocks 2 and 3
    b = request("b", tokens)
    b.mm_features = [_image(ident, 300, 100)]
    assert _hits_after_publishing(pool, tmp_path, a, b) == hit_blocks * B


def test_prompt_embeddings_are_served_without_the_pool_and_say_why(pool, tmp_path):
    from kvpool.connector.history import read_history

    s = scheduler(pool, tmp_path)
    r = request("e", list(range(1000)))
    r.prompt_embeds = object()  # any tensor: the keys cannot hash what the KV depends on
    assert ask_matched(s, r, 0) == (0, False)
    assert s._reqs["e"].publish_blocks == 0 and not s._reqs["e"].load_allowed
    recs = [x for x in read_history(tmp_path / "h") if x["ev"] == "unsupported"]
    assert len(recs) == 1 and "prompt embeddings" in recs[0]["reason"]


def test_an_engine_with_several_kv_cache_groups_neither_loads_nor_publishes(pool, tmp_path):
    settings = ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", history_dir=str(tmp_path / "h"))
    two = SimpleNamespace(kv_cache_groups=[object(), object()])
    s = KVPoolScheduler(vllm_config(tmp_path), settings, kv_cache_config=two)
    tokens = list(range(1000))
    with pool_client(pool) as c:  # the blocks are in the pool: a one-group engine loads all 7
        ns = namespace_for(vllm_config(tmp_path), settings)
        publish(c, ns, s_hashes(s, tokens), [np.zeros(128 * 1024, np.uint8)] * 7)
    r = request("g", tokens)
    assert ask_matched(s, r, 0) == (0, False)
    assert s._reqs["g"].publish_blocks == 0
    one = KVPoolScheduler(vllm_config(tmp_path), settings, kv_cache_config=SimpleNamespace(kv_cache_groups=[object()]))
    assert ask_matched(one, request("h", tokens), 0) == (7 * B, False)  # the control


def test_asynchronous_loads_are_handed_over_before_the_request_is_scheduled(pool, tmp_path):
    """load_mode async: the hit is claimed asynchronously, the load goes to the worker in
    the step after the allocation (vLLM holds the request meanwhile), the request's stores
    start past the loaded blocks; asked to match again before it was scheduled (its load
    failed: vLLM freed its blocks), it loads nothing more and its prompt is published anew."""
    s = scheduler(pool, tmp_path, load_mode="async")
    tokens = list(range(1000))  # 7 complete blocks
    with pool_client(pool) as c:
        ns = namespace_for(vllm_config(tmp_path), s.settings)
        publish(c, ns, s_hashes(s, tokens)[:5], [np.zeros(128 * 1024, np.uint8)] * 5)
    ids = list(range(40, 48))
    blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
    r = request("r", tokens, tag="t1")
    assert ask_matched(s, r, 0) == (5 * B, True)
    s.update_state_after_alloc(r, blocks, 5 * B)
    m = s.build_connector_meta(step())  # not scheduled: the load is handed over alone
    assert [(x.first_block, x.block_ids, x.tag) for x in m.async_loads] == [(0, ids[:5], "t1")]
    assert m.loads == [] and m.stores == []
    assert s.build_connector_meta(step()).async_loads == []  # handed over once
    # The load succeeded: scheduled with the loaded tokens computed, it stores the rest.
    m = s.build_connector_meta(step(new=[("r", ids, 5 * B)], scheduled={"r": 1000 - 5 * B}))
    assert m.loads == [] and [(x.first_block, x.block_ids) for x in m.stores] == [(5, ids[5:7])]

    r2 = request("r2", tokens, tag="t2")
    assert ask_matched(s, r2, 0) == (5 * B, True)
    s.update_state_after_alloc(r2, blocks, 5 * B)
    assert len(s.build_connector_meta(step()).async_loads) == 1
    assert s.get_num_new_matched_tokens(r2, 0) == (0, False)  # its load failed: no second try
    s.update_state_after_alloc(r2, blocks, 0)
    m = s.build_connector_meta(step(new=[("r2", ids, 0)], scheduled={"r2": 1000}))
    assert m.async_loads == [] and [(x.first_block, x.block_ids) for x in m.stores] == [(0, ids[:7])]


def test_load_mode_auto_follows_the_engines_scheduling(tmp_path):
    config = vllm_config(tmp_path)
    auto = ConnectorSettings.from_extra({"pool": "unix:/x"})
    assert auto.loads_async(config) is False  # no scheduler_config: synchronous, as on CPU
    config.scheduler_config = SimpleNamespace(async_scheduling=True)
    assert auto.loads_async(config) is True
    assert ConnectorSettings.from_extra({"pool": "unix:/x", "load_mode": "sync"}).loads_async(config) is False
    with pytest.raises(ValueError, match="load_mode must be one of"):
        ConnectorSettings.from_extra({"pool": "unix:/x", "load_mode": "later"})


def _lookups(tmp_path):
    from kvpool.connector.history import read_history

    return [x for x in read_history(tmp_path / "h") if x["ev"] == "lookup"]


@pytest.mark.parametrize("how", ["probe", "probe_off", "no_heartbeat"])
def test_a_whole_pooled_run_is_claimed_from_the_segment_index_while_the_daemon_beats(tmp_path, how):
    """A run the segment's index holds whole is claimed without a round trip; with the
    probe off, or a daemon whose heartbeat is absent (stale), the daemon's lookup answers.
    Either way the claim is the same; the daemon counts a lookup only in the second case."""
    d = thread_pool(page_size=128 * 1024, num_pages=64, heartbeat_s=0 if how == "no_heartbeat" else 0.02)
    try:
        s = scheduler(d, tmp_path, probe_fresh_s=0 if how == "probe_off" else 0.1)
        tokens = list(range(1000))  # 7 complete blocks, of which 7 are claimable ((1000 - 1) // 128)
        with pool_client(d) as c:
            ns = namespace_for(vllm_config(tmp_path), s.settings)
            publish(c, ns, s_hashes(s, tokens), [np.zeros(128 * 1024, np.uint8)] * 7)
        r = request("r", tokens, tag="t1")
        assert ask_matched(s, r, 0) == (7 * B, False)
        rec = _lookups(tmp_path)[-1]
        assert rec["outcome"] == "remote_hit" and rec["hit_blocks"] == 7
        assert (rec.get("via") == "probe") == (how == "probe")
        text = d.metrics.exposition()
        asked = 'kvpool_requests_total{op="lookup",result="ok"} 1.0' in text
        assert asked == (how != "probe"), text
        # a partial run always goes to the daemon, which says where and why it stops
        r2 = request("r2", tokens[:640] + [99_999] * 360, tag="t2")
        assert ask_matched(s, r2, 0) == (5 * B, False)
        rec = _lookups(tmp_path)[-1]
        assert "via" not in rec and rec["miss_cause"] == "never_published" and rec["miss_index"] == 5
    finally:
        d.stop_thread()


def test_a_finished_request_returns_its_attribution_and_the_scheduler_counts_its_lookups(pool, tmp_path):
    """request_finished hands vLLM the request's kvpool attribution (the response's
    kv_transfer_params): hit kind, blocks loaded, miss cause; a load vLLM reported invalid
    turns it into a fallback. The lookups are counted in the scheduler's connector stats."""
    s = scheduler(pool, tmp_path)
    tokens = list(range(1000))
    with pool_client(pool) as c:
        ns = namespace_for(vllm_config(tmp_path), s.settings)
        publish(c, ns, s_hashes(s, tokens)[:5], [np.zeros(128 * 1024, np.uint8)] * 5)
    hit, cold, failed = request("hit", tokens), request("cold", list(range(5000, 6000))), request("bad", tokens)
    assert ask_matched(s, hit, 0) == (5 * B, False) and ask_matched(s, cold, 0) == (0, False)
    assert ask_matched(s, failed, 0) == (5 * B, False)
    for r in (hit, failed):
        s.update_state_after_alloc(r, None, 5 * B)
    s.build_connector_meta(step(new=[("hit", list(range(8)), 5 * B), ("bad", list(range(10, 18)), 5 * B)],
                                scheduled={"hit": 1000 - 5 * B, "bad": 1000 - 5 * B}))
    s.update_connector_output(SimpleNamespace(invalid_block_ids={12}, kv_connector_stats=None))
    _, params = s.request_finished(hit, list(range(8)))
    assert params["kvpool"]["hit_kind"] == "remote" and params["kvpool"]["loaded_blocks"] == 5
    assert params["kvpool"]["miss_cause"] == "never_published" and params["kvpool"]["published_blocks"] == 7
    _, params = s.request_finished(cold, [])
    assert params["kvpool"]["hit_kind"] == "cold" and params["kvpool"]["loaded_blocks"] == 0
    _, params = s.request_finished(failed, list(range(10, 18)))
    assert params["kvpool"]["hit_kind"] == "fallback" and params["kvpool"]["loaded_blocks"] == 0
    stats = s.take_stats().reduce()
    assert stats["lookups_remote_hit"] == 2 and stats["lookups_miss"] == 1 and stats["misses_never_published"] == 3


def test_a_reset_takes_the_namespaces_blocks_out_of_the_pool_for_every_replica(pool, tmp_path):
    """reset_cache (vLLM's reset_external): what was published under the engine's namespace
    is no hit after it, for this scheduler and another replica's alike; it answers False
    while one of its requests' stores is unreported (a block computed before the reset could
    land after it), True once the worker reported it; what is published after it hits."""
    s = scheduler(pool, tmp_path, replica="a")
    other = scheduler(pool, tmp_path, replica="b")
    tokens = list(range(1000))  # 7 complete blocks
    ns = namespace_for(vllm_config(tmp_path), s.settings)
    with pool_client(pool) as c:
        publish(c, ns, s_hashes(s, tokens)[:5], [np.zeros(128 * 1024, np.uint8)] * 5)
    assert ask_matched(other, request("before", tokens), 0) == (5 * B, False)
    stored = request("stored", list(range(5000, 5300)))  # a request of s whose store is handed to the worker
    ask_matched(s, stored, 0)
    s.update_state_after_alloc(stored, None, 0)
    s.build_connector_meta(step(new=[("stored", [1, 2, 3], 0)], scheduled={"stored": 300}))
    assert s.request_finished(stored, [1, 2, 3])[0] is True  # held until the worker reports the store
    assert s.reset() is False  # a store of s is in flight: the caller retries
    for sched, rid in ((s, "a1"), (other, "b1")):
        assert ask_matched(sched, request(rid, tokens), 0) == (0, False)
    s.update_connector_output(SimpleNamespace(finished_sending={"stored"}, invalid_block_ids=None,
                                              kv_connector_stats=None))
    assert s.reset() is True
    with pool_client(pool) as c:
        publish(c, ns, s_hashes(s, tokens)[:3], [np.zeros(128 * 1024, np.uint8)] * 3)  # after the reset
    assert ask_matched(other, request("after", tokens), 0) == (3 * B, False)
    from kvgate.harness.checkers.history import records

    resets = records(tmp_path / "h", "reset")
    assert [r["ok"] for r in resets] == [False, True] and resets[0]["pages"] == {"evicted": 5}, resets


def test_a_request_that_reads_no_prefix_cache_claims_nothing_and_still_publishes(pool, tmp_path):
    """vLLM's skip_reading_prefix_cache (prompt_logprobs sets it): no lookup, no claim, the
    lookup record says why; the request computes its whole prompt and publishes it."""
    from kvpool.connector.history import read_history

    s = scheduler(pool, tmp_path)
    tokens = list(range(1000))
    with pool_client(pool) as c:
        publish(c, namespace_for(vllm_config(tmp_path), s.settings), s_hashes(s, tokens)[:5],
                [np.zeros(128 * 1024, np.uint8)] * 5)
    control = request("warm", tokens)
    assert ask_matched(s, control, 0) == (5 * B, False)  # the positive control: the blocks are there
    r = request("logprobs", tokens)
    r.skip_reading_prefix_cache = True
    assert ask_matched(s, r, 0) == (0, False)
    s.update_state_after_alloc(r, None, 0)
    meta = s.build_connector_meta(step(new=[("logprobs", list(range(8)), 0)], scheduled={"logprobs": 1000}))
    assert [(x.first_block, len(x.block_ids)) for x in meta.stores] == [(0, 7)] and not meta.loads
    rec = [x for x in read_history(tmp_path / "h") if x["ev"] == "lookup" and x["req"] == "logprobs"]
    assert [x["outcome"] for x in rec] == ["skipped"] and "skip_reading_prefix_cache" in rec[0]["reason"]


# -- a request's parameters and chain inputs, checked alone (kvpool.connector.params) --------

import hashlib  # noqa: E402

from kvpool.connector.params import (  # noqa: E402
    ChainInputs, RequestParams, UnsupportedInput, chain_inputs, kv_groups_unsupported, request_inputs, request_tag,
    salt_root)
from kvpool.pool.keys import HASH_BYTES, ROOT_HASH, block_hashes  # noqa: E402


@pytest.mark.parametrize("raw", [None, {}, {"other": 1}, {"kvpool": None}, {"kvpool": {}}],
                         ids=["none", "empty", "others_only", "kvpool_none", "kvpool_empty"])
def test_request_params_without_a_kvpool_section_load_and_publish_untagged(raw):
    assert RequestParams.parse(raw) == RequestParams(None, True, True, None, None)


def test_request_params_read_each_field_as_given():
    assert RequestParams.parse({"kvpool": {"tag": "t", "load": False, "publish": True, "publish_tokens": 32}}) == \
        RequestParams("t", False, True, 32, None)
    assert RequestParams.parse({"kvpool": {"tag": 7, "publish": False, "publish_tokens": 0}}) == \
        RequestParams("7", True, False, 0, None)
    # a flag given as null is the default
    assert RequestParams.parse({"kvpool": {"load": None, "publish": None}}) == RequestParams()


def test_request_params_that_are_not_objects_say_so_in_at_most_200_characters():
    long = "x" * 300
    p = RequestParams.parse(long)
    assert (p.load, p.publish, p.tag) == (False, False, None)
    assert p.error == f"kv_transfer_params must be an object, got {long!r}"[:200] and len(p.error) == 200
    p = RequestParams.parse({"kvpool": [long]})
    assert (p.load, p.publish, p.tag) == (False, False, None)
    assert p.error == f"kv_transfer_params.kvpool must be an object, got {[long]!r}"[:200] and len(p.error) == 200


def test_request_params_name_every_problem_turn_off_load_and_publish_and_keep_the_tag():
    p = RequestParams.parse({"kvpool": {"typo": 1, "tag": 1.5, "load": 1, "publish": "no", "publish_tokens": -1}})
    assert p == RequestParams(None, False, False, None,
                              "kv_transfer_params.kvpool: unknown field 'typo'; tag must be a string, got 1.5; "
                              "load must be true or false, got 1; publish must be true or false, got 'no'; "
                              "publish_tokens must be a non-negative integer, got -1")
    # the tag of a malformed request is kept (for its history), cut at 200 characters
    p = RequestParams.parse({"kvpool": {"tag": "t" * 300, "load": "yes"}})
    assert p.tag == "t" * 200 and p.error == "kv_transfer_params.kvpool: load must be true or false, got 'yes'"
    assert RequestParams.parse({"kvpool": {"tag": 9, "x": 0}}).tag == "9"
    # the whole error is cut at 400 characters
    p = RequestParams.parse({"kvpool": {f"field{i:03d}": 0 for i in range(50)}})
    assert len(p.error) == 400 and p.error.startswith("kv_transfer_params.kvpool: unknown field 'field000'; ")


@pytest.mark.parametrize("limit", [True, False, "5", 1.0, -1], ids=["true", "false", "string", "float", "negative"])
def test_publish_tokens_must_be_a_non_negative_integer_not_a_bool(limit):
    p = RequestParams.parse({"kvpool": {"publish_tokens": limit}})
    assert (p.load, p.publish) == (False, False)
    assert p.error == f"kv_transfer_params.kvpool: publish_tokens must be a non-negative integer, got {limit!r}"


def test_request_params_of_a_request_read_its_kv_transfer_params():
    assert RequestParams.of(SimpleNamespace(kv_transfer_params={"kvpool": {"tag": "a"}})).tag == "a"
    assert RequestParams.of(SimpleNamespace()) == RequestParams()


def test_a_requests_tag_is_its_own_tag_else_its_id():
    def req(**kvpool):
        return SimpleNamespace(request_id=42, kv_transfer_params={"kvpool": kvpool} if kvpool else None)

    assert request_tag(req(tag="mine")) == "mine"
    assert request_tag(req()) == "42"
    assert request_tag(req(tag="")) == "42"


def test_a_cache_salt_seeds_the_chain_and_no_salt_leaves_the_root():
    assert salt_root(SimpleNamespace()) == ROOT_HASH
    assert salt_root(SimpleNamespace(cache_salt=None)) == ROOT_HASH
    assert salt_root(SimpleNamespace(cache_salt="")) == ROOT_HASH
    assert salt_root(SimpleNamespace(cache_salt="s1")) == \
        hashlib.blake2b(b"kvgate/cache-salt/s1", digest_size=HASH_BYTES).digest()
    assert salt_root(SimpleNamespace(cache_salt="s1")) != salt_root(SimpleNamespace(cache_salt="s2"))


def test_chain_inputs_hash_complete_blocks_from_the_root_the_salt_or_both():
    tokens, bs = list(range(70)), 16  # 4 complete blocks, 6 tokens left over
    salt, root = b"\x05" * HASH_BYTES, b"\x09" * HASH_BYTES
    assert ChainInputs().hashes(tokens, bs) == block_hashes(tokens[:64], bs, parent=ROOT_HASH)
    assert ChainInputs(root).hashes(tokens, bs) == block_hashes(tokens[:64], bs, parent=root)
    assert ChainInputs().hashes(tokens, bs, salt) == block_hashes(tokens[:64], bs, parent=salt)
    both = hashlib.blake2b(salt + root, digest_size=HASH_BYTES).digest()
    assert ChainInputs(root).hashes(tokens, bs, salt) == block_hashes(tokens[:64], bs, parent=both)
    extras = (b"a", b"", b"b", b"", b"c", b"d")  # more than the complete blocks: cut to them
    assert ChainInputs(root, extras).hashes(tokens, bs) == \
        block_hashes(tokens[:64], bs, parent=root, extras=list(extras[:4]))
    assert len(ChainInputs().hashes(tokens[:15], bs)) == 0


def _mm(ident, offset, length, attr="identifier"):
    return SimpleNamespace(**{attr: ident}, mm_position=SimpleNamespace(offset=offset, length=length))


def _mm_digest(ident, offset):
    return hashlib.blake2b(f"{ident}@{offset}".encode(), digest_size=HASH_BYTES).digest()


def test_a_multimodal_item_is_mixed_into_exactly_the_blocks_it_overlaps():
    r = SimpleNamespace(prompt_token_ids=list(range(100)), mm_features=[_mm("img", 20, 20), _mm("v", 64, 1, "mm_hash")])
    got = chain_inputs(r, 16)  # 6 complete blocks; tokens 20-39: blocks 1 and 2; token 64: block 4
    assert got.root == ROOT_HASH
    assert got.extras == (b"", _mm_digest("img", 20), _mm_digest("img", 20), b"", _mm_digest("v", 64), b"")
    # an item reaching past the complete blocks marks them up to the last; one at offset 0 starts at block 0
    r = SimpleNamespace(prompt_token_ids=list(range(40)), mm_features=[_mm("a", 0, 1), _mm("b", 17, 100)])
    assert chain_inputs(r, 16).extras == (_mm_digest("a", 0), _mm_digest("b", 17))
    # two items in one block: both mixed into it, in their order
    r = SimpleNamespace(prompt_token_ids=list(range(40)), mm_features=[_mm("a", 2, 3), _mm("b", 8, 2)])
    assert chain_inputs(r, 16).extras == (_mm_digest("a", 2) + _mm_digest("b", 8), b"")
    # no items: no extras
    assert chain_inputs(SimpleNamespace(prompt_token_ids=list(range(40)), mm_features=[]), 16) == ChainInputs()
    assert chain_inputs(SimpleNamespace(), 16) == ChainInputs()


@pytest.mark.parametrize("feature", [
    _mm("", 0, 4), _mm("i", None, 4), _mm("i", 0, None), _mm("i", 0, 0), _mm("i", -1, 4), _mm("i", 0.0, 4),
    SimpleNamespace(identifier="i"), SimpleNamespace(identifier="i", mm_position=SimpleNamespace(offset=0)),
    SimpleNamespace(identifier="i", mm_position=SimpleNamespace(length=4)),
], ids=["no_hash", "no_offset", "no_length", "empty", "negative_offset", "float_offset", "no_position",
        "position_without_length", "position_without_offset"])
def test_a_multimodal_item_without_a_content_hash_or_position_is_unsupported(feature):
    r = SimpleNamespace(prompt_token_ids=list(range(40)), mm_features=[feature])
    with pytest.raises(UnsupportedInput, match=r"^a multimodal item without a content hash or a position \(SimpleNamespace\)$"):
        chain_inputs(r, 16)
    assert request_inputs(r, 16) == (ChainInputs(), "a multimodal item without a content hash or a position "
                                                    "(SimpleNamespace)")


def test_prompt_embeddings_are_unsupported_and_a_plain_request_is_not():
    r = SimpleNamespace(prompt_token_ids=list(range(40)), prompt_embeds=object())
    assert request_inputs(r, 16) == (ChainInputs(), "prompt embeddings: the KV depends on vectors the keys do not hash")
    assert request_inputs(SimpleNamespace(prompt_token_ids=list(range(40)), prompt_embeds=None), 16) == \
        (ChainInputs(), None)


def test_an_adapter_roots_the_chain_by_its_content(tmp_path):
    from kvpool.connector.adapter import adapter_identity

    lora = _lora("ad", 1, _adapter(tmp_path / "ad", b"w1" * 64))
    got = chain_inputs(SimpleNamespace(lora_request=lora), 16)
    assert got == ChainInputs(hashlib.blake2b(b"kvgate/lora/" + adapter_identity(lora), digest_size=HASH_BYTES).digest())
    r = SimpleNamespace(lora_request=_lora("gone", 1, tmp_path / "none"))
    with pytest.raises(UnsupportedInput):
        chain_inputs(r, 16)


def test_only_an_engine_with_more_than_one_kv_cache_group_is_unsupported():
    assert kv_groups_unsupported(None) is None
    assert kv_groups_unsupported(SimpleNamespace(kv_cache_groups=None)) is None
    assert kv_groups_unsupported(SimpleNamespace(kv_cache_groups=[object()])) is None
    assert kv_groups_unsupported(SimpleNamespace(kv_cache_groups=[object()] * 3)) == \
        "3 KV-cache groups: the connector moves one group's blocks"
