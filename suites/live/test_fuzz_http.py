"""Hypothesis fuzz of what a client can put in a completion request's kv_transfer_params,
sent to a live replica (B) over HTTP: any JSON there, the "kvpool" section with known
fields of any type and unknown ones. Every request is answered, never with a server
error; afterwards every replica is healthy, the pool holds no open publish or lease
(accounting unchanged), and the replica still loads a pooled prefix and computes the
same tokens as the replica that published it."""

from __future__ import annotations

import random
import time

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from harness.client.http import complete, healthy
from harness.workload.prompts import Corpus

pytestmark = pytest.mark.live

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                                      max_size=4),
                    max_leaves=12)
FIELDS = ("tag", "load", "publish", "publish_tokens")
KVPOOL = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), JSON, max_size=5)
PARAMS = st.one_of(JSON, st.fixed_dictionaries({"kvpool": st.one_of(KVPOOL, JSON)}),
                   st.dictionaries(st.text(max_size=8), JSON, max_size=3).map(lambda d: {**d, "kvpool": d}))
EXAMPLES = 60


def _post(url: str, params: object) -> int:
    body = {"model": "tiny", "prompt": "the fuzzed request", "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": params}
    return requests.post(f"{url}/v1/completions", json=body, timeout=120).status_code


def test_any_kv_transfer_params_is_answered_and_harms_nothing(cluster, tiny_model, test_seed, record_property):
    cluster.reset()
    b = cluster.replicas["B"].url
    seen: dict[int, int] = {}

    @hseed(test_seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(params=PARAMS)
    def one(params: object) -> None:
        status = _post(b, params)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (status, params)

    one()
    record_property("statuses", seen)
    assert sum(seen.values()) >= EXAMPLES // 2, f"the fuzz ran {sum(seen.values())} requests"
    assert all(healthy(r.url) for r in cluster.replicas.values())
    with cluster.pool.client(name="fuzz-audit") as c:
        deadline = time.monotonic() + 30
        while (stats := c.stats())["open_reservations"] or stats["open_leases"]:
            assert time.monotonic() < deadline, f"the pool holds publishes or leases after the fuzz: {stats}"
            time.sleep(0.2)
    prompt = Corpus(tiny_model).text(8 * 16 + 5, random.Random(test_seed))
    a = complete(cluster.replicas["A"].url, prompt, tag="fuzz-after-a", replica="A", max_tokens=4)
    after = complete(b, prompt, tag="fuzz-after-b", replica="B", max_tokens=4)
    assert a.error is None and after.error is None, (a.error, after.error)
    assert a.token_ids == after.token_ids, "B (loading A's blocks) must compute A's tokens"
