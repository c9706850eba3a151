"""What an operator sees on live replicas: a non-streaming response carries the request's
kvpool attribution in its kv_transfer_params (hit kind, blocks loaded, miss cause), and the
replica's own /metrics carries kvpool's counters (vllm:kvpool_*), moved by those requests."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
import requests

from kvgate.harness.client.http import complete, http_status
from kvgate.harness.scenarios.live import wait_stored
from kvgate.harness.workload.prompts import Corpus

pytestmark = pytest.mark.live


def _metric(url: str, name: str, **labels: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}") + 1]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _attribution(url: str, prompt: str, tag: str) -> dict:
    status, text = http_status(url, {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                                     "kv_transfer_params": {"kvpool": {"tag": tag}}})
    assert status == 200, text
    return (json.loads(text).get("kv_transfer_params") or {}).get("kvpool") or {}


def test_responses_say_how_they_were_served_and_metrics_count_it(live, tiny_model, test_seed):
    corpus = Corpus(tiny_model)
    rng = random.Random(test_seed)
    a, b = live.replicas["A"].url, live.replicas["B"].url
    prompt = corpus.text(1100, rng)  # 8 complete blocks of 128 tokens
    before_hits = _metric(b, "vllm:kvpool_lookups_total", outcome="remote_hit")
    before_blocks = _metric(b, "vllm:kvpool_loaded_blocks_total", source="pool")
    cold = _attribution(a, prompt, f"obs-{test_seed}-a")
    assert cold["hit_kind"] == "cold" and cold["loaded_blocks"] == 0 and cold["miss_cause"] == "never_published"
    wait_stored(live, f"obs-{test_seed}-a", "A")  # A's publish ends after its response, on its own time
    hit = _attribution(b, prompt, f"obs-{test_seed}-b")
    assert hit["hit_kind"] == "remote" and hit["loaded_blocks"] == 8, hit
    again = _attribution(b, prompt, f"obs-{test_seed}-b2")
    assert again["hit_kind"] == "local", again
    # vLLM's stats reach /metrics on the engine's next logging interval: wait for them
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (_metric(b, "vllm:kvpool_lookups_total", outcome="remote_hit") > before_hits
                and _metric(b, "vllm:kvpool_loaded_blocks_total", source="pool") >= before_blocks + 8):
            break
        complete(b, "a nudge for the engine's next step", tag=f"obs-{test_seed}-nudge", replica="B", max_tokens=1)
        time.sleep(1.0)
    assert _metric(b, "vllm:kvpool_lookups_total", outcome="remote_hit") >= before_hits + 1
    assert _metric(b, "vllm:kvpool_loaded_blocks_total", source="pool") >= before_blocks + 8
    assert _metric(a, "vllm:kvpool_published_blocks_total") >= 8
    assert _metric(a, "vllm:kvpool_misses_total", cause="never_published") >= 1
