"""Two LoRA adapters of one model never share KV through the pool, live: replicas E and F
of the tiny model serve two seeded adapters on k_proj and v_proj (kvgate.fixtures.tiny_model.
build_tiny_lora), so one prompt's KV differs by adapter. E computes a prompt under
adapter ad1 and publishes it; on F the same prompt under ad2, and under the base model,
finds nothing in the pool (the adapter seeds the key chain); the positive control, the
same prompt under ad1 on F, loads E's blocks and computes E's tokens."""

from __future__ import annotations

import random
import time

import pytest

from kvgate.fixtures.tiny_model import build_tiny_lora, build_tiny_model
from kvgate.harness.checkers.history import records
from kvgate.harness.client import http
from kvgate.harness.client.http import complete
from kvgate.harness.workload.prompts import Corpus

pytestmark = pytest.mark.live
PROMPT_TOKENS = 12 * 128 + 40


@pytest.fixture(scope="module")
def lora_cluster(live_report_dir):
    from kvgate.harness.system.cluster import DEFAULT_CHUNK, Cluster, ReplicaSpec

    root = live_report_dir / "lora"
    model = build_tiny_model(root / "tiny", seed=0, revision="r1")
    adapters = {name: build_tiny_lora(root / name, seed) for name, seed in (("ad1", 1), ("ad2", 2))}
    args = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()))
    cluster = Cluster(model, root / "cluster", page_size=128 * 1024, pool_pages=256)
    specs = [ReplicaSpec(name, core=core, kv_bytes=256 * 2**20, audit=True, max_num_batched_tokens=DEFAULT_CHUNK,
                         extra_args=args) for name, core in (("E", "0"), ("F", "1"))]
    recorder = http.RECORDER  # the session's cluster records the harness's requests: give it back after
    cluster.start(specs)
    try:
        yield cluster, model
    finally:
        cluster.stop()
        http.RECORDER = recorder


def _lookup(cluster, tag: str) -> dict:  # noqa: ANN001
    (rec,) = records(cluster.history_dir, "lookup", tag=tag)
    return rec


def test_two_adapters_share_no_kv_and_one_adapter_does(lora_cluster, test_seed):
    cluster, model = lora_cluster
    E, F = cluster.replicas["E"].url, cluster.replicas["F"].url
    prompt = Corpus(model).text(PROMPT_TOKENS, random.Random(test_seed))
    tag = f"lora-{test_seed % 10**6}"
    e = complete(E, prompt, tag=f"{tag}-e-ad1", replica="E", model="ad1", max_tokens=8)
    deadline = time.monotonic() + 60
    while not any(r.get("committed") for r in records(cluster.history_dir, "publish", tag=f"{tag}-e-ad1")):
        assert time.monotonic() < deadline, "E's blocks under ad1 were never published"
        time.sleep(0.2)
    other = complete(F, prompt, tag=f"{tag}-f-ad2", replica="F", model="ad2", max_tokens=8)
    base = complete(F, prompt, tag=f"{tag}-f-base", replica="F", model="tiny", max_tokens=8)
    same = complete(F, prompt, tag=f"{tag}-f-ad1", replica="F", model="ad1", max_tokens=8)
    full = PROMPT_TOKENS // 128
    for t in (f"{tag}-f-ad2", f"{tag}-f-base"):  # another adapter, or none: nothing of E's ad1 KV
        rec = _lookup(cluster, t)
        assert rec["external_tokens"] == 0 and rec["miss_cause"] == "never_published", rec
    rec = _lookup(cluster, f"{tag}-f-ad1")  # the positive control: the same adapter shares
    assert rec["outcome"] == "remote_hit" and rec["hit_blocks"] == full, rec
    assert same.token_ids == e.token_ids  # (log-probabilities: another prefill partition than E's)
    # The adapters do change the KV (else the test would prove nothing): other outputs.
    assert (other.token_ids, other.logprobs) != (e.token_ids, e.logprobs)
    assert (base.token_ids, base.logprobs) != (e.token_ids, e.logprobs)
